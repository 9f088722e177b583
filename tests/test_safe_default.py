"""Safe by default: the mistakes a newcomer makes fail loudly, fast and on every rank,
with no setting changed.

- a launcher started the process but no process group exists: collectives raise;
- ranks disagree on a collective (dtype, length, a skipped call): the default check
  raises ``CollectiveMismatchError`` on every rank, naming every rank's call site;
- a collective waits long: the watchdog reports who has not arrived and where everyone
  is, once, and the run goes on;
- a rank exits while others wait for it: they raise ``RankGoneError`` naming it.
"""

from __future__ import annotations

import contextlib
import io
import sys
import textwrap
import time

import pytest
import torch
from conftest import mismatch, world
from helpers_subprocess import script_env, torchrun

import distkit.dist as dist
from distkit import _registry, _settings
from distkit.dist import _check
from distkit.testing import ranks

pytestmark = pytest.mark.timeout(120)

# -- a launcher, but no process group ------------------------------------------------

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SRUN = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}
MPIRUN = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_", "SLURM_", "OMPI_", "PMI_", "DISTKIT_INDEPENDENT")


@pytest.fixture
def launched_by(monkeypatch):
    """Put a launcher's variables in the environment (and nothing of another one's)."""
    import os

    def put(env: dict) -> None:
        for name in list(os.environ):
            if name.startswith(_LAUNCH_VARS):
                monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        _registry.forget_alone()

    yield put
    monkeypatch.undo()
    _registry.forget_alone()


def _calls():
    t = torch.ones(2)
    return {
        "all_reduce": lambda: dist.all_reduce(t),
        "all_reduce(op=max)": lambda: dist.all_reduce(t, op="max"),
        "all_gather": lambda: dist.all_gather(t),
        "gather": lambda: dist.gather(t),
        "broadcast": lambda: dist.broadcast(t),
        "reduce": lambda: dist.reduce(t),
        "reduce_scatter": lambda: dist.reduce_scatter(t),
        "all_to_all": lambda: dist.all_to_all([t]),
        "all_to_all_single": lambda: dist.all_to_all_single(t),
        "scatter": lambda: dist.scatter([t]),
        "barrier": lambda: dist.barrier(),
        "group=[0]": lambda: dist.all_reduce(t, group=[0]),
        "all_gather_object": lambda: dist.all_gather_object({"a": 1}),
        "gather_object": lambda: dist.gather_object(1),
        "broadcast_object_list": lambda: dist.broadcast_object_list([1]),
        "broadcast_object": lambda: dist.broadcast_object(1),
        "scatter_object_list": lambda: dist.scatter_object_list([1]),
        "all_to_all_object": lambda: dist.all_to_all_object([1]),
        "all_reduce_dict": lambda: dist.all_reduce_dict({"x": t}),
        "all_reduce_params": lambda: dist.all_reduce_params([t]),
        "sync_random_seed": lambda: dist.sync_random_seed(),
        "collect_results": lambda: dist.collect_results([1, 2], 2),
        "iter_results": lambda: list(dist.iter_results([1, 2], 2)),
    }


@pytest.mark.parametrize("name", list(_calls()))
def test_every_collective_refuses_to_run_alone_under_a_launcher(name, launched_by):
    launched_by(TORCHRUN)
    with pytest.raises(RuntimeError) as info:
        _calls()[name]()
    text = str(info.value)
    assert "no process group exists, but torchrun (or another launcher) started this " in text
    assert "as rank 1 of 2 (RANK=1, WORLD_SIZE=2, MASTER_ADDR=127.0.0.1, MASTER_PORT=29500)" in text
    assert "every rank would silently work alone. Call dist.init_dist()" in text
    assert 'dist.init_dist(launcher="none") or set DISTKIT_INDEPENDENT=1' in text
    # what rank and world size are may still be asked: they describe this process
    assert (dist.get_rank(), dist.get_world_size(), dist.get_dist_info()) == (0, 1, (0, 1))


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (SRUN, "srun started this process as rank 3 of 4 (SLURM_PROCID=3, SLURM_NTASKS=4, "),
        (MPIRUN, "mpirun started this process as rank 0 of 2 (OMPI_COMM_WORLD_RANK=0, "),
    ],
    ids=["srun", "mpirun"],
)
def test_the_error_names_the_launcher_and_its_variables(env, says, launched_by):
    launched_by(env)
    with pytest.raises(RuntimeError, match="no process group exists") as info:
        dist.all_reduce(torch.ones(1))
    assert says in str(info.value)


