"""The README's quick start and the collectives tour run under python and torchrun; the
examples read every config in configs/ with mmengine's Config."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from conftest import ROOT
from helpers_subprocess import run, script_env, torchrun


def test_readme_quickstart_is_the_example_file():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start\n\n```python\n(.*?)```", readme, re.S).group(1)
    assert block == (ROOT / "examples" / "quickstart.py").read_text()
    assert len(block.strip().splitlines()) <= 13  # ten lines of code, plus imports


def test_quickstart_single_process():
    out = run(["examples/quickstart.py"]).stdout
    assert "world=1 mean loss=0.00 stats=[{'rank': 0, 'sizes': [1]}]" in out


def test_quickstart_torchrun_two_ranks():
    out = torchrun(2, "examples/quickstart.py").stdout
    assert (
        "world=2 mean loss=0.50 stats=[{'rank': 0, 'sizes': [1, 2]}, {'rank': 1, 'sizes': [1, 2]}]"
    ) in out


def test_collectives_tour_single_process_and_four_ranks():
    single = run(["examples/collectives_tour.py"]).stdout
    assert "--- rank 0 of 1 ---" in single
    assert "broadcast_object_list: ['foo', 12, {1: 2}]" in single
    four = torchrun(4, "examples/collectives_tour.py").stdout
    for rank in range(4):
        assert f"--- rank {rank} of 4 ---" in four
    assert four.count("reduce_scatter: tensor(") == 4 and "reduce_scatter: tensor(12)" in four
    assert (
        "all_to_all (uneven): [tensor([5]), tensor([17, 18]), tensor([24]), tensor([36])]" in four
    )


CONFIGS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.py"))


@pytest.mark.parametrize("path", CONFIGS)
def test_every_config_loads_with_mmengine(path):
    from common import load_config  # examples/common.py

    cfg = load_config(str(ROOT / path))
    assert cfg.filename == str(ROOT / path) and cfg.to_dict()
    assert "_base_" not in cfg.to_dict()


def test_base_values_arrive_through_two_levels_of_inheritance():
    from common import load_config

    # eval.py <- classification.py <- _base_/*.py
    cfg = load_config(str(ROOT / "configs" / "eval.py"))
    assert cfg.eval.split == "val" and cfg.eval.batch_size == 64  # its own
    assert cfg.train.epochs == 6 and cfg.model.hidden == 64  # classification.py's
    assert cfg.dist_cfg.to_dict() == {"launcher": "auto", "backend": None, "timeout": 1800}
    assert cfg.data.val.num_samples == 1001 and cfg.seed == 2026 and cfg.work_dir is None


def test_cfg_options_parse_and_merge_as_in_mmengine():
    from common import config_parser, load_config

    argv = ["--cfg-options", "train.epochs=2", "train.lr=0.5", "data.noise=None", "model.depth=1"]
    options = config_parser("test", "classification.py").parse_args(argv).cfg_options
    assert options == {"train.epochs": 2, "train.lr": 0.5, "data.noise": None, "model.depth": 1}
    cfg = load_config(str(ROOT / "configs" / "eval.py"), options)
    assert (cfg.train.epochs, cfg.train.lr, cfg.data.noise, cfg.model.depth) == (2, 0.5, None, 1)
    assert cfg.train.momentum == 0.9 and cfg.model.hidden == 64  # the rest of each dict stays


def test_an_override_changes_the_run(tmp_path):
    import torch

    work = tmp_path / "run"
    options = ["train.epochs=1", "model.hidden=8", "data.train.num_samples=96"]
    run(["examples/train.py", "--work-dir", str(work), "--cfg-options", *options])
    with open(work / "metrics.json") as f:
        assert len(json.load(f)["epochs"]) == 1  # not the config's 6
    state = torch.load(work / "latest.pth", map_location="cpu", weights_only=True)
    assert state["config"]["model"]["hidden"] == 8
    assert state["config"]["data"]["train"]["num_samples"] == 96
    assert state["model"]["0.weight"].shape == (8, 32)  # the model was built with it


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("train.epoch=3", "train has no key 'epoch'; did you mean 'train.epochs'?"),
        ("model.hidden.width=3", "model.hidden is int 64, not a dict"),
        ("train.epochs", "expected key=value, got 'train.epochs'"),
    ],
)
def test_a_bad_override_is_a_usage_error_naming_the_key(option, message):
    proc = subprocess.run(
        [sys.executable, "examples/train.py", "--cfg-options", option],
        cwd=ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "usage: train.py" in proc.stderr and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
