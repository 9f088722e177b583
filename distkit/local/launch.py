"""Run a function on local ranks without torchrun: :func:`launch`.

It runs a Python function on ``nprocs`` ranks of a fresh process group (a
:class:`~distkit.local.pool.RankPool` used once) and returns what each rank returned.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any, Callable, Optional

from distkit import _registry
from distkit.local.pool import RankPool

#: Collective timeout of a launched world when ``launch`` is given no timeout.
DEFAULT_PG_TIMEOUT = 1800.0


def _default_backend(nprocs: int) -> str:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs:
        return "nccl"
    return "gloo"


def _default_start_method() -> str:
    """fork where it is safe (it also runs lambdas and functions typed in a REPL)."""
    import torch

    if not sys.platform.startswith("linux"):
        return "spawn"
    if torch.cuda.is_initialized() or _registry.current._default_pg is not None:
        return "forkserver"  # a forked child cannot use the parent's CUDA or gloo threads
    if threading.active_count() > 1:
        return "forkserver"  # another thread may hold a lock the child would inherit
    return "fork"


def launch(
    fn: Callable[..., Any],
    nprocs: int = 2,
    args: Sequence[Any] = (),
    kwargs: Optional[dict] = None,
    backend: Optional[str] = None,
    timeout: Optional[float] = None,
    *,
    start_method: Optional[str] = None,
    env: Optional[dict] = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` local ranks; return each rank's result.

    Every rank starts inside a process group (a FileStore rendezvous in a private
    temporary directory: no ports), so ``fn`` can call :mod:`distkit.dist` directly. The
    ranks are forked from this process where that is safe (no CUDA, process group or other
    threads here yet), so ``fn`` may be a lambda, a closure or a function typed into an
    interactive session; otherwise they start from a fork server and ``fn`` must be
    importable (defined at module level).

    If a rank raises or dies, the other ranks get 3 seconds to finish, are stopped, and
    the call raises one :class:`~distkit.RankError` with the failing rank's
    traceback (and where the stopped ranks were). No rank process outlives the call.

    Args:
        fn: The function each rank runs.
        nprocs: Number of ranks.
        args: Positional arguments for ``fn`` (the same on every rank).
        kwargs: Keyword arguments for ``fn``.
        backend: ``None`` picks nccl with one GPU per rank where there are enough GPUs,
            else gloo on the CPU.
        timeout: Seconds the whole call may take (``None``: no limit); also the
            collective timeout of the ranks' process group (default 30 minutes).
        start_method: Force ``fork``, ``forkserver`` or ``spawn``.
        env: Extra environment variables for the ranks.

    Returns:
        The return value of ``fn`` on each rank, in rank order.

    Raises:
        RankError: ``fn`` raised on some rank, or a rank died.
        RankTimeout: The call took longer than ``timeout``; the message shows every
            stuck rank's stack.

    Examples:
        >>> import distkit
        >>> import distkit.dist as dist
        >>> distkit.launch(lambda: dist.all_reduce(torch.ones(1)).item(), 2)  # doctest: +SKIP
        [2.0, 2.0]
    """
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"launch: nprocs must be an int >= 1, got {nprocs!r}")
    if not callable(fn):
        raise TypeError(f"launch: fn must be callable, got {type(fn).__name__}")
    method = start_method or _default_start_method()
    pool = RankPool(
        nprocs,
        backend or _default_backend(nprocs),
        timeout=timeout,
        pg_timeout=timeout if timeout is not None else DEFAULT_PG_TIMEOUT,
        env={k: str(v) for k, v in (env or {}).items()},
        start_method=method,
    )
    try:
        if method == "fork":  # hand the task over at fork time: nothing is pickled
            pool.start(first_task=(fn, tuple(args), dict(kwargs or {})))
            return pool.results(fn, timeout)
        return pool.run(fn, *args, timeout=timeout, **dict(kwargs or {}))
    finally:
        pool.close()