@pytest.mark.parametrize(
    "how",
    ["DISTKIT_INDEPENDENT=1", 'init_dist("none")', "WORLD_SIZE=1", "a SLURM batch script"],
)
def test_one_switch_lets_launched_processes_run_alone(how, launched_by):
    env = dict(TORCHRUN)
    if how == "DISTKIT_INDEPENDENT=1":
        env["DISTKIT_INDEPENDENT"] = "1"
    elif how == "WORLD_SIZE=1":
        env.update(RANK="0", WORLD_SIZE="1")
    elif how == "a SLURM batch script":  # only srun starts the other tasks
        env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}
    launched_by(env)
    if how.startswith("init_dist"):
        assert dist.init_dist("none") == (0, 1)
    t = torch.ones(2)
    assert dist.all_reduce(t) is t
    assert dist.all_gather_object(7) == [7]
    assert dist.barrier() is None


def test_without_a_launcher_nothing_changes(launched_by):
    launched_by({})
    t = torch.ones(2)
    assert dist.all_reduce(t) is t and dist.all_gather(t)[0] is t
    # decided once: the collectives' shortcuts read the registry itself again
    assert _registry.guard() is _registry.current


NOINIT = """
import torch, distkit.dist as dist
print("rank", dist.get_rank(), "of", dist.get_world_size(), flush=True)
dist.all_reduce(torch.ones(2))
print("not reached", flush=True)
"""


