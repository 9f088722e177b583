"""The annotations users' type checkers read (``py.typed`` is shipped) are right.

One mypy run (with the configuration in pyproject.toml) checks the whole package and a
file of typical user code whose ``assert_type`` lines state what users must see:
``all_reduce(t, async_op=True).wait()`` is a tensor, torch's own process groups are
accepted as ``group``, object collectives return lists.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from conftest import ROOT


def test_mypy_passes_on_distkit_and_on_user_code():
    if importlib.util.find_spec("mypy") is None:  # run as `python -m mypy`: no PATH needed
        pytest.skip("mypy is not installed (pip install -e '.[test]' installs it)")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "distkit", "tests/typing/user_code.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success: no issues found" in proc.stdout
