"""A persistent pool of rank processes that runs a function on every rank.

Starting a gloo world costs about a second per process (importing torch, rendezvous);
a test suite that spawns a world per test spends most of its time doing that, and is
where peers' suites got slow and flaky. A :class:`RankPool` starts its ranks once,
rendezvoused on a FileStore in a private temporary directory (no ports), and reuses them
for every task. A task that hangs is stopped at its timeout: every rank's Python stack is
dumped, the ranks are killed and the pool starts afresh for the next task.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import wait
from typing import Any, Callable, Optional

from distkit._settings import _seconds
from distkit.local import worker
from distkit.local.worker import Failure, FnRef

#: Seconds a task may run before the pool declares it hung.
DEFAULT_TIMEOUT = 60.0
#: Timeout of the process group's own collectives (gloo raises after it).
DEFAULT_PG_TIMEOUT = 30.0


class RankError(RuntimeError):
    """A task failed on one or more ranks.

    The message starts with the error of the rank that failed first, then shows every
    failing rank's traceback. ``failures`` maps each failing rank to its
    :class:`Failure`; ``results`` holds what the other ranks returned.
    """

    def __init__(self, message: str, failures: dict[int, Failure], results: dict[int, Any]) -> None:
        super().__init__(message)
        self.failures = failures
        self.results = results


class RankTimeout(RankError):
    """A task did not finish on every rank within its timeout."""


#: Seconds the other ranks get to finish once one rank failed, before they are stopped
#: (``DISTKIT_STOP_GRACE``; longer lets every rank report its own error, for example on
#: a loaded machine where ranks reach their first collective seconds apart).
STOP_GRACE = _seconds("DISTKIT_STOP_GRACE", 3.0)
#: Seconds the ranks get to meet after a task (a short barrier) before the world counts
#: as broken and the pool restarts.
SETTLE_TIMEOUT = 10.0
#: Seconds ``close`` waits for the ranks to leave on their own before killing them.
CLOSE_GRACE = 5.0


def _context(start_method: Optional[str] = None) -> Any:
    # forkserver by default: one server imports torch once, every rank forks from it in
    # milliseconds, and no rank inherits the parent's threads or CUDA state.
    if start_method is None:
        start_method = "forkserver" if sys.platform.startswith("linux") else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch.distributed", "distkit.dist"])
    return ctx


class RankPool:
    """``world_size`` rank processes in one gloo world, reused task after task.

    After every task the ranks meet in a short barrier before they put back what the
    task changed (so no rank destroys a group another is still using) and check that
    the world still works: a world a task broke (a collective that timed out closes
    gloo's connections) is restarted before the next task.

    Args:
        world_size: Number of ranks.
        backend: Process group backend of the ranks (gloo runs anywhere).
        timeout: Default seconds a task may take before it counts as hung (``None``: no
            limit).
        pg_timeout: Timeout of the ranks' process group collectives.
        env: Extra environment variables for the rank processes.
        start_method: ``forkserver`` (default on Linux), ``spawn`` or ``fork``.

    Examples:
        >>> from distkit.local.pool import RankPool
        >>> import distkit.dist as dist
        >>> with RankPool(2) as pool:                    # doctest: +SKIP
        ...     pool.run(dist.get_rank)
        [0, 1]
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        timeout: Optional[float] = DEFAULT_TIMEOUT,
        pg_timeout: float = DEFAULT_PG_TIMEOUT,
        env: Optional[dict[str, str]] = None,
        start_method: Optional[str] = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"RankPool: world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.pg_timeout = pg_timeout
        self.env = dict(env or {})
        self.start_method = start_method
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        # the current temporary directory, in a list the finalizer shares: a pool that is
        # garbage-collected (or left open at exit) still removes the one it has then
        self._dirs: list[str] = []
        self._generation = 0
        self._task = 0
        self._lock = threading.Lock()
        self.restarts = 0
        self._finalizer = weakref.finalize(self, _kill, self._procs, self._dirs)

    # -- lifecycle --------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def _dir(self) -> Optional[str]:
        return self._dirs[0] if self._dirs else None

    def start(self, first_task: Optional[tuple] = None) -> RankPool:
        """Start the ranks (``run`` does this on first use).

        Args:
            first_task: ``(fn, args, kwargs)`` each rank runs as soon as it is up, handed
                over at process creation (so with ``fork`` it is never pickled); collect
                its results with :meth:`results`.
        """
        if self.alive:
            return self
        self._stop(kill=True)
        ctx = _context(self.start_method)
        directory = tempfile.mkdtemp(prefix="distkit-pool-")
        self._dirs.append(directory)
        self._generation += 1
        store = os.path.join(directory, f"store-{self._generation}")
        env = {"DISTKIT_POOL": "1", **self.env}
        if first_task is not None:
            self._task += 1
            first_task = (self._task, *first_task)
        try:
            for rank in range(self.world_size):
                parent_end, child_end = ctx.Pipe()
                stack = os.path.join(directory, f"stack-{rank}.txt")
                proc = ctx.Process(
                    target=worker.main,
                    args=(
                        rank,
                        self.world_size,
                        self.backend,
                        store,
                        stack,
                        child_end,
                        self.pg_timeout,
                        env,
                        first_task,
                        os.getpid(),  # the ranks die with this process
                    ),
                    daemon=True,
                    name=f"distkit-rank-{rank}",
                )
                proc.start()
                child_end.close()
                self._procs.append(proc)
                self._conns.append(parent_end)
            self._await_ready()
        except BaseException:
            self._stop(kill=True)  # Ctrl-C during start-up too: no rank, no directory left
            raise
        return self

    def _await_ready(self) -> None:
        deadline = time.monotonic() + max(self.timeout or 0.0, 60.0)
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(deadline - time.monotonic(), 0.0)):
                raise RuntimeError(f"RankPool: rank {rank} did not start within the timeout")
            try:
                status = conn.recv()
            except EOFError:
                status = ("failed", f"rank {rank} exited during start-up")
            if status[0] != "ready":
                raise RuntimeError(f"RankPool: rank {rank} failed to start:\n{status[1]}")

    def close(self) -> None:
        """Stop the ranks and remove the pool's temporary directory."""
        self._stop(kill=False)

    def __enter__(self) -> RankPool:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _stop(self, kill: bool) -> None:
        if not kill:
            for conn in self._conns:
                try:
                    conn.send(("stop",))
                except OSError:
                    pass
            # one deadline for all: ranks busy elsewhere cost CLOSE_GRACE once, not each
            deadline = time.monotonic() + CLOSE_GRACE
            for proc in self._procs:
                proc.join(timeout=max(deadline - time.monotonic(), 0.0))
        _kill(self._procs, self._dirs)
        for conn in self._conns:
            conn.close()
        self._procs.clear()
        self._conns.clear()

    # -- running ----------------------------------------------------------------------

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: Optional[float] = None, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank and return the results in rank order.

        ``fn`` must be importable by the ranks (a module-level function, or a test body
        decorated with :func:`~distkit.testing.ranks`).

        Args:
            fn: The function every rank calls.
            *args: Positional arguments (pickled to each rank).
            timeout: Seconds before the task counts as hung (default: the pool's).
            **kwargs: Keyword arguments (pickled to each rank).

        Returns:
            What ``fn`` returned on each rank.

        Raises:
            RankError: ``fn`` raised on some ranks; the message shows each traceback.
            RankTimeout: Some ranks did not finish in time; the message shows their stacks.
        """
        __tracebackhide__ = True  # pytest shows the ranks' tracebacks, not this plumbing
        with self._lock:
            self.start()
            payload = pickle.dumps((FnRef.of(fn), args, kwargs, list(sys.path)))
            self._task += 1
            return self._guarded(fn, timeout, ("run", self._task, payload))

    def results(self, fn: Any, timeout: Optional[float] = None) -> list[Any]:
        """Collect the results of the ``first_task`` given to :meth:`start`."""
        __tracebackhide__ = True
        with self._lock:
            return self._guarded(fn, timeout, None)

    def _guarded(self, fn: Any, timeout: Optional[float], message: Optional[tuple]) -> list[Any]:
        __tracebackhide__ = True
        try:
            if message is not None:
                for conn in self._conns:
                    conn.send(message)
            return self._collect(fn, timeout if timeout is not None else self.timeout)
        except RankError:
            raise
        except BaseException:
            # Interrupted (Ctrl-C, SIGTERM turned into an exception) or broken mid-task:
            # the ranks may still be running it, and their late answers would be read as
            # the next task's. Kill them now; the next task starts a fresh world.
            self._stop(kill=True)
            self.restarts += 1
            raise

    def _gather(self, timeout: Optional[float]) -> tuple[dict, dict, dict, dict, bool]:
        """Read each rank's answer until all answered, the deadline, or the grace ends."""
        results: dict[int, Any] = {}
        failures: dict[int, Failure] = {}
        outputs: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        restart = False
        deadline = time.monotonic() + timeout if timeout is not None else None
        grace_started = False
        while pending:
            if failures and not grace_started:
                # One rank failed: the others get a short grace to finish (or to fail on
                # their own), then they are stopped instead of waiting for the dead rank.
                grace_started = True
                grace_end = time.monotonic() + STOP_GRACE
                deadline = grace_end if deadline is None else min(deadline, grace_end)
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready: list[Any] = wait(list(pending.values()), left)
            if not ready:
                break
            # a rank that died is usually why the others failed: read it first
            ready.sort(key=lambda c: self._procs[self._conns.index(c)].is_alive())
            for conn in ready:
                rank = self._conns.index(conn)
                del pending[rank]
                try:
                    kind, task, value, output, intact = conn.recv()
                except (EOFError, OSError):
                    failures[rank] = self._death(rank)
                    restart = True
                    continue
                outputs[rank] = output
                restart = restart or not intact or task != self._task
                if kind == "ok":
                    results[rank] = value
                else:
                    failures[rank] = value
        return results, failures, outputs, pending, restart

    def _death(self, rank: int) -> Failure:
        self._procs[rank].join(timeout=2)
        code = self._procs[rank].exitcode
        how = f"killed by signal {-code}" if code and code < 0 else f"exit code {code}"
        why = f"rank {rank} died ({how}) while running the task"
        return Failure(rank, "RankDied", why, "", None)

    def _collect(self, fn: Any, timeout: Optional[float]) -> list[Any]:
        __tracebackhide__ = True
        results, failures, outputs, pending, restart = self._gather(timeout)
        name = getattr(fn, "__qualname__", repr(fn))
        for rank in sorted(outputs):
            if outputs[rank]:
                sys.stdout.write(_indent(f"[rank {rank} output]\n{outputs[rank]}"))
        if pending:
            stacks = self._dump_stacks(sorted(pending))
            self._stop(kill=True)
            self.restarts += 1
            stuck = ", ".join(map(str, sorted(pending)))
            if failures:
                lines = [
                    _headline(failures),
                    f"{name} failed on rank(s) {_ranks(failures)} of {self.world_size}; "
                    f"rank(s) {stuck} were still running {STOP_GRACE:g} s later and were "
                    "stopped.",
                    *_failure_lines(failures),
                ]
                lines += [
                    f"--- rank {r} was stopped here (all threads) ---\n{stacks[r]}"
                    for r in sorted(pending)
                ]
                raise RankError("\n".join(lines), failures, results)
            lines = [
                f"{name} did not finish within {timeout:g} s on rank(s) {stuck} of "
                f"{self.world_size}; the pool was restarted."
            ]
            for rank in sorted(pending):
                lines.append(f"--- rank {rank} was here (all threads) ---\n{stacks[rank]}")
            raise RankTimeout("\n".join(lines), failures, results)
        if restart or not self._settle():
            self._stop(kill=True)
            self.restarts += 1
        if failures:
            first = next(iter(failures))
            lines = [
                _headline(failures),
                f"{name} failed on rank(s) {_ranks(failures)} of {self.world_size}"
                + (f" (rank {first} first)" if len(failures) > 1 else ""),
                *_failure_lines(failures),
            ]
            raise RankError("\n".join(lines), failures, results)
        return [results[r] for r in range(self.world_size)]

    def _settle(self) -> bool:
        """Have the ranks meet and reset after a task; ``False`` if the world is broken.

        The ranks meet only now, when every one has answered, so a slow rank never
        holds a fast one in the barrier for longer than the barrier itself takes.
        """
        try:
            for conn in self._conns:
                conn.send(("settle", SETTLE_TIMEOUT))
        except OSError:
            return False
        deadline = time.monotonic() + SETTLE_TIMEOUT + 5.0
        healthy = True
        for conn in self._conns:
            try:
                if not conn.poll(max(deadline - time.monotonic(), 0.0)):
                    return False
                kind, problem = conn.recv()
            except (EOFError, OSError):
                return False
            healthy = healthy and kind == "settled" and problem is None
        return healthy

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        paths = {r: os.path.join(self._dir or "", f"stack-{r}.txt") for r in ranks}
        sizes = {r: os.path.getsize(p) if os.path.exists(p) else 0 for r, p in paths.items()}
        for r in ranks:
            try:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
            except (ProcessLookupError, TypeError):
                pass
        time.sleep(0.5)
        out = {}
        for r, p in paths.items():
            try:
                with open(p) as f:
                    f.seek(sizes[r])
                    out[r] = f.read().strip() or "(no stack was dumped)"
            except OSError:
                out[r] = "(no stack was dumped)"
        return out


def _indent(text: str) -> str:
    return text if text.endswith("\n") else text + "\n"


def _ranks(failures: dict[int, Failure]) -> str:
    return ", ".join(map(str, sorted(failures)))


def _headline(failures: dict[int, Failure]) -> str:
    """The first failing rank's error: what a reader needs first."""
    f = next(iter(failures.values()))
    return f"{f.type_name}: {f.message}"


def _failure_lines(failures: dict[int, Failure]) -> list[str]:
    """One block per failing rank, in the order the failures arrived."""
    lines = []
    for rank in failures:
        f = failures[rank]
        body = f.traceback.strip() or f"{f.type_name}: {f.message}"
        lines.append(f"--- rank {rank}: {f.type_name}: {f.message} ---\n{body}")
    return lines


def _kill(procs: list[Any], dirs: list[str]) -> None:
    for proc in procs:
        if proc.is_alive():
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        proc.join(timeout=5)
    while dirs:
        shutil.rmtree(dirs.pop(), ignore_errors=True)


_pools: dict[tuple[int, str], RankPool] = {}


def get_pool(world_size: int, backend: str = "gloo") -> RankPool:
    """The shared pool of ``world_size`` ranks, started on first use.

    Args:
        world_size: Number of ranks.
        backend: Backend of the ranks' process group.
    """
    key = (world_size, backend)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = RankPool(world_size, backend)
    return pool


def shutdown_pools() -> None:
    """Stop every shared pool (the pytest plugin calls this at the end of a session)."""
    for pool in _pools.values():
        pool.close()
    _pools.clear()