def _script(tmp_path, source: str, name: str = "script.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def _launch(tmp_path, source: str, n: int = 2, timeout: float = 90, **env: str):
    import subprocess

    from conftest import ROOT

    args = [sys.executable, "-m", "distkit", "launch", "-n", str(n), _script(tmp_path, source)]
    return subprocess.run(
        args, cwd=ROOT, env=script_env(**env), capture_output=True, text=True, timeout=timeout
    )


def test_a_script_that_forgets_init_dist_fails_on_every_rank(tmp_path):
    proc = _launch(tmp_path, NOINIT)
    assert proc.returncode == 1, proc.stderr
    assert "not reached" not in proc.stdout
    for rank in (0, 1):
        assert f"started this process as rank {rank} of 2 (RANK={rank}, WORLD_SIZE=2" in (
            proc.stderr
        ), proc.stderr


# -- the default check ----------------------------------------------------------------


@ranks(2, 3)
def test_the_default_check_catches_a_dtype_mismatch_on_every_rank():
    rank, size = world()
    assert not dist.get_debug()
    x = torch.ones(4) if rank == 0 else torch.ones(4, dtype=torch.int32)
    text = mismatch(lambda: dist.all_reduce(x), debug=False)
    assert "found by distkit's default check" in text
    assert "rank 0: all_reduce(data={'dtype': 'float32', 'shape': [4]}, op=sum) at " in text
    assert "rank 1: all_reduce(data={'dtype': 'int32', 'shape': [4]}, op=sum) at " in text
    assert text.count("tests/test_safe_default.py:") == size  # every rank's call site
    assert "They must agree on: data.dtype." in text


@ranks(2, 3)
def test_the_default_check_catches_a_length_mismatch_before_gloo_aborts():
    rank, _ = world()
    text = mismatch(lambda: dist.all_reduce(torch.ones(4 + rank)), debug=False)
    assert "They must agree on: data.shape." in text
    text = mismatch(lambda: dist.broadcast(torch.ones(2 + rank)), debug=False)
    assert "broadcast(data=" in text


@ranks(2, 3)
def test_the_default_check_catches_a_skipped_collective_with_both_call_sites():
    rank, _ = world()
    x = torch.ones(3)

    def step():
        if rank == 0:
            dist.all_reduce(x)  # only rank 0
        dist.barrier()

    text = mismatch(step, debug=False)
    assert "rank 0: all_reduce(data={'dtype': 'float32', 'shape': [3]}, op=sum) at " in text
    assert "rank 1: barrier() at tests/test_safe_default.py:" in text
    assert "a rank that skips one (a branch on the rank, an early return)" in text


@ranks(2, 3)
def test_what_may_differ_passes_the_default_check():
    rank, size = world()
    if rank % 2:  # the same collective, called from another line
        out = dist.all_reduce(torch.ones(2))
    else:
        out = dist.all_reduce(torch.ones(2))
    assert out.tolist() == [size, size]
    shards = dist.all_gather(torch.ones(rank + 1))
    assert [t.numel() for t in shards] == [r + 1 for r in range(size)]
    assert dist.all_gather_object("x" * (rank * 3000)) == ["x" * (r * 3000) for r in range(size)]
    got = dist.scatter([torch.ones(r + 1) for r in range(size)] if rank == 0 else None)
    assert got.numel() == rank + 1


@contextlib.contextmanager
def _counting_checks():
    seen: list[int] = []
    real = _check.run
    _check.run = lambda comm, public, fields, must, seq: seen.append(seq)
    try:
        yield seen
    finally:
        _check.run = real


@ranks(2, 3)
def test_the_first_calls_at_each_site_are_checked_then_a_sample_by_call_number():
    from distkit.dist._comm import resolve

    facts = resolve(None, "all_reduce")._facts
    t = torch.ones(1)
    with _counting_checks() as seen:
        start = facts.seq
        for _ in range(1500):
            dist.all_reduce(t)  # the lean lane
        for _ in range(600):
            dist.all_reduce(t, op="max")  # the checked path
    lane = [start + i for i in range(1, 4)]
    lane += [s for s in range(start + 4, start + 1501) if _check.sampled(s)]
    checked = [start + 1501 + i for i in range(3)]
    checked += [s for s in range(start + 1504, start + 2101) if _check.sampled(s)]
    assert seen == lane + checked
    assert dist.all_gather_object(seen) == [seen] * dist.get_world_size()  # the same calls


@ranks(2)
def test_the_default_check_can_be_turned_off():
    _settings.set("check", False)
    with _counting_checks() as seen:
        dist.all_reduce(torch.ones(1))
        dist.all_reduce(torch.ones(1), op="max")
    assert seen == []


def test_the_sample_takes_one_call_in_1024_and_every_position_of_a_loop():
    chosen = [s for s in range(1, 1 << 20) if _check.sampled(s)]
    assert abs(len(chosen) - (1 << 20) / _check.SAMPLE) < 0.05 * (1 << 20) / _check.SAMPLE
    for period in range(2, 17):  # a loop of `period` collectives: every one is sampled
        assert {s % period for s in chosen[:2000]} == set(range(period)), period


ONE_SIDED = """
import torch, distkit.dist as dist
dist.init_dist()
x = torch.ones(4)
for step in range(8):
    dist.all_reduce(x)
    if dist.get_rank() == 0 and step == 5:
        dist.broadcast(torch.ones(3), src=0)  # rank 0 only: a new line there, an old one here
print("not reached", flush=True)
"""


def test_a_check_only_one_rank_makes_still_raises_on_every_rank(tmp_path):
    """Rank 0 checks its new call site; rank 1, at a line it has seen often, runs its call
    unchecked and blocks in gloo. Its watchdog answers the check for it: rank 0 raises,
    and rank 1 prints the mismatch at once and raises it when rank 0 has gone."""
    proc = _launch(tmp_path, ONE_SIDED)
    err = proc.stderr
    assert proc.returncode == 1, err
    assert "not reached" not in proc.stdout
    assert "rank 1 is blocked in all_reduce, which does not match the call of other ranks" in err
    assert "CollectiveMismatchError: broadcast: the ranks of the default group disagree" in err
    assert "CollectiveMismatchError: all_reduce: the ranks of the default group disagree" in err
    assert "rank 0: broadcast(data={'dtype': 'float32', 'shape': [3]}, src=0) at " in err
    assert "rank 1: all_reduce(data={'dtype': 'float32', 'shape': [4]}, op=sum) at " in err
    assert "Connection closed" not in err.split("distkit launch:")[-1]


# -- a stuck collective ---------------------------------------------------------------


@ranks(2, timeout=40)
def test_a_stuck_collective_is_reported_once_and_the_run_goes_on():
    rank, _ = world()
    _settings.set("stuck_after", 1.0)
    dist.all_reduce(torch.ones(1))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # the watchdog writes to this process's stderr
        if rank == 1:
            time.sleep(4)  # busy: not in any collective
        out = dist.all_reduce(torch.ones(2))
        time.sleep(0.6)  # a late second report would arrive by now
    assert out.tolist() == [2.0, 2.0]
    text = err.getvalue()
    if rank == 0:
        assert text.count("distkit: rank") == 1, text
        assert "distkit: rank 0 has waited 1 s in all_reduce (its call #" in text, text
        assert "rank 1 has not arrived: it is at tests/test_safe_default.py:" in text, text
        assert "not in a distkit collective" in text
        assert "if the missing ranks arrive, the run goes on" in text
    else:
        assert text == ""


@ranks(2, timeout=40)
def test_the_stuck_report_can_be_turned_off():
    rank, _ = world()
    _settings.set("stuck_after", 0.0)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        if rank == 1:
            time.sleep(2)
        dist.all_reduce(torch.ones(2))
    assert err.getvalue() == ""


SLOW_RANK = """
import time, torch, distkit.dist as dist
dist.init_dist({launcher!r})
dist.all_reduce(torch.ones(1))
if dist.get_rank() == 1:
    time.sleep(4)
total = dist.all_reduce(torch.ones(1)).item()
print(f"sum {{total}}", flush=True)  # one write: the ranks share the pipe
dist.destroy_dist()
"""


def _slurm_env(rank: int, port: int) -> dict:
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": str(rank),
        "SLURM_STEP_ID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "127.0.0.[1]",
        "SLURM_TASKS_PER_NODE": "2",
        "MASTER_PORT": str(port),
    }


