"""Run a script on local ranks without torchrun: ``distkit launch -n N script.py``.

Each rank is a fresh interpreter with the variables torchrun would set, so the script's
own ``dist.init_dist()`` (or ``torch.distributed.init_process_group()``) joins them.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, Optional

from distkit.local.pool import STOP_GRACE


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
        cmd = [sys.executable, "-m", "distkit.local.script", "--as-rank"]
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
    from distkit.local.worker import _set_parent_death_signal

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
