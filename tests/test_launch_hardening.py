"""`distkit launch` and `distkit.launch()` under failure: who failed first, how fast the
others stop, that no rank outlives a killed launcher, and that nothing is left in the
temporary directory, whichever way a run ends.

Every process a test starts carries a unique ``DISTKIT_TEST_MARK`` in its environment
(ranks inherit it), so the process table tells whether any of them is still running.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from conftest import ROOT
from helpers_subprocess import MARK, marked, script_env, wait_for

from distkit.local import script

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def tmp_path():
    """A folder with a short path: the ranks' forkserver puts its socket in TMPDIR, and
    a Unix socket's path has at most 107 bytes (pytest-xdist's folders are deeper)."""
    path = Path(tempfile.mkdtemp(prefix="dk-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start(args: list[str], tmp_path, mark: str, **popen) -> subprocess.Popen:
    """``python args`` with TMPDIR in a fresh folder and this test's mark."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = script_env(**{MARK: mark, "TMPDIR": str(tmp)})
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True, **popen)


def kill_soon_after_its_first_child(proc: subprocess.Popen, delay: float) -> None:
    try:
        assert wait_for(lambda: children(proc.pid), 120, interval=0.001), "no rank started"
        time.sleep(delay)
    finally:
        proc.kill()
        proc.wait()  # not communicate(): a surviving rank would hold the pipes open


def finish(proc: subprocess.Popen, timeout: float = 180, mark: str = "") -> tuple[int, str, str]:
    """Wait for ``proc`` and its output. Past ``timeout``: fail naming what still runs
    (with ``mark``, every process of the test: one that holds the pipes keeps the
    output from ending even once ``proc`` exited)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        state = "still running" if proc.poll() is None else f"exited {proc.returncode}"
        pids = marked(mark) if mark else []
        alive = [_describe(pid) for pid in pids]
        proc.kill()
        for pid in pids:  # one may end meanwhile: the report above is what counts
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"no end of output after {timeout} s: the process {state}; still running: "
            f"{alive}\n--- stdout\n{out}\n--- stderr\n{err}"
        )
    return proc.returncode, out, err


def _describe(pid: int) -> str:
    """A running process, as a person debugging a hang wants to see it."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/wchan") as f:
            wchan = f.read()
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} (state {fields[0]}, parent {fields[1]}, in {wchan or '-'}): {cmd}"


def no_survivors(mark: str, tmp_path) -> None:
    """No process of this test is running and the temporary directory is empty."""
    assert wait_for(lambda: not marked(mark), 10), f"still running: {marked(mark)}"
    assert sorted(os.listdir(tmp_path / "tmp")) == []


def launch_cli(tmp_path, mark: str, source: str, *args: str) -> subprocess.Popen:
    script = tmp_path / "script.py"
    script.write_text(source)
    return start(["-m", "distkit", "launch", *args, str(script)], tmp_path, mark)


def first_failure(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if re.match(r"distkit launch: rank \d+ of", ln)]
    assert lines, stderr
    return lines[0]


# -- which rank failed first ---------------------------------------------------------------

DIES = """
import os, signal, sys
import torch
import distkit.dist as dist
dist.init_dist()
if dist.get_rank() == 1:
    {how}
dist.all_reduce(torch.ones(1))  # rank 0 fails here, after rank 1 is gone
"""
HOW = {
    "os._exit": "os._exit(3)",
    "sigkill": "os.kill(os.getpid(), signal.SIGKILL)",
    "sys.exit": "sys.exit(5)",
    # raised by the rank itself, with no Ctrl-C at the launcher: a failure like any other
    "KeyboardInterrupt": "raise KeyboardInterrupt",
}


@pytest.mark.parametrize("how", sorted(HOW))
def test_the_rank_seen_to_exit_first_is_named_first(how, tmp_path):
    """A rank that dies without a traceback wrote no report: it still failed first."""
    mark = uuid.uuid4().hex
    code, _, err = finish(launch_cli(tmp_path, mark, DIES.format(how=HOW[how]), "-n", "2"))
    assert code == 1, err
    assert first_failure(err).startswith("distkit launch: rank 1 of 2 failed"), err
    if how == "sys.exit":  # told at the call, before torch's teardown at exit
        assert "(it called sys.exit(5); no Python traceback)" in err, err
    no_survivors(mark, tmp_path)


