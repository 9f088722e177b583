"""Run a script on local ranks without torchrun: ``distkit launch -n N script.py``.

Each rank is a fresh interpreter with the variables torchrun's agent sets, so the
script's own ``dist.init_dist()`` (or ``torch.distributed.init_process_group()``) joins
them. The launcher hosts the rendezvous store on a port the system picks and watches
every rank with a thread of its own, so the rank named as failing first is the one whose
exit it saw first, and the others are stopped a few seconds after any rank fails. A
rank's traceback and, when it must be stopped, its Python stack come back through pipes:
the launcher writes no files, so however it ends it leaves nothing behind. Every rank
dies with the launcher, from before its interpreter starts.
"""

from __future__ import annotations

import faulthandler
import importlib.machinery
import importlib.util
import json
import os
import re
import runpy
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Optional

from distkit.local.pool import STOP_GRACE
from distkit.local.worker import die_with_parent

#: Exit status of a launcher stopped by a signal: 128 + the signal, as a shell reports.
INTERRUPTED = 128 + signal.SIGINT
TERMINATED = 128 + signal.SIGTERM


def _rank_env(rank: int, nprocs: int, port: int, run_id: str) -> dict[str, str]:
    """This environment plus what torchrun's agent gives a rank of a one-node job.

    torch 2.1 to 2.4 read ``TORCHELASTIC_RESTART_COUNT`` whenever
    ``TORCHELASTIC_USE_AGENT_STORE`` is set (``env://`` then prefixes its keys with the
    attempt), and ``is_torchelastic_launched()`` (which Lightning and others check) reads
    ``TORCHELASTIC_RUN_ID``: set them all, as the agent does.
    """
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(nprocs),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(nprocs),
        ROLE_NAME="default",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # the ranks join the store this process hosts instead of rank 0 binding the port
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID=run_id,
    )
    env.setdefault(_nccl_error_handling_var(), "1")  # as the agent: fail, don't hang
    if nprocs > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks share the cores
    return env