@pytest.mark.parametrize("launcher", ["distkit launch", "torchrun", "srun"])
def test_the_stuck_report_works_under_every_launcher(launcher, tmp_path):
    import subprocess

    from conftest import ROOT
    from helpers_subprocess import free_port

    env = {"DISTKIT_STUCK_AFTER": "1"}
    if launcher == "distkit launch":
        proc = _launch(tmp_path, SLOW_RANK.format(launcher="auto"), **env)
        out, err = proc.stdout, proc.stderr
        assert proc.returncode == 0, err
    elif launcher == "torchrun":
        proc = torchrun(2, _script(tmp_path, SLOW_RANK.format(launcher="auto")), **env)
        out, err = proc.stdout, proc.stderr
    else:
        script, port = _script(tmp_path, SLOW_RANK.format(launcher="slurm")), free_port()
        procs = [
            subprocess.Popen(
                [sys.executable, script],
                cwd=ROOT,
                env=script_env(**env, **_slurm_env(rank, port)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in (0, 1)
        ]
        outs = [p.communicate(timeout=90) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        out, err = "".join(o for o, _ in outs), "".join(e for _, e in outs)
    assert out.count("sum 2.0") == 2, (out, err)
    assert err.count("distkit: rank 0 has waited") == 1, err
    assert "rank 1 has not arrived: it is at " in err and "script.py:6 in <module>" in err, err


# -- a rank that went away --------------------------------------------------------------

EXITS_EARLY = """
import sys, torch, distkit.dist as dist
dist.init_dist()
for step in range({steps}):
    if dist.get_rank() == 1 and step == {leave}:
        {how}
    dist.all_reduce(torch.ones(4))
"""


@pytest.mark.parametrize(
    ("steps", "leave", "how", "said"),
    [
        (1, 0, "sys.exit(0)", "rank 1 exited (code 0)"),
        (6, 5, "sys.exit(0)", "rank 1 exited (code 0)"),
        (6, 5, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "rank 1 was killed by "),
    ],
    ids=["checked-call", "unchecked-call", "killed"],
)
def test_a_rank_that_went_away_is_named(steps, leave, how, said, tmp_path):
    proc = _launch(tmp_path, EXITS_EARLY.format(steps=steps, leave=leave, how=how))
    err = proc.stderr
    assert proc.returncode == 1, err
    assert "RankGoneError: all_reduce: " + said in err, err
    assert "while rank 0 waited in all_reduce at " in err and "script.py:7 in <module>" in err
    if steps > 3:  # past the checked calls: the backend saw it first, and says so after
        assert ". The backend said: " in err and "by peer" in err.split("The backend said")[-1]
