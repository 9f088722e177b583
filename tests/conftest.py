"""Shared fixtures: every test must leave the process as it found it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from distkit.testing._hygiene import leftovers

ROOT = Path(__file__).resolve().parents[1]
# the examples are importable by the tests (and, through sys.path, by the pool's ranks)
sys.path.insert(0, str(ROOT / "examples"))

#: Every world a core check runs in: 0 = no process group, then 1 to 4 gloo ranks.
WORLDS = (0, 1, 2, 3, 4)


@pytest.fixture(autouse=True)
def _hygiene():
    """Fail a test that leaves a process group, cached groups, settings or env vars."""
    before_env = dict(os.environ)
    assert not leftovers(), f"state left by an earlier test: {leftovers()}"
    yield
    found = leftovers()
    changed = sorted(
        k
        for k in set(before_env) | set(os.environ)
        if before_env.get(k) != os.environ.get(k) and not k.startswith("PYTEST_")
    )
    assert not found, f"the test left state behind: {found}"
    assert not changed, f"the test changed environment variables: {changed}"