SLOW_TO_EXIT = """
import atexit, time
import torch
import torch.distributed as td
import distkit.dist as dist
dist.init_dist()
if dist.get_rank() == 1:
    atexit.register(time.sleep, 2)  # runs after torch's own exit hook closed the group
    atexit.register(td.destroy_process_group)
    raise ValueError("rank one is unhappy")
dist.all_reduce(torch.ones(1))  # fails as soon as rank 1's group is gone
"""


def test_a_rank_that_raised_is_first_even_if_it_exits_last(tmp_path):
    """Its traceback is the moment it failed, not its exit."""
    mark = uuid.uuid4().hex
    code, _, err = finish(launch_cli(tmp_path, mark, SLOW_TO_EXIT, "-n", "2"))
    assert code == 1, err
    # (under load its exit may come after the others were stopped: its "how" varies)
    assert first_failure(err).startswith("distkit launch: rank 1 of 2 failed first ("), err
    assert "rank 0 of 2 failed too" in err
    no_survivors(mark, tmp_path)


class _Exited:
    """Stands in for a rank's Popen once it exited."""

    def __init__(self, returncode: int) -> None:
        self.returncode = returncode


def _failed_rank(rank: int, at: float, last_line: str) -> script._Rank:
    r = script._Rank(rank, _Exited(1), -1, -2)  # type: ignore[arg-type]
    report = {"traceback": f"Traceback (most recent call last):\n  ...\n{last_line}\n"}
    r.data["error"] += json.dumps(report).encode()
    r.reported_at = r.exited_at = at
    return r


@pytest.mark.parametrize(
    "lost",
    [
        "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1",
        "RuntimeError: Connection reset by peer",
        "BrokenPipeError: [Errno 32] Broken pipe",
        "torch.distributed.DistStoreError: the remote process exited",
    ],
)
def test_a_rank_that_only_lost_a_peer_is_not_named_first(lost):
    """Its traceback may arrive before the peer that went away is seen to fail."""
    launch = script._Launch(3, None)
    peer = _failed_rank(0, 1.0, lost)  # reported first
    culprit = _failed_rank(2, 2.0, "ValueError: rank two is unhappy")
    launch.ranks = [peer, culprit]
    assert [r.rank for r in launch.failures()] == [2, 0]
    launch.ranks = [peer]  # alone, it is the one that failed
    assert [r.rank for r in launch.failures()] == [0]
    launch.ranks = [_failed_rank(1, 0.5, "ValueError: first"), culprit]  # time decides
    assert [r.rank for r in launch.failures()] == [1, 2]


# -- the others stop soon after a failure, whichever rank fails -------------------------------

ONE_FAILS = """
import os, time
if os.environ["RANK"] == "{failing}":
    with open({stamp!r}, "w") as f:
        f.write(repr(time.time()))
    raise ValueError("rank {failing} fails")
time.sleep(30)
"""


@pytest.mark.parametrize("failing", [0, 1])
def test_the_others_are_stopped_a_few_seconds_after_a_failure(failing, tmp_path):
    mark = uuid.uuid4().hex
    stamp = tmp_path / "failed-at"
    source = ONE_FAILS.format(failing=failing, stamp=str(stamp))
    code, _, err = finish(launch_cli(tmp_path, mark, source, "-n", "2"))
    took = time.time() - float(stamp.read_text())
    assert code == 1, err
    # stopped, not left to its 30-s sleep: 3 s of grace, then up to 8 s of signals, and
    # room for a loaded machine (the bounds of the stops below once failed by 0.6 s)
    assert took < 20, f"the other rank ran on for {took:.1f} s after rank {failing} failed"
    assert f"rank {failing} of 2 failed" in err and f"ValueError: rank {failing} fails" in err
    assert f"rank(s) {1 - failing} were still running 3 s after rank {failing} failed" in err
    no_survivors(mark, tmp_path)


