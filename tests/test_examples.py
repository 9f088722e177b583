"""The README's quick start and the collectives tour run under python and torchrun."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT
from helpers_subprocess import run, torchrun


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


@pytest.mark.parametrize("name", ["classification.py", "eval.py"])
def test_config_loader_reads_the_configs_as_mmengine_does(name):
    mmengine = pytest.importorskip("mmengine")
    from config import OverrideAction, load  # examples/config.py

    path = str(ROOT / "configs" / name)
    overrides = {"train.epochs": 3, "model": {"hidden": 8}, "dist_cfg.backend": "gloo"}
    ours = load(path, overrides)
    theirs = mmengine.Config.fromfile(path)
    theirs.merge_from_dict(overrides)
    assert ours.to_dict() == theirs.to_dict()
    assert ours.train.epochs == 3 and ours.filename == path
    # the command line gives the same overrides through both argparse actions
    import argparse

    from mmengine.config import DictAction

    argv = ["--cfg-options", "train.epochs=2", "train.lr=0.5", "data.noise=None"]
    for action in (OverrideAction, DictAction):
        parser = argparse.ArgumentParser()
        parser.add_argument("--cfg-options", nargs="+", action=action, default={})
        parsed = parser.parse_args(argv).cfg_options
        assert parsed == {"train.epochs": 2, "train.lr": 0.5, "data.noise": None}
    with pytest.raises(KeyError, match=r"did you mean 'train\.epochs'"):
        load(path, {"train.epoch": 3})  # mmengine would add the typo silently
