"""ruff (from the test extras) keeps the code lint-clean and formatted."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from conftest import ROOT

PATHS = ["distkit", "tests", "examples", "benchmarks"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff(command):
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
    proc = subprocess.run([ruff, *command, *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
