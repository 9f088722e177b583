"""The README's quick start and the collectives tour run under python and torchrun."""

from __future__ import annotations

import re

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
