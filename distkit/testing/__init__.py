"""Testing multi-rank code with pytest, on a persistent pool of local gloo ranks.

Write a check once and run it in every world::

    import distkit.dist as dist
    from distkit.testing import ranks

    @ranks(0, 1, 2, 3)
    def test_all_gather_uneven():
        rank, world = dist.get_rank(), dist.get_world_size()
        out = dist.all_gather(torch.arange(rank + 1))
        assert [t.tolist() for t in out] == [list(range(r + 1)) for r in range(world)]

``@ranks(0, 1, 2, 3)`` makes four tests: ``0`` runs the body in the pytest process with no
process group at all (the plain ``python train.py`` case), ``n >= 1`` runs it on every
rank of a pool of ``n`` gloo ranks. Pools start once per session (rendezvous on a
FileStore in a temporary directory, no ports) and are reused by every test; a test that
hangs fails after its timeout with every rank's stack, and its pool is restarted. A
failure shows the traceback of every rank that failed.

The body may take pytest fixtures (their values are pickled to the ranks) and must be
defined at module level in the test file.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

from distkit.local.pool import (
    DEFAULT_PG_TIMEOUT,
    DEFAULT_TIMEOUT,
    RankError,
    RankPool,
    RankTimeout,
    get_pool,
    shutdown_pools,
)

__all__ = [
    "DEFAULT_PG_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "RankError",
    "RankPool",
    "RankTimeout",
    "get_pool",
    "ranks",
    "run_in_world",
    "shutdown_pools",
]


def run_in_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: Optional[float] = None,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn`` in a world of ``world_size`` ranks and return each rank's result.

    ``world_size=0`` calls ``fn`` here, in this process, with no process group (and
    checks that there is none); otherwise ``fn`` runs on every rank of the shared pool
    of that size.

    Args:
        fn: A module-level function (or ``@ranks`` test body).
        world_size: 0 for no process group, else the number of ranks.
        *args: Positional arguments for ``fn``.
        timeout: Seconds before the task counts as hung.
        backend: Backend of the pool's ranks.
        **kwargs: Keyword arguments for ``fn``.

    Returns:
        One result per rank (a list of one for ``world_size=0``).
    """
    __tracebackhide__ = True  # pytest starts a failure's report at the ranks' errors
    if world_size == 0:
        from distkit import _registry

        if _registry.current._default_pg is not None:
            raise RuntimeError("run_in_world(0): a process group exists in this process")
        body = getattr(fn, "__distkit_body__", fn)
        return [body(*args, **kwargs)]
    return get_pool(world_size, backend).run(fn, *args, timeout=timeout, **kwargs)


def _world_id(n: int) -> str:
    return "nogroup" if n == 0 else f"{n}rank" + ("s" if n > 1 else "")


def ranks(
    *world_sizes: int, timeout: Optional[float] = None, backend: str = "gloo"
) -> Callable[[Callable[..., Any]], Any]:
    """Decorate a test body to run on every rank of each world size given.

    Args:
        *world_sizes: Worlds to run in; ``0`` means no process group (this process).
        timeout: Seconds before the test counts as hung (default 60).
        backend: Backend of the pool's ranks.

    Returns:
        A decorator producing one pytest test per world size.
    """
    if not world_sizes or any(not isinstance(n, int) or n < 0 for n in world_sizes):
        raise ValueError(f"ranks: give world sizes as ints >= 0, got {world_sizes}")

    def decorate(body: Callable[..., Any]) -> Any:
        import pytest

        params = list(inspect.signature(body).parameters.values())

        @functools.wraps(body)
        def test(distkit_world: int, **fixtures: Any) -> None:
            __tracebackhide__ = True
            run_in_world(test, distkit_world, timeout=timeout, backend=backend, **fixtures)

        world = inspect.Parameter("distkit_world", inspect.Parameter.KEYWORD_ONLY)
        kw = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params]
        test.__signature__ = inspect.Signature([world, *kw])  # type: ignore[attr-defined]
        test.__distkit_body__ = body  # type: ignore[attr-defined]
        ids = [_world_id(n) for n in world_sizes]
        return pytest.mark.parametrize("distkit_world", list(world_sizes), ids=ids)(test)

    return decorate
