"""Run a function on local ranks without torchrun: :func:`launch`.

It runs a Python function on ``nprocs`` ranks of a fresh process group (a
:class:`~distkit.local.pool.RankPool` used once) and returns what each rank returned.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

from distkit import _registry
from distkit.local.pool import RankPool, RankTimeout

#: Seconds a :func:`launch` call may take by default (also its collectives' timeout).
DEFAULT_TIMEOUT = 300.0
#: Collective timeout of a launched world with ``timeout=None`` (torch's own default).
NO_LIMIT_PG_TIMEOUT = 1800.0


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
    timeout: Optional[float] = DEFAULT_TIMEOUT,
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
    traceback (and where the stopped ranks were). No rank process outlives the call: not
    on Ctrl-C (the ranks are killed at once), not when this process gets SIGTERM (the
    call cleans up, then the process ends by that signal as it would have), and not when
    this process is killed outright (each rank dies with its parent).

    With more than one rank, each runs torch with one intra-op thread, as under
    ``torchrun``: the ranks share this machine's cores. Set ``OMP_NUM_THREADS`` (here or
    in ``env``) to choose otherwise.

    The default ``timeout`` is 5 minutes. These ranks all run on this machine, where a
    healthy run of this kind takes seconds to minutes and a collective that has waited
    5 minutes is a hang: a rank that caught an error and went on to a collective the
    others never reach, say. torch's 30-minute default is sized for jobs across
    machines; waiting that long at a prompt helps nobody. Pass ``timeout=None`` for no
    limit (the collectives then keep torch's 30 minutes).

    Args:
        fn: The function each rank runs.
        nprocs: Number of ranks.
        args: Positional arguments for ``fn`` (the same on every rank).
        kwargs: Keyword arguments for ``fn``.
        backend: ``None`` picks nccl with one GPU per rank where there are enough GPUs,
            else gloo on the CPU.
        timeout: Seconds the whole call may take (default 300; ``None``: no limit); also
            the collective timeout of the ranks' process group.
        start_method: Force ``fork``, ``forkserver`` or ``spawn`` (``fork`` is refused,
            with ``ValueError``, in a process that has a process group).
        env: Extra environment variables for the ranks.

    Returns:
        The return value of ``fn`` on each rank, in rank order.

    Raises:
        ValueError: ``nprocs`` is not a positive int, or ``start_method='fork'`` in a
            process that has a process group.
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
    if method == "fork" and _registry.current._default_pg is not None:
        raise ValueError(
            "launch: start_method='fork' in a process that has a process group: each rank "
            "would inherit it and fail to make its own world. Leave start_method unset (here "
            "it is 'forkserver'), or pass 'forkserver' or 'spawn'"
        )
    with _sigterm_unwinds():
        pool = RankPool(
            nprocs,
            backend or _default_backend(nprocs),
            timeout=timeout,
            pg_timeout=timeout if timeout is not None else NO_LIMIT_PG_TIMEOUT,
            env={k: str(v) for k, v in (env or {}).items()},
            start_method=method,
        )
        try:
            if method == "fork":  # hand the task over at fork time: nothing is pickled
                pool.start(first_task=(fn, tuple(args), dict(kwargs or {})))
                return pool.results(fn, timeout)
            return pool.run(fn, *args, timeout=timeout, **dict(kwargs or {}))
        except RankTimeout as exc:
            hint = (
                f"launch(timeout=...) sets this limit: {DEFAULT_TIMEOUT:g} s by default, None: none"
            )
            exc.args = (f"{exc.args[0]}\n{hint}",)
            raise
        finally:
            pool.close()


class _Terminated(BaseException):
    """SIGTERM arrived during :func:`launch` (raised so that its clean-up runs)."""


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Let SIGTERM unwind the block (its clean-up runs), then end the process by it.

    Python's default for SIGTERM ends the process on the spot: the ranks would still
    die with it, but the pool's temporary directory would be left behind. Only the
    default action is replaced, and only in the main thread (where Python runs handlers).
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise _Terminated

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # the ending the sender asked for
        raise SystemExit(128 + signal.SIGTERM) from None  # if the signal is blocked
    finally:
        if signal.getsignal(signal.SIGTERM) is handler:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
