"""Shared fixtures: every test must leave the process as it found it."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

import distkit.dist as dist
from distkit.local.hygiene import leftovers

ROOT = Path(__file__).resolve().parents[1]
# the examples are importable by the tests (and, through sys.path, by the pool's ranks)
sys.path.insert(0, str(ROOT / "examples"))

# type-checked by tests/test_types.py, never run (it is not a test, and it has no world)
collect_ignore_glob = ["typing/*"]

#: Every world a core check runs in: 0 = no process group, then 1 to 4 gloo ranks.
WORLDS = (0, 1, 2, 3, 4)


def pytest_configure(config) -> None:
    """Compile distkit, the examples and the tests to bytecode once, in the controller,
    where Python is told not to (``PYTHONDONTWRITEBYTECODE``; this project's CI machine
    sets it). Elsewhere Python writes the bytecode itself on first import. The suite starts
    some 200 fresh interpreters (launchers, ranks, example runs), and without it each one
    compiles distkit's source again: a quarter of a CPU-second each, about 20 s of the
    suite's time on two cores. Up-to-date files are skipped; a read-only tree is left as
    it is."""
    if not sys.dont_write_bytecode or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import compileall

    for folder in ("distkit", "examples", "tests"):
        if (ROOT / folder).is_dir():
            compileall.compile_dir(ROOT / folder, quiet=2)


def _torch_version() -> tuple[int, int]:
    from importlib.metadata import version

    major, minor = version("torch").split(".")[:2]
    return int(major), int(minor)


#: distkit's collectives trace under torch.compile from torch 2.13 (tested on 2.13 and
#: 2.14); older dynamo cannot trace distkit's Python and graph-breaks or, with
#: fullgraph=True, fails. docs/modern-torch.md says so.
modern_compile = pytest.mark.skipif(
    _torch_version() < (2, 13),
    reason="distkit traces under torch.compile from torch 2.13 on (see docs/modern-torch.md)",
)


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the world a check runs in."""
    return dist.get_rank(), dist.get_world_size()


#: The torch collectives distkit's backends call, by the names they call them.
_COLLECTIVES = (
    "broadcast",
    "gather",
    "scatter",
    "isend",
    "irecv",
    "all_reduce",
    "reduce",
    "all_to_all_single",
    "reduce_scatter",
)


@contextlib.contextmanager
def collective_calls(mark_async: bool = False):
    """Record every torch collective distkit makes inside the block, by name, in order.

    With ``mark_async``, a collective started with ``async_op=True`` is recorded with a
    trailing ``~``: collectives started together (``a~``, ``b~``) make one round.
    Works in any process (a rank of the pool too): it patches ``torch.distributed`` and
    the single-tensor names distkit's backends bound at import, and puts them back.
    """
    import torch.distributed as td

    from distkit.dist.backends import objects as _torch_objects
    from distkit.dist.backends import tensors as _torch
    from distkit.dist.backends import uneven as _uneven

    calls: list[str] = []

    def counted(name, fn):
        def call(*args, **kwargs):
            calls.append(name + ("~" if mark_async and kwargs.get("async_op") else ""))
            return fn(*args, **kwargs)

        return call

    with pytest.MonkeyPatch.context() as mp:
        for name in _COLLECTIVES:
            mp.setattr(td, name, counted(name, getattr(td, name)))
        for module in (_torch, _torch_objects, _uneven):
            for name in ("all_gather_single", "reduce_scatter_single"):
                if hasattr(module, name):
                    mp.setattr(module, name, counted(name, getattr(module, name)))
        yield calls


@contextlib.contextmanager
def debug_mode():
    """Debug mode for the block, off again however the block ends."""
    dist.set_debug(True)
    try:
        yield
    finally:
        dist.set_debug(False)


def mismatch(call, debug: bool = True) -> str:
    """Run ``call`` in debug mode (or with only the default check): it must raise
    ``CollectiveMismatchError`` on this rank, listing every rank's call and call site, and
    leave the group in step (nothing was half-sent). Returns the message."""
    rank, size = world()
    start = time.monotonic()
    with debug_mode() if debug else contextlib.nullcontext():
        with pytest.raises(dist.CollectiveMismatchError) as info:
            call()
    assert time.monotonic() - start < 10, "raised only after waiting on the other ranks"
    text = str(info.value)
    how = f"(debug mode; on rank {rank} of {size})" if debug else "found by distkit's default check"
    assert how in text, text
    for r in range(size):
        assert f"  rank {r}: " in text, f"rank {r}'s call is not listed"
    assert text.count("tests/test_") >= size, "every rank's call site is named"
    assert dist.all_reduce(torch.ones(1)).item() == size  # the group still works
    return text


def in_fresh_world(
    body, size: int, timeout: float = 300.0, pg_timeout: Optional[float] = None
) -> list:
    """Run the module-level function ``body`` on every rank of a world of its own.

    For checks that build a ``DeviceMesh``: its process groups live as long as the world,
    and stay out of the session's shared pools this way. The world's collectives time out
    with the task (not the pool's 30 s: ranks that compile at different speeds on a
    loaded machine wait for each other longer than that), or after ``pg_timeout``
    seconds (for a check of what a collective's timeout raises).
    """
    from distkit.local.pool import RankPool

    with RankPool(size, timeout=timeout, pg_timeout=pg_timeout or timeout) as pool:
        return pool.run(body)


@pytest.fixture
def settings():
    """distkit's settings (``set_serializer``, ``set_debug``, ...), put back to their
    defaults when the test ends, however it ends. (A ``@ranks`` body needs none: the pool
    puts a rank's settings back after each task.)"""
    from distkit import _settings

    yield _settings
    _settings.reset()


@pytest.fixture(scope="module")
def fresh_pools_after():
    """Stop the shared pools when the module's tests are done (the next test starts fresh
    ones). For modules that compile collectives on the pools' groups: a group that
    torch.compile traced is left out of distkit's default check for the life of its
    process, and a later test of that check must not meet such a group, whichever order
    the tests run in (pytest-xdist's workers take them in no fixed order)."""
    from distkit.local.pool import shutdown_pools

    yield
    shutdown_pools()


# set by pytest, by torch the first time its compiler's modules run (process-wide), and
# by distkit in a process that joined a world (for its children: see _registry.decide)
_IGNORED_ENV = ("PYTEST_", "TORCHINDUCTOR_CACHE_DIR", "DISTKIT_RANK_PID")


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
        if before_env.get(k) != os.environ.get(k) and not k.startswith(_IGNORED_ENV)
    )
    assert not found, f"the test left state behind: {found}"
    assert not changed, f"the test changed environment variables: {changed}"