# -- no rank outlives a SIGKILLed launcher -------------------------------------------------------

SLEEPS = """
import os, time
with open(os.path.join({folder!r}, "ready-" + os.environ["RANK"]), "w"):
    pass
time.sleep(60)
"""


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_a_sigkilled_cli_launcher_leaves_no_rank(delay, tmp_path):
    """Killed at once after it started its first rank: before any rank's interpreter ran."""
    mark = uuid.uuid4().hex
    script = tmp_path / "script.py"
    script.write_text(SLEEPS.format(folder=str(tmp_path)))
    args = ["-m", "distkit", "launch", "-n", "3", str(script)]
    proc = start(args, tmp_path, mark, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_soon_after_its_first_child(proc, delay)
    no_survivors(mark, tmp_path)


LAUNCHES = """
import time
import distkit
distkit.launch(time.sleep, 3, args=(60,), start_method={method!r}, timeout=None)
"""


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
@pytest.mark.parametrize("delay", [0.05])
def test_a_sigkilled_launch_call_leaves_no_rank(method, delay, tmp_path):
    """A fork server (started first) may finish importing torch before it notices."""
    mark = uuid.uuid4().hex
    args = ["-c", LAUNCHES.format(method=method)]
    proc = start(args, tmp_path, mark, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kill_soon_after_its_first_child(proc, delay)
    assert wait_for(lambda: not marked(mark), 60), f"still running: {marked(mark)}"


# -- Ctrl-C and SIGTERM --------------------------------------------------------------------------

LAUNCH_SLEEPERS = """
import os, signal, sys, time
import distkit

# Ctrl-C raises KeyboardInterrupt, as at a terminal, even when this test's run inherited
# SIGINT ignored (a background job of a shell script ignores it, and so does every
# Python it starts; distkit.launch keeps the disposition it was given)
signal.signal(signal.SIGINT, signal.default_int_handler)

def sleeper(folder):
    import distkit.dist as dist
    open(os.path.join(folder, f"ready-{dist.get_rank()}"), "w").close()
    time.sleep(60)

distkit.launch(sleeper, 3, args=(sys.argv[1],))
"""


def ready(folder, n: int) -> bool:
    return len(list(folder.glob("ready-*"))) == n


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_launch_call_stops_its_ranks_within_seconds_on_a_signal(sig, tmp_path):
    mark = uuid.uuid4().hex
    proc = start(["-c", LAUNCH_SLEEPERS, str(tmp_path)], tmp_path, mark)
    assert wait_for(lambda: ready(tmp_path, 3), 120), finish(proc, 10)
    sent = time.monotonic()
    proc.send_signal(sig)
    code, _, err = finish(proc, 60, mark)
    took = time.monotonic() - sent
    # stopped, not left to its 60-s sleep: the signals take up to 8.5 s, and a loaded
    # machine more (a bound of 8 s failed there once, at 8.6 s)
    assert took < 20, f"took {took:.1f} s to stop"
    if sig == signal.SIGINT:
        assert "KeyboardInterrupt" in err
    else:
        assert code == -signal.SIGTERM, err  # it still ends by the signal it was sent
    no_survivors(mark, tmp_path)


@pytest.mark.parametrize(
    ("sig", "whole_group"),
    [(signal.SIGINT, False), (signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["SIGINT-launcher", "SIGINT-terminal", "SIGTERM-launcher"],
)
def test_cli_interrupted_says_so_and_stops_the_ranks(sig, whole_group, tmp_path):
    """``terminal``: the signal reaches every process, as Ctrl-C at a terminal does."""
    mark = uuid.uuid4().hex
    script = tmp_path / "script.py"
    script.write_text(SLEEPS.format(folder=str(tmp_path)))
    args = ["-m", "distkit", "launch", "-n", "3", str(script)]
    proc = start(args, tmp_path, mark, start_new_session=True)
    assert wait_for(lambda: ready(tmp_path, 3), 120), finish(proc, 10)
    sent = time.monotonic()
    if whole_group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    code, _, err = finish(proc, 60)
    took = time.monotonic() - sent
    assert code == 128 + sig, err
    name = "Ctrl-C (SIGINT)" if sig == signal.SIGINT else "SIGTERM"
    assert f"distkit launch: interrupted by {name}; stopped rank(s) 0, 1, 2" in err, err
    assert "after another rank failed" not in err and "Traceback" not in err, err
    # stopped, not left to its 60-s sleep: the signals take up to 8.5 s, and a loaded
    # machine more (a bound of 8 s failed there once, at 8.6 s)
    assert took < 20, f"took {took:.1f} s to stop"
    no_survivors(mark, tmp_path)


STUCK_IN_DIFFERENT_CALLS = """
import os, torch, distkit.dist as dist
dist.init_dist()
dist.barrier()  # the collectives' modules loaded (seconds under load): the calls start at once
with open(os.path.join({folder!r}, "ready-" + os.environ["RANK"]), "w"):
    pass
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(4))  # line 8: rank 1 never comes here
else:
    dist.broadcast(torch.ones(8))  # line 10
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_interrupted_says_where_each_rank_was(sig, tmp_path):
    """Ranks hung in different collectives (the default check is off, so gloo waits):
    the report names each rank's collective and line."""
    mark = uuid.uuid4().hex
    script = tmp_path / "script.py"
    script.write_text(STUCK_IN_DIFFERENT_CALLS.format(folder=str(tmp_path)))
    args = ["-m", "distkit", "launch", "-n", "2", str(script)]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = script_env(**{MARK: mark, "TMPDIR": str(tmp), "DISTKIT_CHECK": "0"})
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert wait_for(lambda: ready(tmp_path, 2), 120), finish(proc, 10)
    time.sleep(3.0)  # both ranks inside their collective, on a loaded machine too
    os.killpg(proc.pid, sig)  # the whole group, as Ctrl-C at a terminal
    code, _, err = finish(proc, 60)
    assert code == 128 + sig, err
    assert f"rank 0 was in dist.all_reduce at {script}:8 in <module>" in err, err
    assert f"rank 1 was in dist.broadcast at {script}:10 in <module>" in err, err


# -- nothing left in the temporary directory ----------------------------------------------------

OK = "import torch.distributed\n"
FAILS = "import os\nif os.environ['RANK'] == '1':\n    raise SystemExit(4)\n"


@pytest.mark.parametrize(
    ("source", "args", "expected"),
    [(OK, (), 0), (FAILS, (), 1), ("import time\ntime.sleep(30)\n", ("--timeout", "2"), 1)],
    ids=["ok", "failure", "timeout"],
)
def test_cli_leaves_no_file(source, args, expected, tmp_path):
    mark = uuid.uuid4().hex
    code, _, err = finish(launch_cli(tmp_path, mark, source, "-n", "2", *args))
    assert code == expected, err
    no_survivors(mark, tmp_path)


def test_cli_timeout_shows_where_each_rank_is(tmp_path):
    source = "import time\ndef nap():\n    time.sleep(30)\nnap()\n"
    mark = uuid.uuid4().hex
    code, _, err = finish(launch_cli(tmp_path, mark, source, "-n", "2", "--timeout", "3"))
    assert code == 1
    assert "rank(s) 0, 1 were still running after the 3 s timeout and were stopped" in err
    assert "--- rank 1 was here" in err and "in nap" in err, err
    assert "failed" not in err, "ranks stopped at the timeout did not fail on their own"


LAUNCH_ENDS = """
import sys, time
import distkit
import distkit.dist as dist

def task(how):
    if how == "raise" and dist.get_rank() == 1:
        raise ValueError("rank 1 fails")
    if how == "hang" and dist.get_rank() == 1:
        time.sleep(30)
    return dist.get_rank()

try:
    print(distkit.launch(task, 2, args=(sys.argv[1],), timeout=3))
except distkit.RankError as exc:
    print(type(exc).__name__)
"""


@pytest.mark.parametrize("how", ["ok", "raise", "hang"])
def test_launch_call_leaves_no_file(how, tmp_path):
    mark = uuid.uuid4().hex
    code, out, err = finish(start(["-c", LAUNCH_ENDS, how], tmp_path, mark))
    assert code == 0, err
    assert out.strip() == {"ok": "[0, 1]", "raise": "RankError", "hang": "RankTimeout"}[how]
    no_survivors(mark, tmp_path)


def test_a_pool_never_closed_removes_its_directory_at_exit(tmp_path):
    code = "from distkit.testing import RankPool\nprint(RankPool(2).run(abs, -3))\n"
    mark = uuid.uuid4().hex
    status, out, err = finish(start(["-c", code], tmp_path, mark))
    assert status == 0 and out.strip() == "[3, 3]", err
    no_survivors(mark, tmp_path)


def test_a_run_after_a_sigkilled_launch_is_unaffected(tmp_path):
    mark = uuid.uuid4().hex
    proc = start(["-c", LAUNCH_SLEEPERS, str(tmp_path)], tmp_path, mark)
    assert wait_for(lambda: ready(tmp_path, 3), 120), finish(proc, 10)
    proc.kill()
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    assert wait_for(lambda: not marked(mark), 10)
    again = "import distkit, distkit.dist as dist\nprint(distkit.launch(dist.get_rank, 2))\n"
    code, out, err = finish(start(["-c", again], tmp_path, mark))
    assert (code, out.strip()) == (0, "[0, 1]"), err


# -- launch()'s default timeout ----------------------------------------------------------------


class _Captured(Exception):
    pass


def test_launch_has_a_finite_default_timeout_and_none_means_no_limit(monkeypatch):
    import distkit.local.launch as launch_module

    seen = {}

    class FakePool:
        def __init__(self, nprocs, backend, timeout, pg_timeout, env, start_method):
            seen.update(timeout=timeout, pg_timeout=pg_timeout)
            raise _Captured

    monkeypatch.setattr(launch_module, "RankPool", FakePool)
    default = inspect.signature(launch_module.launch).parameters["timeout"].default
    assert default is not None and 60 <= default <= 600
    with pytest.raises(_Captured):
        launch_module.launch(abs, 2, start_method="spawn", backend="gloo")
    assert seen == {"timeout": default, "pg_timeout": default}
    with pytest.raises(_Captured):
        launch_module.launch(abs, 2, timeout=None, start_method="spawn", backend="gloo")
    assert seen == {"timeout": None, "pg_timeout": launch_module.NO_LIMIT_PG_TIMEOUT}


FAILING = """
import torch
import distkit.dist as dist
dist.init_dist()
if dist.get_rank() == 1:
    raise ValueError("rank one is unhappy")
dist.all_reduce(torch.ones(1))
"""


def test_cli_shows_a_rank_traceback_once_from_the_script_on(tmp_path):
    mark = uuid.uuid4().hex
    code, _, err = finish(launch_cli(tmp_path, mark, FAILING, "-n", "2"))
    assert code == 1
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.count('raise ValueError("rank one is unhappy")') == 1, err
    assert err.count("\nValueError: rank one is unhappy") == 1, err
    assert "runpy" not in err and "distkit/local/script.py" not in err, err
    # rank 0, left waiting, names rank 1 and what it raised (once, in one line)
    # "exited (code 1)" once the launcher's exit code is on the store (it follows the
    # rank's own note; on a loaded machine it may come after rank 0 has stopped waiting)
    gone = r"RankGoneError: all_reduce: rank 1 (exited \(code 1\)|failed) with ValueError: rank one"
    assert re.search(gone, err), err


# -- the variables torchrun's agent sets ----------------------------------------------------------


def test_ranks_get_every_variable_torchruns_agent_sets():
    """torch 2.1 to 2.4 read TORCHELASTIC_RESTART_COUNT once the agent store is in use."""
    from torch.distributed.elastic.agent.server import local_elastic_agent

    from distkit.local.script import _rank_env

    source = inspect.getsource(local_elastic_agent)
    block = source[
        source.index("worker_env = {") : source.index("}", source.index("worker_env = {"))
    ]
    agent = set(re.findall(r'"([A-Z][A-Z_]+)":', block))
    assert {"TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"} <= agent
    env = _rank_env(1, 2, 12345, "run")
    assert sorted(agent - set(env)) == []
    assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
