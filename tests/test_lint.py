"""ruff (from the test extras) keeps the whole code base lint-clean and formatted."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from conftest import ROOT

PATHS = ["distkit", "tests", "examples", "benchmarks"]


def ruff():
    """ruff installed beside this Python (found without an activated environment), or
    on PATH."""
    try:
        from ruff.__main__ import find_ruff_bin  # type: ignore[import-not-found]

        return find_ruff_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("ruff")
        if found is None:
            pytest.skip("ruff is not installed (pip install -e '.[test]' installs it)")
        return found


def test_ruff_checks_the_core():
    # ruff skips folders named "dist" by default; the project's config must not
    proc = subprocess.run(
        [ruff(), "check", "--show-files", *PATHS], cwd=ROOT, capture_output=True, text=True
    )
    checked = proc.stdout.replace("\\", "/")
    checked_paths = ("distkit/dist/tensor.py", "distkit/dist/backends/tensors.py")
    for path in (*checked_paths, "distkit/dist/world.py"):
        assert path in checked, f"ruff does not check {path}"


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_ruff(command):
    proc = subprocess.run([ruff(), *command, *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
