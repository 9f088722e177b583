"""Run a function, or a script, on local ranks without torchrun.

:func:`launch` runs a Python function on ``nprocs`` ranks of a fresh process group and
returns what each rank returned. :func:`run_script` (``distkit launch -n N script.py``)
runs a script on N ranks with the variables torchrun would set, so the script's own
``dist.init_dist()`` (or ``torch.distributed.init_process_group()``) joins them.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

from distkit.testing._pool import STOP_GRACE, RankPool

__all__ = ["launch", "run_script"]

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

    from distkit import _world

    if not sys.platform.startswith("linux"):
        return "spawn"
    if torch.cuda.is_initialized() or _world.WORLD._default_pg is not None:
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
    the call raises one :class:`~distkit.testing.RankError` with the failing rank's
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


# -- scripts -------------------------------------------------------------------------------


def _rank_env(rank: int, nprocs: int, port: int, error_file: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # the ranks join the store this process hosts instead of rank 0 binding the port
        TORCHELASTIC_USE_AGENT_STORE="True",
        DISTKIT_ERROR_FILE=error_file,
    )
    if nprocs > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks share the cores
    return env


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_script(
    script: str,
    script_args: Sequence[str] = (),
    nprocs: int = 2,
    timeout: Optional[float] = None,
    module: bool = False,
    file: Any = None,
) -> int:
    """Run a script (or ``-m module``) on ``nprocs`` local ranks, as torchrun would.

    Each rank is a fresh interpreter with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set; this process hosts the
    rendezvous store on a port the system picks, so two launches never collide. When a
    rank fails, the others get 3 seconds, are stopped, and the failing rank's traceback
    is printed.

    Args:
        script: Path of the script (or module name with ``module=True``).
        script_args: Its command-line arguments.
        nprocs: Number of ranks.
        timeout: Seconds before the run is stopped as hung (``None``: no limit).
        module: Run ``script`` as a module, like ``python -m``.
        file: Where to write the failure report (default ``sys.stderr``).

    Returns:
        0 when every rank exited cleanly, else 1.
    """
    from torch.distributed import TCPStore

    out = file if file is not None else sys.stderr
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    errors = tempfile.mkdtemp(prefix="distkit-launch-")
    procs = []
    for rank in range(nprocs):
        cmd = [sys.executable, "-m", "distkit.launcher", "--as-rank"]
        cmd += ["--module", script] if module else [script]
        env = _rank_env(rank, nprocs, store.port, os.path.join(errors, f"rank-{rank}.json"))
        procs.append(subprocess.Popen([*cmd, *script_args], env=env))
    deadline = time.monotonic() + timeout if timeout is not None else None
    failed: dict[int, int] = {}
    grace_end = None
    try:
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            for rank, p in enumerate(procs):
                if p.returncode not in (None, 0) and rank not in failed:
                    failed[rank] = p.returncode
            if failed and grace_end is None:
                grace_end = now + STOP_GRACE
            if (grace_end is not None and now > grace_end) or (deadline and now > deadline):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        failed.setdefault(-1, -int(signal.SIGINT))
    running = [r for r, p in enumerate(procs) if p.poll() is None]
    _stop(procs)
    for rank, p in enumerate(procs):
        if p.returncode not in (0, None) and rank not in failed and rank not in running:
            failed[rank] = p.returncode
    del store
    if not failed and not running:
        return 0
    lines = []

    def when(rank: int) -> float:  # a rank's error report is written as it fails
        report = os.path.join(errors, f"rank-{rank}.json")
        return os.path.getmtime(report) if os.path.exists(report) else float("inf")

    order = sorted(failed, key=lambda r: (when(r), r))
    for n, rank in enumerate(order):
        if rank < 0:
            lines.append("distkit launch: interrupted")
            continue
        code = failed[rank]
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        first = " first" if n == 0 and len(order) > 1 else ""
        lines.append(f"distkit launch: rank {rank} of {nprocs} failed{first} ({how})")
        report = os.path.join(errors, f"rank-{rank}.json")
        if os.path.exists(report):
            with open(report) as f:
                lines.append(json.load(f)["traceback"].rstrip())
    if running:
        why = "after another rank failed" if failed else f"after the {timeout:g} s timeout"
        lines.append(
            f"distkit launch: rank(s) {', '.join(map(str, running))} were still "
            f"running and were stopped {why}"
        )
    print("\n".join(lines), file=out)
    return 1


def _as_rank(argv: list[str]) -> None:
    """Entry point of one script rank: run it, and record a traceback if it fails."""
    from distkit.testing._worker import _set_parent_death_signal

    _set_parent_death_signal()
    module = argv[0] == "--module"
    target = argv[1] if module else argv[0]
    rest = argv[2:] if module else argv[1:]
    sys.argv = [target, *rest]
    try:
        if module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:
        import traceback

        path = os.environ.get("DISTKIT_ERROR_FILE")
        if path:
            tb = exc.__traceback__
            while tb is not None and _launcher_frame(tb.tb_frame.f_code.co_filename):
                tb = tb.tb_next  # start the report at the script's own frames
            text = "".join(traceback.format_exception(type(exc), exc, tb))
            with open(path, "w") as f:
                json.dump({"traceback": text}, f)
        raise


def _launcher_frame(filename: str) -> bool:
    return filename == __file__ or "runpy" in filename


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--as-rank":
        _as_rank(sys.argv[2:])
    else:
        print("usage: distkit launch -n N script.py [args...]", file=sys.stderr)
        sys.exit(2)