def _nccl_error_handling_var() -> str:
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    # torch 2.2 renamed it; setting the old name there only prints a deprecation warning
    return (
        "NCCL_ASYNC_ERROR_HANDLING"
        if (major, minor) < (2, 2)
        else "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    )


def check_target(target: str, module: bool) -> Optional[str]:
    """Why ``target`` cannot run (``None`` when it can), found without importing it.

    Args:
        target: A script path, or a module name with ``module=True``.
        module: Whether ``target`` is a module, as for ``python -m``.

    Returns:
        ``None``, or one line saying what is missing.
    """
    if not module:
        if os.path.isdir(target):
            if os.path.exists(os.path.join(target, "__main__.py")):
                return None
            return f"{target} is a directory without a __main__.py"
        return None if os.path.isfile(target) else f"no such script: {target}"
    # find the module as `python -m` would (the current directory first), one level at a
    # time, without importing its packages: their code must only run on the ranks
    parts = target.split(".")
    if not all(part.isidentifier() for part in parts):
        return f"not a module name: {target}"
    spec = importlib.machinery.PathFinder.find_spec(parts[0], [os.getcwd(), *sys.path])
    # built-in and frozen modules, and packages installed in editable mode (their
    # finder is not a path on sys.path); a top-level name is found without importing
    spec = spec or importlib.util.find_spec(parts[0])
    for part in parts[1:]:
        where = spec.submodule_search_locations if spec is not None else None
        spec = importlib.machinery.PathFinder.find_spec(part, list(where)) if where else None
    return None if spec is not None else f"no module named {target}"


class _Rank:
    """One rank process, with what the launcher learns about it."""

    def __init__(self, rank: int, proc: subprocess.Popen, error: int, stack: int) -> None:
        self.rank = rank
        self.proc = proc
        self.fds = {error: "error", stack: "stack"}  # the launcher's ends of the pipes
        self.data = {"error": bytearray(), "stack": bytearray()}
        self.exited_at: Optional[float] = None  # when the launcher saw it exit
        self.reported_at: Optional[float] = None  # when its traceback began to arrive
        #: whether the launcher was interrupted (Ctrl-C, SIGTERM): a rank's
        #: KeyboardInterrupt is then that, not a failure of its own
        self.interrupted = False

    @property
    def code(self) -> Optional[int]:
        return self.proc.returncode if self.exited_at is not None else None

    @property
    def failed_at(self) -> Optional[float]:
        """When the launcher learned this rank failed: its traceback arriving or, for a
        rank that died without one (``os._exit``, a signal), its exit.

        Not the exit alone: a rank that raised may take a while to shut down (torch
        tears its process group down at exit), and the rank it left waiting can fail
        and exit first. A Ctrl-C report is no failure when the launcher was interrupted
        too (a KeyboardInterrupt the rank raised on its own is one).
        """
        times = []
        ctrl_c = self.interrupted and (self.report() or {}).get("interrupted")
        if self.reported_at is not None and not ctrl_c:
            times.append(self.reported_at)
        # its exit after Ctrl-C at a terminal (which reached it too) may come before the
        # launcher's own handler ran: no failure either
        by_ctrl_c = self.interrupted and self.code in (INTERRUPTED, -signal.SIGINT)
        if self.exited_at is not None and self.code != 0 and not by_ctrl_c:
            times.append(self.exited_at)
        return min(times) if times else None

    def report(self) -> Optional[dict]:
        try:
            return json.loads(bytes(self.data["error"]).decode("utf-8", "replace"))
        except ValueError:
            return None


class _Launch:
    """Start the ranks, watch them, stop them, and say what happened."""

    def __init__(self, nprocs: int, out: Any, store: Any = None) -> None:
        self.nprocs = nprocs
        self.out = out
        self.store = store  # the rendezvous store, where each rank's exit code is noted
        self.store_lock = threading.Lock()
        self.run_id = f"distkit-{uuid.uuid4().hex[:12]}"
        self.ranks: list[_Rank] = []
        self.wake = threading.Event()
        self.lock = threading.Lock()  # guards the pipes' data
        self.signal: Optional[int] = None  # SIGINT or SIGTERM, once one arrives
        self.signal_at = float("inf")
        self.stopped_at = float("inf")  # when the launcher began to stop the ranks

    # -- processes --------------------------------------------------------------------

    def start(self, cmd: list[str], port: int) -> None:
        run_id = self.run_id
        preexec = die_with_parent(os.getpid())  # set before the rank's interpreter runs
        for rank in range(self.nprocs):
            error_r, error_w = os.pipe()
            stack_r, stack_w = os.pipe()
            env = _rank_env(rank, self.nprocs, port, run_id)
            env.update(DISTKIT_ERROR_FD=str(error_w), DISTKIT_STACK_FD=str(stack_w))
            try:
                proc = subprocess.Popen(
                    cmd, env=env, pass_fds=(error_w, stack_w), preexec_fn=preexec
                )
            except BaseException:
                for fd in (error_r, stack_r):
                    os.close(fd)
                for r in self.ranks:  # none of those started may outlive this
                    r.proc.kill()
                    r.proc.wait()
                    r.exited_at = time.monotonic()
                raise
            finally:
                os.close(error_w)
                os.close(stack_w)
            self.ranks.append(_Rank(rank, proc, error_r, stack_r))
        # threads only now: preexec_fn runs in a fork of this process, which is safest
        # while no other Python thread holds a lock
        for r in self.ranks:
            threading.Thread(target=self._watch, args=(r,), daemon=True).start()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _watch(self, r: _Rank) -> None:
        r.proc.wait()
        r.exited_at = time.monotonic()
        self.wake.set()
        self._note_exit(r)

    def _note_exit(self, r: _Rank) -> None:
        """Tell the ranks left waiting how this one ended (its exit code), beside the
        note it left itself (see distkit.dist.guard.board): they name it in their error."""
        from distkit.dist.guard.board import exit_key

        key = exit_key(r.rank, f"{self.run_id}.0")
        with self.store_lock:  # the store must not go while this talks to it
            store = self.store
            if store is None:
                return
            try:
                note = json.loads(bytes(store.get(key))) if store.check([key]) else {}
                note["code"] = r.proc.returncode
                note.setdefault("t", time.time())
                store.set(key, json.dumps(note))
            except Exception:  # the store is shutting down
                pass

    def close_store(self) -> Any:
        """Stop using the store; return it (the caller destroys it, while the
        interpreter runs: a TCPStore freed at exit aborts the process)."""
        with self.store_lock:
            store, self.store = self.store, None
        return store

    def _read(self) -> None:
        """Collect what the ranks write to their pipes until every pipe is closed."""
        sel = selectors.DefaultSelector()
        for r in self.ranks:
            for fd, kind in r.fds.items():
                sel.register(fd, selectors.EVENT_READ, (r, kind))
        while sel.get_map():
            for key, _ in sel.select(timeout=1.0):
                r, kind = key.data
                chunk = os.read(key.fd, 65536)
                if chunk:
                    with self.lock:
                        r.data[kind] += chunk
                    if kind == "error" and r.reported_at is None:
                        r.reported_at = time.monotonic()
                        self.wake.set()
                else:
                    sel.unregister(key.fd)
                    os.close(key.fd)
        sel.close()

    def running(self) -> list[_Rank]:
        return [r for r in self.ranks if r.exited_at is None]

    def _wait(self, ranks: list[_Rank], seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while any(r.exited_at is None for r in ranks) and time.monotonic() < deadline:
            self.wake.wait(min(0.05, max(deadline - time.monotonic(), 0.0)))
            self.wake.clear()

    def supervise(self, timeout: Optional[float]) -> str:
        """Wait until every rank exited, one failed (plus a grace), a timeout or a signal."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.signal is not None:
                return "signal"
            if not self.running():
                return "done"
            failed = [t for t in (r.failed_at for r in self.ranks) if t is not None]
            now = time.monotonic()
            if failed and now >= min(failed) + STOP_GRACE:
                return "failed"
            if deadline is not None and now >= deadline:
                return "timeout"
            self.wake.wait(0.1)  # a rank's exit wakes this at once; a signal within 0.1 s
            self.wake.clear()

    def stop(self, steps: Sequence[tuple[Optional[int], float]]) -> None:
        """Send each signal in turn to the ranks still running, waiting after each.

        A step whose signal is ``None`` only waits.
        """
        for sig, seconds in steps:
            ranks = self.running()
            if not ranks:
                return
            for r in ranks:
                try:
                    if sig is not None:
                        r.proc.send_signal(sig)
                except ProcessLookupError:
                    pass
            self._wait(ranks, seconds)

    def stacks(self, ranks: list[_Rank]) -> dict[int, str]:
        """Each rank's Python stack, dumped by faulthandler on SIGUSR1."""
        with self.lock:
            before = {r.rank: len(r.data["stack"]) for r in ranks}
        for r in ranks:
            try:
                r.proc.send_signal(signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        with self.lock:
            return {
                r.rank: bytes(r.data["stack"][before[r.rank] :]).decode("utf-8", "replace")
                for r in ranks
            }

    def finish(self) -> None:
        """Wait for every rank (already stopped) and for the last of their pipes."""
        self._wait(self.ranks, 10.0)
        # a rank's children may hold its pipes open; what the rank wrote is in by now (3 s:
        # on a loaded machine the reader can lag behind a stack a rank dumped as it died)
        self.reader.join(timeout=3.0)

    # -- the report -------------------------------------------------------------------

    def failures(self) -> list[_Rank]:
        """The ranks that failed on their own (before being stopped), in the order seen."""
        failed = [r for r in self.ranks if (r.failed_at or float("inf")) < self.stopped_at]

        def lost_a_peer(r: _Rank) -> bool:
            # an error that says another rank went away is that rank's doing: a rank that
            # exits (even without a traceback) closes its sockets before the launcher
            # sees it gone, so its peers' errors can arrive first
            text = (r.report() or {}).get("traceback") or ""
            return any(s in _summary(text) for s in _PEER_LOST)

        several = len(failed) > 1
        return sorted(failed, key=lambda r: (several and lost_a_peer(r), r.failed_at, r.rank))


#: What a rank's error says when another rank went away (gloo, NCCL, the store, or
#: distkit's own RankGoneError, which names it)
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
    "RankGoneError",
)


def run_script(
    script: str,
    script_args: Sequence[str] = (),
    nprocs: int = 2,
    timeout: Optional[float] = None,
    module: bool = False,
    file: Any = None,
) -> int:
    """Run a script (or ``-m module``) on ``nprocs`` local ranks, as torchrun would.

    Each rank is a fresh interpreter with the variables torchrun's agent sets (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``, the ``TORCHELASTIC_*`` ones, ...); this process hosts the rendezvous
    store on a port the system picks, so two launches never collide. When a rank fails,
    the others get 3 seconds, are stopped, and the traceback of the rank that failed
    first is printed. On a timeout the stack of every rank still running is printed. On
    Ctrl-C or SIGTERM the ranks are stopped within a few seconds.

    Args:
        script: Path of the script (or module name with ``module=True``).
        script_args: Its command-line arguments.
        nprocs: Number of ranks.
        timeout: Seconds before the run is stopped as hung (``None``: no limit).
        module: Run ``script`` as a module, like ``python -m``.
        file: Where to write the failure report (default ``sys.stderr``).

    Returns:
        0 when every rank exited cleanly; 1 when one failed or the run timed out; 2 when
        the script does not exist; 130 after Ctrl-C (SIGINT); 143 after SIGTERM.
    """
    out = file if file is not None else sys.stderr
    problem = check_target(script, module)
    if problem is not None:
        print(f"distkit launch: {problem}", file=out)
        return 2
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cmd = [sys.executable, "-m", "distkit.local.script", "--as-rank"]
    cmd += ["--module", script] if module else [script]
    launch = _Launch(nprocs, out, store)
    restore = _catch_signals(launch)
    stuck: list[_Rank] = []
    stacks: dict[int, str] = {}
    try:
        launch.start([*cmd, *script_args], store.port)
        outcome = launch.supervise(timeout)
        launch.stopped_at = min(launch.signal_at, time.monotonic())
        if launch.signal == signal.SIGINT:
            launch.stop([(None, 1.0)])  # Ctrl-C at a terminal reached the ranks too
        stuck = launch.running()
        stacks = launch.stacks(stuck) if stuck else {}
        first = [(signal.SIGINT, 1.0)] if launch.signal == signal.SIGINT else []
        launch.stop([*first, (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)])
        launch.finish()
    finally:
        launch.stop([(signal.SIGKILL, 5.0)])  # however this ends, no rank survives it
        restore()
        launch.close_store()
        del store
    return _report(launch, outcome, stuck, stacks, timeout)


def _catch_signals(launch: _Launch) -> Any:
    """Turn SIGINT and SIGTERM into a flag the supervising loop reads; return an undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    old = {}

    def note(signum: int, frame: Any) -> None:
        if launch.signal is None:
            launch.signal, launch.signal_at = signum, time.monotonic()
            for r in launch.ranks:
                r.interrupted = True
        launch.wake.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        old[sig] = signal.signal(sig, note)

    def restore() -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)

    return restore


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<fn>\S+)')


def _summary(traceback: str) -> str:
    """The first line of the exception a traceback ends with (its message may span
    several lines)."""
    lines = traceback.rstrip().splitlines()
    last_frame = max((i for i, ln in enumerate(lines) if ln.startswith("  File ")), default=-1)
    for line in lines[last_frame + 1 :]:
        if line and not line.startswith((" ", "Traceback (most recent call last)")):
            return line
    return lines[-1] if lines else ""


def _main_thread(dump: str) -> str:
    """The main thread's part of a faulthandler dump, without the launcher's frames."""
    blocks = [b for b in re.split(r"\n(?=(?:Current thread|Thread) 0x)", dump.strip()) if b]
    if not blocks:
        return ""
    lines = blocks[-1].splitlines()  # faulthandler lists the main thread last
    keep = [ln for ln in lines[1:] if not _launcher_frame(_frame_file(ln))]
    return "\n".join(keep)


def _frame_file(line: str) -> str:
    match = _FRAME.search(line)
    return match["file"] if match else ""


def _where(text: str, innermost_first: bool) -> Optional[str]:
    """The innermost frame of a stack that is the user's code (else the innermost)."""
    frames = [m for m in _FRAME.finditer(text) if not _launcher_frame(m["file"])]
    if innermost_first:
        frames.reverse()
    if not frames:
        return None
    mine = [m for m in frames if not _library_file(m["file"])]
    m = (mine or frames)[-1]
    where = f"{m['file']}:{m['line']} in {m['fn']}"
    inner = frames[frames.index(m) + 1 :]  # what that line was running, outermost first
    if mine and inner and _distkit_file(inner[0]["file"]):
        return f"in dist.{inner[0]['fn']} at {where}"  # e.g. waiting in a collective
    return f"at {where}"


def _distkit_file(filename: str) -> bool:
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return filename.startswith("<distkit") or filename.startswith(package + os.sep)


def _library_file(filename: str) -> bool:
    """Whether a frame is torch's, distkit's or the standard library's."""
    import sysconfig

    torch = sys.modules.get("torch")
    roots = [sysconfig.get_paths()["stdlib"], os.path.dirname(os.path.dirname(__file__))]
    if torch is not None and torch.__file__:
        roots.append(os.path.dirname(torch.__file__))
    return filename.startswith("<") or any(
        filename.startswith(root + os.sep) for root in roots if root
    )


def _report(
    launch: _Launch, outcome: str, stuck: list[_Rank], stacks: dict[int, str], timeout: Any
) -> int:
    n = launch.nprocs
    lines = []
    failed = launch.failures()
    stuck = [r for r in stuck if r not in failed]  # a rank slow to exit after its error
    if outcome == "signal":
        name = "Ctrl-C (SIGINT)" if launch.signal == signal.SIGINT else "SIGTERM"
        stopped = [r for r in launch.ranks if r not in failed and r.code != 0]
        lines.append(
            f"distkit launch: interrupted by {name}; stopped rank(s) "
            + (", ".join(str(r.rank) for r in stopped) or "none")
        )
        for r in stopped:
            report = r.report()
            where = _where(report["traceback"], False) if report else None
            if where is None and r.rank in stacks:
                where = _where(_main_thread(stacks[r.rank]), True)
            if where is None and r.data["stack"]:  # what it dumped as a signal ended it
                dumped = bytes(r.data["stack"]).decode("utf-8", "replace")
                where = _where(_main_thread(dumped), True)
            if where:
                lines.append(f"  rank {r.rank} was {where}")
    for i, r in enumerate(failed):
        code = r.code or 0
        if r.exited_at is None or r.exited_at >= launch.stopped_at:
            how = "stopped while it exited"
        else:
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        report = r.report()
        if i == 0:
            first = " first" if len(failed) > 1 else ""
            lines.append(f"distkit launch: rank {r.rank} of {n} failed{first} ({how})")
            if report and report["traceback"]:
                lines.append(report["traceback"].rstrip())
            elif report and "exit" in report:
                lines.append(f"(it called sys.exit({report['exit']}); no Python traceback)")
            else:
                lines.append("(it printed no Python traceback: it exited or was killed)")
        else:
            if report and "exit" in report:
                last = f"sys.exit({report['exit']})"
            else:
                last = _summary(report["traceback"]) if report else "no traceback"
            lines.append(f"distkit launch: rank {r.rank} of {n} failed too ({how}): {last}")
    if stuck and outcome == "failed":
        lines.append(
            f"distkit launch: rank(s) {', '.join(str(r.rank) for r in stuck)} were still "
            f"running {STOP_GRACE:g} s after rank {failed[0].rank} failed and were stopped"
        )
        for r in stuck:
            where = _where(_main_thread(stacks.get(r.rank, "")), True)
            if where:
                lines.append(f"  rank {r.rank} was {where}")
    if stuck and outcome == "timeout":
        lines.append(
            f"distkit launch: rank(s) {', '.join(str(r.rank) for r in stuck)} were still "
            f"running after the {timeout:g} s timeout and were stopped"
        )
        for r in stuck:
            stack = _main_thread(stacks.get(r.rank, "")) or "(no stack was dumped)"
            lines.append(f"--- rank {r.rank} was here (main thread, most recent call first) ---")
            lines.append(stack)
    if lines:
        print("\n".join(lines), file=launch.out)
    if outcome == "signal":
        return INTERRUPTED if launch.signal == signal.SIGINT else TERMINATED
    return 1 if failed or stuck else 0


# -- inside a rank ----------------------------------------------------------------------


def _channel(name: str) -> Optional[int]:
    """The pipe the launcher passed in ``name`` (its descriptor), kept from the script's
    own children."""
    fd = os.environ.pop(name, None)
    if fd is None:
        return None
    try:
        os.set_inheritable(int(fd), False)
        return int(fd)
    except (OSError, ValueError):
        return None


def _as_rank(argv: list[str]) -> None:
    """Entry point of one script rank: run it; hand a failure's traceback to the launcher.

    The launcher prints the traceback (once, from the script's own frames on); this
    rank prints it itself only when it cannot hand it over.
    """
    me = os.getpid()
    error_fd = _channel("DISTKIT_ERROR_FD")
    errors = None if error_fd is None else os.fdopen(error_fd, "w", encoding="utf-8")
    # the stack pipe stays open to the end, for faulthandler, which writes to the
    # descriptor itself (no file object to be collected, closing it, at exit)
    stacks = _channel("DISTKIT_STACK_FD")
    if stacks is not None:
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        # a SIGTERM sent to every process (a job scheduler, kill -TERM -<group>) ends
        # the rank at once: leave the launcher its stack first, to say where it was
        faulthandler.register(signal.SIGTERM, file=stacks, all_threads=True, chain=True)
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
    except SystemExit as exc:
        # a failing sys.exit is the moment this rank failed: say so now, not at its exit
        # (torch's teardown at exit can outlast a peer that fails on the closed group)
        if exc.code not in (None, 0) and errors is not None and os.getpid() == me:
            _hand_over_exit(errors, exc.code)
        raise
    except BaseException as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        if interrupted:  # a second Ctrl-C must not cut this report short
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        board = sys.modules.get("distkit.dist.guard.board")
        if board is not None and os.getpid() == me:  # tell the ranks waiting for this one
            board.note_exception(exc)
            board.note_exit("raised")
        if errors is None or os.getpid() != me or not _hand_over(errors, exc, interrupted):
            raise  # not the rank itself (a child it forked), or no launcher to tell
        sys.exit(INTERRUPTED if interrupted else 1)
    finally:
        _close(errors)  # a clean end has nothing to hand over (a failure closed it)


def _close(errors: Any) -> None:
    try:
        if errors is not None:
            errors.close()
    except (OSError, ValueError):
        pass


def _hand_over(errors: Any, exc: BaseException, interrupted: bool) -> bool:
    import traceback

    tb = exc.__traceback__
    while tb is not None and _launcher_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next  # start the report at the script's own frames
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        json.dump({"traceback": text, "interrupted": interrupted}, errors)
        errors.close()
    except (OSError, ValueError):
        return False
    return True


def _hand_over_exit(errors: Any, code: object) -> None:
    try:
        json.dump({"traceback": "", "interrupted": False, "exit": repr(code)}, errors)
        errors.close()
    except (OSError, ValueError):
        pass


def _launcher_frame(filename: str) -> bool:
    return filename == __file__ or "runpy" in filename


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--as-rank":
        _as_rank(sys.argv[2:])
    else:
        print("usage: distkit launch -n N script.py [args...]", file=sys.stderr)
        sys.exit(2)
