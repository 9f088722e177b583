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
import re
import signal
import sys
import textwrap
import time
from typing import Any

import pytest
import torch
from conftest import debug_mode, in_fresh_world, mismatch, modern_compile, world
from helpers_subprocess import script_env, torchrun

import distkit.dist as dist
from distkit import _registry, _settings
from distkit.dist.guard import check as _check
from distkit.testing import ranks
from distkit.utils import get_group

pytestmark = pytest.mark.timeout(120)

# -- a launcher, but no process group ------------------------------------------------

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SRUN = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}
MPIRUN = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "MASTER_",
    "SLURM_",
    "OMPI_",
    "PMI_",
    "DISTKIT_INDEPENDENT",
    "DISTKIT_RANK_PID",
)


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


# with fullgraph=True, dynamo before 2.13 replaces the error with its own "Observed
# exception", and distkit does not trace there (docs/modern-torch.md)
@pytest.mark.parametrize(
    "fullgraph",
    [
        pytest.param(True, marks=modern_compile, id="fullgraph"),
        pytest.param(False, id="graph-breaks"),
    ],
)
def test_a_compiled_first_collective_refuses_to_run_alone_under_a_launcher(fullgraph, launched_by):
    """Met first by torch.compile's tracer, the decision is asked while tracing (once, as
    a constant of the graph) and not kept: the eager call after it decides (with graph
    breaks, torch has already run the frame eagerly after the traced error)."""
    import torch._dynamo

    launched_by(TORCHRUN)
    torch._dynamo.reset()
    step = torch.compile(lambda t: dist.all_reduce(t * 2), backend="eager", fullgraph=fullgraph)
    with pytest.raises(Exception) as info:  # fullgraph: torch wraps the RuntimeError
        step(torch.ones(2))
    assert "no process group exists, but torchrun (or another launcher)" in str(info.value)
    assert (_registry.alone is None) == fullgraph
    with pytest.raises(RuntimeError, match="no process group exists"):
        dist.all_reduce(torch.ones(2))
    assert _registry.alone is not None and "torchrun" in _registry.alone
    torch._dynamo.reset()


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


def test_a_process_a_rank_started_is_no_rank(launched_by, monkeypatch):
    """A subprocess of a rank (or a DataLoader worker) inherits the launcher's variables;
    the rank left its pid beside them, so the child is not taken for a rank."""
    launched_by(TORCHRUN)
    monkeypatch.setenv("DISTKIT_RANK_PID", "1")  # a pid that is not this process's
    t = torch.ones(2)
    assert dist.all_reduce(t) is t


def test_a_rank_list_under_a_launcher_gets_the_launcher_message(launched_by):
    launched_by(TORCHRUN)
    with pytest.raises(RuntimeError, match="no process group exists, but torchrun"):
        dist.all_reduce(torch.ones(1), group=[0, 1])


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
    # each rank must reach its own error: on a loaded machine the ranks import torch
    # seconds apart, more than the launcher's 3 s before it stops the others
    proc = _launch(tmp_path, NOINIT, DISTKIT_STOP_GRACE="60")
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


@ranks(2, 3, timeout=30)
def test_arguments_refused_on_one_rank_raise_on_every_rank_and_keep_them_in_step():
    """Refused on that rank alone before any communication, the others waited in the
    call and paired it with that rank's next call when the caller went on: another
    call's data, no error (a timeout on the old code). Where the default check looks
    (the first calls at each call site) and in debug mode, that rank takes its part.
    Tensor and object collectives alike."""
    rank, size = world()
    last = size - 1
    t = torch.ones(2)
    cases = [  # one case per line: each its own call site, checked by default
        (lambda: dist.all_reduce(None if rank == last else t.clone()), TypeError, "data must be"),
        (lambda: dist.reduce(t.clone(), dst=size if rank == last else 0), ValueError, "dst="),
        (lambda: dist.reduce_scatter(t.repeat(size), op="max" if rank else "x"), ValueError, "op"),
        (lambda: dist.all_to_all([t] * (size + (rank == last))), ValueError, "tensors"),
        (lambda: dist.broadcast_object(rank, src=size if rank == last else 0), ValueError, "src="),
        (lambda: dist.gather_object(rank, dst=None if rank == last else 0), TypeError, "dst"),
    ]
    for debug in (False, True):
        with debug_mode() if debug else contextlib.nullcontext():
            for i, (call, kind, says) in enumerate(cases):
                refusing = 0 if i == 2 else last
                with pytest.raises(Exception) as info:
                    call()
                text = str(info.value)
                if rank == refusing:  # its own error, as in a single process
                    assert type(info.value) is kind and says in text, text
                    assert f"(on rank {rank} of {size})" in text, text
                else:
                    assert type(info.value) is dist.CollectiveMismatchError, text
                    assert f"refused={kind.__name__}: " in text and says in text, text
                    assert f"Rank {refusing} refused its arguments to this call" in text
                # in step: the next call gets every rank's own data, on every rank
                assert dist.all_reduce(torch.full((1,), rank + 1.0)).item() == sum(
                    range(1, size + 1)
                )
    # every rank refusing the same arguments: each raises its own error; four checks of
    # one call number in a row (each refused call gives its number back), every rank
    # finding the same attempt's key each time
    for call in (
        lambda: dist.broadcast(t.clone(), src=7),
        lambda: dist.reduce(t.clone(), dst=-1),
        lambda: dist.all_to_all([t] * (size + 1)),
        lambda: dist.gather_object(rank, dst=size),
    ):
        with pytest.raises(ValueError, match=r"out of range|must hold"):
            call()
    assert dist.all_reduce(torch.ones(1)).item() == size


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
    from distkit.dist._route import resolve

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
    assert "distkit: rank 1 is in all_reduce (its call #7 on the default group) at " in err
    assert "and rank 0 checked that call: they disagree" in err
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


@ranks(3, timeout=40)
def test_a_slow_rank_while_a_sender_went_on_is_reported_as_late():
    """A gather's senders finish before a slow rank comes: rank 1 passes the call while
    rank 0 waits for rank 2 (the first stuck reports said the ranks "disagree" on it),
    then waits in an async call's handle (reported, as in that call)."""
    rank, _ = world()
    _settings.set("stuck_after", 1.0)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # the watchdog writes to this process's stderr
        for step in range(_check.VISITS + 2):  # the last, past the default check's sample
            if rank == 2 and step == _check.VISITS + 1:
                time.sleep(3.5)  # busy: not in any collective
            dist.gather(torch.ones(2), dst=0, same_shape=True)  # (senders send, and go)
            if rank == 1:
                dist.all_reduce(torch.ones(1), async_op=True).wait()
            else:
                dist.all_reduce(torch.ones(1))
        time.sleep(0.6)  # a late report would arrive by now
    text = err.getvalue()
    assert "ranks disagree" not in text and "finished this call" not in text, text
    if rank == 0:
        assert "rank 1 has passed this call: it waits in all_reduce (its call #" in text, text
        assert "rank 2 has not arrived: it is at tests/test_safe_default.py:" in text, text
    if rank == 1:  # its handle's wait: in the call, and reported as such
        assert re.search(r"has waited \d s in all_reduce \(its call #", text), text
        assert re.search(r"rank 0 waits in gather .*: a call this rank has passed", text), text


def _stuck_with_another_dst(async_op: bool = False):
    """Every rank arrives at a gather that rank 1 calls with another dst, at a line run
    past the default check's visits (a call out of its sample): they wait for each other
    until the group's timeout. ``async_op``: each rank waits for the gather's handle."""
    rank, _ = world()
    _settings.set("stuck_after", 1.0)
    err = io.StringIO()
    outcome = None
    with contextlib.redirect_stderr(err):  # the watchdog writes to this process's stderr
        for call in range(_check.VISITS + 2):
            odd = rank == 1 and call == _check.VISITS + 1
            try:
                if async_op:
                    dist.gather(torch.ones(2), dst=1 if odd else 0, async_op=True).wait()
                else:
                    dist.gather(torch.ones(2), dst=1 if odd else 0)
            except dist.CollectiveMismatchError as exc:
                outcome = (call, str(exc))
                break
    return outcome, err.getvalue()


def _stuck_in_a_handle_with_another_dst():
    return _stuck_with_another_dst(async_op=True)


@pytest.mark.parametrize("waited", ["blocking", "handle"])
def test_a_stuck_call_the_ranks_disagree_on_is_named_and_raised_at_the_timeout(waited):
    """Before, the stuck report said every rank "waits in this call too" and the timeout
    said the same (or that the other rank never came): nothing named the dst. A call
    made with ``async_op=True`` and stuck in its handle's wait was not reported at all."""
    start = time.monotonic()
    body = _stuck_with_another_dst if waited == "blocking" else _stuck_in_a_handle_with_another_dst
    results = in_fresh_world(body, 2, timeout=60.0, pg_timeout=6.0)
    assert time.monotonic() - start < 40
    reports = [text for _, text in results if "has waited" in text]
    assert len(reports) == 1, results  # one rank reports, once
    report = reports[0]
    assert "waits in this call too" in report, report
    assert "Every rank is in this call, and they disagree on it, so it cannot complete" in report
    assert "found by distkit's stuck report" in report and "They must agree on: dst." in report
    assert "if the missing ranks arrive" not in report, report
    for rank, (outcome, _) in enumerate(results):  # each raises it at the timeout
        assert outcome is not None, f"rank {rank} raised no CollectiveMismatchError"
        call, said = outcome
        assert call == _check.VISITS + 1, (rank, said)
        assert "(found by distkit's stuck report, at call #" in said, said
        assert f"on the group; on rank {rank})" in said, said
        assert re.search(r"rank 0: gather\(.*dst=0.*\n  rank 1: gather\(.*dst=1", said), said
        assert "They must agree on: dst." in said, said


def _one_rank_passes_a_gather_with_another_dst(stuck_after: float):
    """Of three ranks, rank 2 calls a gather with another dst past the default check's
    visits: rank 1 only sends, finishes the call and waits in the next one; ranks 0 and
    2 wait in it."""
    rank, _ = world()
    _settings.set("stuck_after", stuck_after)
    err = io.StringIO()
    outcome: Any = None
    with contextlib.redirect_stderr(err):  # the watchdog writes to this process's stderr
        try:
            for call in range(_check.VISITS + 3):
                odd = rank == 2 and call == _check.VISITS + 1
                dist.gather(torch.ones(2), dst=1 if odd else 0)
        except (dist.CollectiveMismatchError, dist.CollectiveTimeoutError) as exc:
            outcome = (type(exc).__name__, str(exc), getattr(exc, "missing", None))
    return outcome, err.getvalue()


def _passes_with_the_stuck_report():
    return _one_rank_passes_a_gather_with_another_dst(1.0)


def _passes_without_the_stuck_report():
    return _one_rank_passes_a_gather_with_another_dst(0.0)


def test_a_rank_that_finished_a_call_the_others_wait_in_is_not_said_to_be_missing():
    """Before, with three ranks, rank 1 (past the call) was said to be "not the same call"
    and to have "never arrived", and nothing named the dst (the check ran only when every
    rank waited in the call)."""
    results = in_fresh_world(_passes_with_the_stuck_report, 3, timeout=60.0, pg_timeout=6.0)
    reports = [results[r][1] for r in (0, 2) if "has waited" in results[r][1]]
    assert len(reports) == 1, results  # rank 0 or 2 reports the gather, once
    report = reports[0]
    assert "rank 1 has passed this call: it waits in gather (its call #" in report, report
    assert "The ranks still in this call disagree on it, so it cannot complete" in report
    assert re.search(r"rank 0: gather\(.*dst=0.*\n  rank 2: gather\(.*dst=1", report), report
    for rank in (0, 2):  # each raises it at the timeout
        kind, said, _ = results[rank][0]
        assert kind == "CollectiveMismatchError", (rank, said)
        assert "They must agree on: dst." in said, said
        assert "Rank 1 finished this call while the others still wait in it" in said, said
    assert results[1][0][0] == "CollectiveTimeoutError", results[1]
    passed = results[1][1]  # rank 1's report of its next call
    assert re.search(r"has waited \d+ s in gather", passed), passed
    said = r"rank 0 waits in gather \(its call #\d+ on this group\) at .*: a call this rank"
    assert re.search(said + " has passed", passed), passed

    # with the stuck report off, the timeouts say the same of each other
    results = in_fresh_world(_passes_without_the_stuck_report, 3, timeout=60.0, pg_timeout=6.0)
    for rank in (0, 2):
        kind, said, missing = results[rank][0]
        assert kind == "CollectiveTimeoutError", (rank, said)
        assert "never arrived" not in said, said
        assert "Rank(s) 1 finished this call and went on, while this rank still" in said, said
        assert "  rank 1 is waiting in gather (its call #" in said, said
        assert missing == [1], said
    kind, said, missing = results[1][0]
    # its own timeout, or the others' first: gloo closes the connections of a rank whose
    # wait timed out, and the call fails on the ranks still waiting with it
    assert kind == "CollectiveTimeoutError", said
    assert re.search("gather (timed out|failed) on rank 1", said), said
    assert "This rank finished the call rank(s) 0, 2 still wait in" in said, said
    assert missing == [0, 2], said


def _one_rank_times_out_first():
    """Rank 0's group times out in 2 s, rank 1's in 60: rank 0 times out alone in an
    all_reduce, and gloo closes its connections; rank 1 then makes the call and lives."""
    import datetime

    import torch.distributed as td

    rank, _ = world()
    _settings.set("check", False)  # straight to gloo (the default check would meet first)
    seconds = 2 if rank == 0 else 60
    group = td.new_group([0, 1], timeout=datetime.timedelta(seconds=seconds))
    try:
        if rank == 0:
            with pytest.raises(dist.CollectiveTimeoutError):
                dist.all_reduce(torch.ones(2), group=group)
            time.sleep(5)  # still here, answering roll calls
            return None
        time.sleep(3.5)
        try:
            dist.all_reduce(torch.ones(2), group=group)
        except Exception as exc:
            return type(exc).__name__, str(exc)
        return None
    finally:
        td.destroy_process_group(group)


def test_a_call_whose_connection_a_rank_that_timed_out_closed_is_not_said_to_have_lost_it():
    """Before, rank 1 raised RankGoneError "a rank went away": rank 0 was still there."""
    results = in_fresh_world(_one_rank_times_out_first, 2, timeout=60.0)
    kind, said = results[1]
    assert kind == "CollectiveTimeoutError", said
    assert "all_reduce failed on rank 1 (rank 1 of group [0, 1]) (its call #1 on this " in said
    assert "another rank of the group, still there, closed its connection (as gloo does " in said
    assert "went away" not in said, said


def _one_rank_skips_a_group():
    rank, _ = world()
    _settings.set("stuck_after", 1.0)
    dist.barrier()  # a rank answers roll calls from its first distkit collective on
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # the stuck report goes to this process's stderr
        try:
            if rank == 0:
                get_group([0, 1], timeout=30)  # rank 1 never creates it
            else:
                time.sleep(8)  # busy, in no distkit call: it may yet come, so no error
        except Exception as exc:
            return type(exc).__name__, str(exc), err.getvalue()
    return None, "", err.getvalue()


def test_a_group_one_rank_never_creates_is_reported_and_named_at_the_timeout():
    """Rank 0 waited in torch's group creation with no report, until the timeout. (A
    rank that waits in a collective instead is raised on at once: test_utils.py.)"""
    (kind, said, report), (other, _, _) = in_fresh_world(
        _one_rank_skips_a_group, 2, timeout=60.0, pg_timeout=5.0
    )
    assert kind == "CollectiveTimeoutError", said
    assert said.startswith("get_group timed out on rank 0 in get_group([0, 1]) (the world's"), said
    assert "rank 1 never came to create a group" in said, said
    assert "Every rank must create every group, in the same order" in said, said
    assert "distkit: rank 0 has waited 1 s in get_group([0, 1])" in report, report
    assert "rank 1 is at tests/test_safe_default.py:" in report, report
    assert "not in a distkit call" in report, report
    assert other is None  # rank 1 was never waiting


@ranks(2, timeout=40)
def test_a_destroyed_sub_group_does_not_silence_the_watchdog():
    """A sub-group destroyed before any roll call read its ranks made the watchdog's
    answer fail (torch forgets a destroyed group's ranks), and the watchdog took that for
    a dead store: the rank never answered again, so stuck reports said "did not answer"
    and checks waited for the timeout."""
    import torch.distributed as td

    rank, _ = world()
    _settings.set("stuck_after", 1.0)
    group = get_group([0, 1], timeout=20)  # a group of its own (not the world)
    dist.all_reduce(torch.ones(1), group=group)
    td.destroy_process_group(group)  # still referenced here: its facts stay
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        if rank == 1:
            time.sleep(3)
        dist.all_reduce(torch.ones(1))
        time.sleep(0.5)
    if rank == 0:
        text = err.getvalue()
        assert "rank 1 has not arrived: it is at tests/test_safe_default.py:" in text, text
    del group


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


@pytest.mark.parametrize(
    ("variable", "value", "command"),
    [
        ("DISTKIT_STUCK_AFTER", "nan", ["-c", "import distkit.dist as d; d.all_reduce"]),
        ("DISTKIT_STUCK_AFTER", "-1", ["-c", "import distkit.dist as d; d.all_reduce"]),
        ("DISTKIT_STOP_GRACE", "abc", ["-m", "distkit", "launch", "-n", "2", "-m", "json.tool"]),
    ],
)
def test_a_bad_number_of_seconds_in_the_environment_is_an_error(variable, value, command):
    """Not a silent fallback (a typo hides), nor nan (no deadline would ever pass)."""
    import subprocess

    from conftest import ROOT

    proc = subprocess.run(
        [sys.executable, *command],
        cwd=ROOT,
        env=script_env(**{variable: value}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0, proc
    said = f"{variable}={value!r} is not a number of seconds (zero or more)"
    assert said in proc.stderr, proc.stderr


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
        # "(code 0)": the launcher's exit code, which follows the rank's own note (on a
        # loaded machine it may come after the waiting rank has stopped waiting for it)
        (1, 0, "sys.exit(0)", r"rank 1 exited( \(code 0\))? "),
        (6, 5, "sys.exit(0)", r"rank 1 exited( \(code 0\))? "),
        (6, 5, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "rank 1 was killed by "),
    ],
    ids=["checked-call", "unchecked-call", "killed"],
)
def test_a_rank_that_went_away_is_named(steps, leave, how, said, tmp_path):
    proc = _launch(tmp_path, EXITS_EARLY.format(steps=steps, leave=leave, how=how))
    err = proc.stderr
    assert proc.returncode == 1, err
    if "terminate called without an active exception" in err:
        # older torch (seen on 2.4) can abort a process that exits with a live gloo
        # thread: it was then killed by SIGABRT, and that is what distkit must say
        said = "rank 1 was killed by signal 6"
    assert re.search("RankGoneError: all_reduce: " + said, err), err
    assert "while rank 0 waited in all_reduce at " in err and "script.py:7 in <module>" in err
    if steps > 3:  # past the checked calls: the backend saw it first, and says so after
        assert ". The backend said: " in err and "by peer" in err.split("The backend said")[-1]


PEER_EXITED_BEFORE_THE_MESSAGE = """
import os, sys, time, torch, torch.distributed as td, distkit.dist as dist
dist.init_dist()
FORMS = {
    "send": lambda g: dist.send(torch.ones(3), 2, group=g),
    "send, a large tensor": lambda g: dist.send(torch.ones(1 << 20), 2, group=g),
    "send, an object": lambda g: dist.send({"a": 1}, 2, group=g),
    "isend": lambda g: dist.isend(torch.ones(3), 2, group=g).wait(),
    "recv": lambda g: dist.recv(2, group=g),
    "irecv": lambda g: dist.irecv(2, group=g).wait(),
    "exchange": lambda g: dist.exchange({2: torch.ones(2)}, [2], group=g),
    "exchange, receiving": lambda g: dist.exchange({}, [2], group=g),
}
groups = {form: td.new_group([0, 1, 2]) for form in FORMS}
pid = dist.all_gather_object(os.getpid())[2]
if dist.get_rank() == 2:
    sys.exit(0)
if dist.get_rank() == 1:  # a message from rank 0 once rank 2 is gone: the group works
    print("rank 1 got", dist.recv(0, group=groups["send"]).tolist())
    sys.exit(0)
while os.path.exists(f"/proc/{pid}"):  # gone: gloo refuses to post a message to it
    with open(f"/proc/{pid}/stat") as f:
        if f.read().split()[2] == "Z":
            break
    time.sleep(0.01)
for form, call in FORMS.items():
    try:
        call(groups[form])
        print(form, "returned")
    except dist.RankGoneError as exc:
        print(form, "|", str(exc).split(". The backend said")[0])
dist.send(torch.full((2,), 7.0), 1, group=groups["send"])
"""


def test_a_message_to_or_from_a_rank_that_exited_names_it(tmp_path):
    # gloo refuses to post it (the connection is closed): that error came raw, without
    # the rank, how it left or the line; the ranks still there go on exchanging messages
    proc = _launch(tmp_path, PEER_EXITED_BEFORE_THE_MESSAGE, n=3)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "rank 1 got [7.0, 7.0]" in lines, proc.stdout
    said = dict(line.split(" | ") for line in lines if not line.startswith("rank 1 got"))
    assert len(said) == 8, proc.stdout
    for form, text in said.items():
        public = form.split(",")[0]
        way = "recv message #1 from" if "rec" in form else "send message #1 to"
        # older torch (seen on 2.4) can abort a process that exits with a live gloo
        # thread: distkit must then say it was killed by signal 6
        assert re.match(rf"{public}: rank 2 (exited|was killed by signal 6)", text), (form, text)
        assert f"while rank 0 waited to {way} it (tag 0) at " in text, (form, text)
        assert "script.py:" in text, (form, text)


# -- found by an adversarial review: each failed before its fix --------------------------


@ranks(2, 3)
def test_all_to_all_single_splits_and_rows_are_checked():
    rank, size = world()
    # rank 1 expects 2 rows from rank 0, which sends it 1 (garbage, or gloo aborting)
    sent = [2] * size
    expected = [2] * size
    if rank == 0:
        sent[1] = 1
    data = torch.arange(float(sum(sent)))
    text = mismatch(lambda: dist.all_to_all_single(data, expected, sent), debug=False)
    assert "rank 1 expects 2 rows from rank 0, which sends it 1" in text
    # rows of 2 floats on one rank, 3 on another
    rows = torch.ones(2 * size, 2 + rank % 2)
    text = mismatch(lambda: dist.all_to_all_single(rows), debug=False)
    assert "They must agree on: data.rows." in text


@ranks(2)
@pytest.mark.parametrize(
    "dtypes",
    [(torch.float8_e4m3fn, torch.float8_e5m2), (torch.int16, torch.uint16)],
    ids=["float8", "int16-uint16"],
)
def test_dtypes_gloo_carries_as_others_are_checked_as_themselves(dtypes):
    """gloo moves these as bytes or in a wider dtype: the check sees the caller's."""
    rank, _ = world()
    x = torch.zeros(4).to(dtypes[rank])
    text = mismatch(lambda: dist.broadcast(x), debug=False)
    assert "They must agree on: data.dtype." in text
    wide = torch.tensor([5, 7], dtype=torch.uint64 if rank == 0 else torch.int64)
    text = mismatch(lambda: dist.all_reduce(wide, op="max"), debug=False)
    assert "'dtype': 'uint64'" in text and "'dtype': 'int64'" in text


@ranks(2, timeout=30)
def test_an_async_call_from_another_line_passes():
    """Rank 1's fourth call comes from a new line (checked); rank 0's, from an old one,
    is in flight while rank 0 waits on its handle: its watchdog answers for it."""
    rank, size = world()
    start = time.monotonic()
    for i in range(4):
        if rank == 1 and i == 3:
            handle = dist.all_reduce(torch.ones(2), async_op=True)
        else:
            handle = dist.all_reduce(torch.ones(2), async_op=True)
        assert handle.wait().tolist() == [size, size]
    assert time.monotonic() - start < 10


@ranks(2, timeout=60)
def test_a_caught_one_sided_mismatch_leaves_the_ranks_in_step():
    """Rank 0's refused call takes no call number: its next call meets the one rank 1
    is blocked in, and the checks of later calls (the sample) still meet."""
    rank, size = world()
    x = torch.ones(4)
    caught = 0
    for step in range(1700):  # past the first sampled call numbers (610, 1597)
        assert dist.all_reduce(x.clone()).tolist() == [size] * 4
        if rank == 0 and step == 5:
            with (
                contextlib.suppress(dist.CollectiveMismatchError),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                dist.broadcast(torch.ones(3))  # rank 0 only: a new line, checked
                caught = -1  # not reached
            caught += 1
    assert caught == (1 if rank == 0 else 0)


def test_a_rank_falling_back_to_eager_under_compile_passes():
    """One rank recompiles until torch.compile gives up and runs the function eagerly,
    while the other runs the compiled graph: the group's collectives are traced, so the
    default check leaves them alone (the eager call would wait for a partner that never
    checks). In a world of its own: its ranks' call numbers drift apart on purpose."""
    if not hasattr(torch.compiler, "is_compiling"):
        pytest.skip("needs torch.compile")
    in_fresh_world(_fall_back_to_eager, 2, timeout=60)


def _fall_back_to_eager():
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    old = getattr(config, name)
    setattr(config, name, 2)
    try:
        rank, size = world()

        @torch.compile(dynamic=False, backend="eager")
        def step(x):
            return dist.all_reduce(x.sum().reshape(1)) * 2

        for i in range(5):
            n = 4 if rank == 1 else 4 + i  # rank 0: a new shape each step
            expected = 2 * (4 * (size - 1) + 4 + i) if rank == 0 else None
            out = step(torch.ones(n))
            assert expected is None or out.item() == expected
        assert dist.all_reduce(torch.ones(2)).tolist() == [size, size]
    finally:
        setattr(config, name, old)
        torch._dynamo.reset()


LATE_RANK = """
import os, time, torch, distkit.dist as dist
from distkit import _settings
_settings.set("hang_grace", 1.0)
dist.init_dist(timeout=60)
r = dist.get_rank()
def old(x):
    return dist.all_reduce(x)
for i in range(5):
    old(torch.ones(4))
if r == 0:
    y = dist.all_reduce(torch.ones(4))  # a new line: checked
elif r == 1:
    y = old(torch.ones(4))  # an old line: unchecked, blocked in gloo
else:
    time.sleep(3)  # late, past several roll calls, and with another length
    y = old(torch.ones(5))
print(f"rank {r}: NO ERROR {y.tolist()}", flush=True)
"""


def test_a_late_rank_with_another_length_is_caught_at_a_one_sided_check(tmp_path):
    """Rank 1's watchdog takes its part once only: its part counted twice once stood in
    for the late rank's, and ranks 0 and 1 went on to garbage."""
    proc = _launch(tmp_path, LATE_RANK, n=3)
    assert proc.returncode == 1, proc.stderr
    assert "NO ERROR" not in proc.stdout, proc.stdout
    assert "rank 2: all_reduce(data={'dtype': 'float32', 'shape': [5]}" in proc.stderr
    assert "CollectiveMismatchError: all_reduce: the ranks of the default group" in proc.stderr


SKIPPED_ON_A_SUBGROUP = """
import torch, distkit.dist as dist
from distkit.utils import get_group
dist.init_dist(timeout=120)
r = dist.get_rank()
g = get_group([0, 1])
if r == 0:
    dist.all_reduce(torch.ones(2), group=g)  # rank 1 skips this
dist.barrier()
"""


def test_a_collective_skipped_on_a_subgroup_is_a_deadlock_named_at_once(tmp_path):
    start = time.monotonic()
    proc = _launch(tmp_path, SKIPPED_ON_A_SUBGROUP, n=3)
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - start < 60, "waited for the timeout"
    err = proc.stderr
    assert "CollectiveMismatchError: all_reduce: rank 1 waits in barrier on group [0, 1, 2]" in err
    assert "which needs this rank, while this rank waits for rank 1 here" in err
    assert "timed out" not in err


IRECV_WAITED_AFTER_A_COLLECTIVE = """
import torch, distkit.dist as dist
dist.init_dist(timeout=120)
if dist.get_rank() == 0:
    dist.send(torch.arange(1000.0), 1)  # over a new channel's 4 KiB frame: two messages
    dist.send({"t": torch.ones(3000)}, 1)  # queued behind it on the receiver
    dist.all_reduce(torch.ones(2))
else:
    first, second = dist.irecv(0), dist.irecv(0)  # the first frame posted, no more
    dist.all_reduce(torch.ones(2))  # its check posts the rest: rank 0 sends it now
    assert torch.equal(first.wait(), torch.arange(1000.0))
    assert torch.equal(second.wait()["t"], torch.ones(3000))
print(f"rank {dist.get_rank()} done", flush=True)
"""


def _runs_through(tmp_path, source: str, within: float, why: str) -> None:
    """``source`` on 2 ranks ends well on both, within ``within`` seconds, with no stuck
    report."""
    start = time.monotonic()
    proc = _launch(tmp_path, source)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout, proc.stdout
    assert time.monotonic() - start < within, why
    assert "has waited" not in proc.stderr, proc.stderr


def test_an_irecv_waited_for_after_a_collective_with_its_sender_does_not_hang(tmp_path):
    _runs_through(tmp_path, IRECV_WAITED_AFTER_A_COLLECTIVE, 60, "waited for the stuck report")


IRECV_AT_EVERY_CALL = """
import time, torch, distkit.dist as dist
dist.init_dist(timeout=60)
r = dist.get_rank()
# each message larger than the channel's last ones (the rest of its frame follows), the
# last a tensor past the inline limit (its bytes apart), and an object with a tensor
for i, n in enumerate([1000, 3000, 9000, 27000, 81000, 243000, 1_500_000]):
    if r == 0:
        dist.send(torch.arange(float(n)), 1)  # blocking: done once rank 1 posted it all
        dist.send({"i": i, "t": torch.full((n,), i)}, 1)
        dist.all_reduce(torch.ones(2))  # one call site: checked 3 times, then not
    else:
        a, b = dist.irecv(0), dist.irecv(0)
        dist.all_reduce(torch.ones(2))
        assert torch.equal(a.wait(), torch.arange(float(n)))
        got = b.wait()
        assert got["i"] == i and torch.equal(got["t"], torch.full((n,), i))
print(f"rank {r} done", flush=True)
"""


def test_irecvs_waited_for_after_a_collective_with_their_sender_pass_at_every_call(tmp_path):
    # past the default check's first calls at the site, and with messages each larger
    # than the last: torch's irecv runs this; distkit's once hung at the fourth call
    _runs_through(tmp_path, IRECV_AT_EVERY_CALL, 45, "waited for the stuck report or a timeout")


IRECV_NEVER_RECEIVED = """
import torch, torch.distributed as td, distkit.dist as dist
td.init_process_group("gloo")  # torch's own: nothing of distkit's runs at the exit
r = dist.get_rank()
handle = dist.irecv(1 - r, tag=r)  # never sent (rank 0's too), never waited for
print(f"rank {r} done", flush=True)
# both reach the exit together (through the store: no collective), however loaded the
# machine: a rank 2 s later than the other found its irecv failed by the other's exit
from distkit._compat import default_store
store = default_store()
store.set(f"exit{r}", "1")
store.wait([f"exit{1 - r}"])
if r == 1:  # its irecv can never be sent now, and the exit says so
    td.destroy_process_group()
"""


def test_an_exit_with_an_irecv_never_received_names_it_and_exits_cleanly(tmp_path):
    # each rank's helper thread waits inside gloo: woken by the other's exit while the
    # interpreter finalizes, it would abort the process ("terminate called without an
    # active exception": 4 runs of 4 under torchrun with rank 1's alone; every run with
    # both when both waited 2 s); the exit waits while Python is whole, the higher rank
    # longer (see distkit.dist.backends.p2p)
    proc = torchrun(2, _script(tmp_path, IRECV_NEVER_RECEIVED), timeout=90)
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout, proc.stdout
    assert "terminate called" not in proc.stderr, proc.stderr
    # each waits for the other (rank 0 leaves first); rank 1 destroyed its group first
    for me, peer, awaited in (
        (0, 1, "waiting up to 2 s for rank 1 to send it or exit. Wait for every irecv"),
        (
            1,
            0,
            "its group was destroyed, so it never will; waiting up to 12 s for rank 0 to "
            "exit. Wait for every irecv before destroy_dist",
        ),
    ):
        assert (
            f"distkit: rank {me} exits while its irecv of message #1 from rank {peer} "
            f"(tag {me}) has not received it; {awaited}"
        ) in proc.stderr, proc.stderr


SERVED_IN_THREE = """
import time, torch, distkit.dist as dist
from distkit.utils import get_group
dist.init_dist(timeout=120)
r = dist.get_rank()
pair = get_group([0, 1])
big = torch.arange(100000.0)
for group, p2p in ((None, None), (pair, None), (None, pair)):
    if r == 2:
        if group is None:
            dist.all_reduce(torch.ones(2))  # first: its check asks, not rank 0's
        continue
    time.sleep(0.3)
    if r == 1:
        dist.send(big, 0, group=p2p)
        dist.all_reduce(torch.ones(2), group=group)
    else:
        h = dist.irecv(1, group=p2p)
        dist.all_reduce(torch.ones(2), group=group)
        assert torch.equal(h.wait(), big)
print(f"rank {r} done", flush=True)
"""


def test_an_irecv_is_served_by_a_rank_that_did_not_ask_and_across_groups(tmp_path):
    """Three ranks: rank 2 reaches the world's check first (its check asks where the
    others are), and the send and the collective are on the world, on a pair, or the
    other way round; rank 0, waiting too, serves its irecv every time."""
    start = time.monotonic()
    proc = _launch(tmp_path, SERVED_IN_THREE, n=3)
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1, 2):
        assert f"rank {rank} done" in proc.stdout, proc.stdout
    assert time.monotonic() - start < 60, "waited for the stuck report"


SEND_NOBODY_RECEIVES = """
import torch, distkit.dist as dist
dist.init_dist(timeout=120)
if dist.get_rank() == 0:
    dist.send(torch.ones(4), 1)  # rank 1 never receives it
dist.all_reduce(torch.ones(2))
print("NO ERROR", flush=True)
"""


def test_a_send_met_by_a_collective_is_a_deadlock_named_at_once(tmp_path):
    start = time.monotonic()
    # rank 0's own error comes once rank 1 has gone: give it the time on a loaded machine
    proc = _launch(tmp_path, SEND_NOBODY_RECEIVES, DISTKIT_STOP_GRACE="30")
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - start < 60, "waited for the timeout"
    assert "NO ERROR" not in proc.stdout, proc.stdout
    err = proc.stderr
    site = f"{tmp_path / 'script.py'}:5 in <module>"
    assert "CollectiveMismatchError: all_reduce: rank 0 waits in send with rank 1 (tag 0)" in err
    assert f"at {site}, while this rank waits for rank 0 here" in err
    assert "on rank 1). Each send needs its receive before the two ranks' next collective" in err
    # rank 0 reads how rank 1 left as far as it got: failed with its error, exited (with
    # its code, when the launcher's note came first), or, on older torch (seen on 2.4),
    # killed by signal 6 (it can abort a process that exits with a live gloo thread)
    gone = r"RankGoneError: send: rank 1 (failed with Collective|exited|was killed by signal 6)"
    assert re.search(gone, err), err
    assert "timed out" not in err


SEND_WAITED_IN_A_THREAD = """
import threading, time, torch, distkit.dist as dist
dist.init_dist(timeout=60)
if dist.get_rank() == 1:
    h = dist.isend(torch.arange(10.0), 0)
    waiter = threading.Thread(target=h.wait)  # waits in the send until rank 0 receives
    waiter.start()
    time.sleep(1.5)  # meanwhile rank 0 waits in the check of all_reduce and asks
    y = dist.all_reduce(torch.ones(2))
    waiter.join()
else:
    y = dist.all_reduce(torch.ones(2))
    assert torch.equal(dist.recv(1), torch.arange(10.0))
print(f"rank {dist.get_rank()} done {y.tolist()}", flush=True)
"""


def test_a_send_waited_for_in_another_thread_is_no_deadlock(tmp_path):
    """The main thread of rank 1 still comes to the collective: not a deadlock."""
    proc = _launch(tmp_path, SEND_WAITED_IN_A_THREAD)
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        assert f"rank {rank} done [2.0, 2.0]" in proc.stdout, proc.stdout


ASYMMETRIC = """
import torch, distkit.dist as dist
dist.init_dist(timeout=2)
r = dist.get_rank()
for i in range(4):
    if r == 0 and i == 3:
        y = dist.all_reduce(torch.ones(2))  # a new line: checked on rank 0 only
    else:
        y = dist.all_reduce(torch.ones(2))
print(f"rank {r} ok", flush=True)
"""


def test_a_one_sided_check_fits_in_a_short_timeout(tmp_path):
    proc = _launch(tmp_path, ASYMMETRIC)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout, proc.stdout


TWIN = "import distkit.dist as dist\n\n\ndef sync(x):\n    return dist.all_reduce(x)\n"
TWINS = """
import sys, torch, distkit.dist as dist
sys.path.insert(0, {folder!r})
import twin_a, twin_b
dist.init_dist(timeout=60)
for i in range(3):
    twin_a.sync(torch.ones(4))
twin_b.sync(torch.ones(4 + dist.get_rank()))  # its first call: another file, same code
"""


def test_the_same_code_in_two_files_is_two_call_sites(tmp_path):
    for name in ("twin_a", "twin_b"):
        (tmp_path / f"{name}.py").write_text(TWIN)
    proc = _launch(tmp_path, TWINS.format(folder=str(tmp_path)))
    assert proc.returncode == 1, proc.stderr
    assert "They must agree on: data.shape." in proc.stderr
    assert "terminate called" not in proc.stderr


STORE_ON_RANK_0 = """
import os, sys, time, torch, distkit.dist as dist
dist.init_dist()
r = dist.get_rank()
def step():
    return dist.all_reduce(torch.ones(2))
for i in range(5):
    step()
if os.environ["CASE"] == "ends":
    if r == 1:
        time.sleep(2)  # rank 0, which hosts the store, has gone meanwhile
    print(f"rank {r} done", flush=True)
    sys.exit(0)
if r == 0:
    time.sleep(0.5)
    sys.exit(0)
dist.all_reduce(torch.ones(2))  # a new line: checked, on a store that went with rank 0
"""


def _by_hand(tmp_path, source: str, n: int = 2, **env: str) -> tuple[list, list]:
    """Start ``n`` ranks of ``source`` by hand under ``env://``, as srun or mpirun would
    (no launcher watches them; rank 0 hosts the store); their exit codes and outputs."""
    import subprocess

    from conftest import ROOT
    from helpers_subprocess import free_port

    script, port = _script(tmp_path, source), free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, script],
            cwd=ROOT,
            env=script_env(
                **env,
                RANK=str(rank),
                WORLD_SIZE=str(n),
                LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(n)
    ]
    try:
        outs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outs


@pytest.mark.parametrize("case", ["ends", "leaves"])
def test_a_world_whose_store_rank_0_hosts(case, tmp_path):
    """Under env:// without a launcher's agent (srun, mpirun), rank 0 hosts the store:
    when it exits, a rank left waiting names it, and one that just finishes says nothing
    (the watchdog stops asking a store whose host left)."""
    codes, outs = _by_hand(tmp_path, STORE_ON_RANK_0, CASE=case)
    if case == "ends":
        assert codes == [0, 0], outs
        assert "TCPStore" not in outs[1][1] and "Broken pipe" not in outs[1][1], outs[1][1]
    else:
        assert codes == [0, 1], outs
        assert "RankGoneError: all_reduce: rank 0 " in outs[1][1], outs[1][1]


KILLED_WITHOUT_A_LAUNCHER = """
import os, signal, sys, time, torch, distkit.dist as dist
dist.init_dist()  # torch's timeout: 30 minutes
r = dist.get_rank()
dist.barrier()  # every rank is past init_dist
for step in range({steps}):
    if r == 2 and step == {leave}:
        time.sleep({late})
        print(f"died at {{time.time()}}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer does
    try:
        dist.all_reduce(torch.ones(2))
    except dist.RankGoneError as exc:
        print(f"raised at {{time.time()}}:", str(exc).split(" while ")[0], flush=True)
        sys.exit(3)
"""


@pytest.mark.parametrize(
    ("steps", "leave", "late"),
    [(1, 0, 0), (1, 0, 8), (6, 5, 0)],
    ids=["checked", "checked-after-a-long-wait", "unchecked"],
)
def test_a_rank_killed_without_a_launcher_is_named_at_once(steps, leave, late, tmp_path):
    # nobody notes the exit code of a rank srun or mpirun started: the ranks waiting for
    # it in a checked call (which meets on the store, not in the backend) waited for the
    # world's timeout. The kernel knows its process is gone; it is looked for every
    # second, however long the wait has lasted (not at the roll calls, 8 s apart by then)
    source = KILLED_WITHOUT_A_LAUNCHER.format(steps=steps, leave=leave, late=late)
    codes, outs = _by_hand(tmp_path, source, 3)
    assert codes == [3, 3, -signal.SIGKILL], outs
    died = float(outs[2][0].split("died at ")[1])
    for out, _ in outs[:2]:
        raised, said = out.split("raised at ")[1].split(": ", 1)
        assert said.startswith("all_reduce: rank 2 died: its process (pid "), out
        assert "on this machine) is gone and left no exit note" in said, out
        if late:  # named 7.5 s after the death before (its roll calls were 8 s apart)
            assert float(raised) - died < 5.0, out


SIGNAL_IN_A_CHECK = """
import signal, sys, time, torch, distkit.dist as dist
dist.init_dist()
dist.barrier()  # every rank is past init_dist
if dist.get_rank() == 1:
    time.sleep(3)  # late: rank 0 waits for it in the check of its first call
else:
    def alarm(*_):
        raise TimeoutError("the caller's own timeout")
    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(1)
    try:
        dist.all_reduce(torch.ones(2))
        print("rank 0 returned", flush=True)
    except TimeoutError as exc:
        print("rank 0 raised", exc, flush=True)
    sys.exit(3)
dist.all_reduce(torch.ones(2))
"""


def test_an_error_a_signal_handler_raises_in_a_check_is_the_callers(tmp_path):
    # a check's wait took any error for a failure of the store: it went on unchecked,
    # and its rank no longer checked calls the others still check (a deadlock at the next)
    codes, outs = _by_hand(tmp_path, SIGNAL_IN_A_CHECK)
    assert outs[0][0] == "rank 0 raised the caller's own timeout\n", outs
    assert codes[0] == 3 and "RankGoneError: all_reduce: rank 0 " in outs[1][1], outs


HOST_GOES_IN_A_GROUP = """
import os, signal, time, torch, distkit.dist as dist
from distkit.utils import get_group
dist.init_dist()
r = dist.get_rank()
dist.barrier()  # every rank is past init_dist
if r == 0:
    os.kill(os.getpid(), signal.SIGKILL)  # it hosts the store (env:// alone)
time.sleep(2 * (r == 1))  # rank 2 waits for rank 1 in the creation when the store goes
try:
    get_group([1, 2])
except dist.RankGoneError as exc:
    print(str(exc).split(" while ")[0], flush=True)
"""


def test_a_group_creation_that_loses_the_store_names_its_host(tmp_path):
    codes, outs = _by_hand(tmp_path, HOST_GOES_IN_A_GROUP, 3)
    assert codes[0] == -signal.SIGKILL, outs
    for out, err in outs[1:]:  # not torch's own "Broken pipe", with its C++ frames
        said = "get_group: rank 0 is gone, and the store it hosted with it\n"
        assert out == said and "torch.distributed.DistNetworkError" not in err, (out, err)


class _World:
    """What a board reads of its default group."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2


#: A process whose main thread ended while another thread runs: its main thread reads as
#: a zombie
MAIN_THREAD_ENDS = (
    "import ctypes, threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
    "time.sleep(0.2); ctypes.CDLL(None).pthread_exit(None)"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rank_is_found_gone_by_its_process_only_when_it_is():
    # a rank's process running, sleeping or stopped (a debugger) is there; a zombie or a
    # reaped one is not; a record an earlier run left on a reused store, or one of
    # another machine, tells nothing
    import subprocess

    from torch.distributed import HashStore

    from distkit.dist.guard import board as _board

    board = _board.Board(_World(), HashStore(), 1)
    procs = []

    def start(*command: str) -> tuple[int, dict]:
        proc = subprocess.Popen(command)
        procs.append(proc)
        with open(f"/proc/{proc.pid}/stat") as f:
            began = f.read().rsplit(")", 1)[1].split()[19]
        posted = _board._since_boot()
        return proc, {**_board._process(), "pid": proc.pid, "start": began, "posted": posted}

    def seen(record: dict, **change: Any) -> Any:
        board.procs.clear()
        board.post(board.key("proc", 1), {**record, **change})
        return board.exits([1]).get(1)

    try:
        proc, record = start("sleep", "60")
        gone = {"how": "vanished", "pid": proc.pid}
        assert seen(record) is None
        proc.send_signal(signal.SIGSTOP)
        assert seen(record) is None
        assert seen(record, start=str(int(record["start"]) + 1)) == gone  # its pid, reused
        proc.kill()
        time.sleep(0.2)  # a zombie: not reaped yet
        assert seen(record) == gone
        proc.wait()
        assert seen(record) == gone
        assert seen(record, boot="another machine") is None
        assert seen(record, posted=0.0) is None  # before this process began: an earlier run's
        board.post(board.key("proc", 1), record)  # ... not kept: the rank's own is read
        assert board.exits([1]) == {1: gone}
        assert _board.describe_exit(1, gone).startswith(
            f"rank 1 died: its process (pid {proc.pid}, on this machine) is gone"
        )
        threads, record = start(sys.executable, "-c", MAIN_THREAD_ENDS)
        time.sleep(1.0)
        with open(f"/proc/{threads.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] == "Z"
        assert seen(record) is None
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


# -- a forked child of a rank ------------------------------------------------------------


def _in_a_fork(call: Any) -> str:
    """Run ``call`` in a child this process forks: the repr of what it returned, or the
    error it raised (``"Type: message"``), or ``"timed out"`` after 20 s."""
    import os
    import select

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into the pool's code
        os.close(read)
        try:
            said = repr(call())
        except BaseException as exc:  # what the child met, whatever it was
            said = f"{type(exc).__name__}: {exc}"
        os.write(write, said.encode()[:60000])  # fits the pipe: the parent reads it after
        os._exit(0)
    os.close(write)
    try:
        if not select.select([read], [], [], 20)[0]:
            os.kill(pid, signal.SIGKILL)
            return "timed out"
        chunks = []
        while chunk := os.read(read, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)


@ranks(2, 3, timeout=90)
def test_a_forked_child_of_a_rank_cannot_join_its_parents_collectives():
    # A child forked after init_dist (os.fork, a fork-started DataLoader worker or
    # multiprocessing.Process) shares its parent's connections: a collective there waited
    # for the group's timeout (30 minutes by default), and a send could put its bytes on
    # the parent's connection. It raises at once, naming the parent, and the parent's
    # world goes on.
    import os

    rank, size = world()
    peer = (rank + 1) % size
    calls = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(3)),  # the lean lane's case
        "all_gather": lambda: dist.all_gather(torch.ones(2, dtype=torch.int16)),
        "broadcast_object": lambda: dist.broadcast_object({"step": 1}),
        "barrier": dist.barrier,
        "send": lambda: dist.send(torch.ones(1), dst=peer),
        "world group by ranks": lambda: dist.all_reduce(torch.ones(1), group=list(range(size))),
        # a group no rank has made yet: creating one is a collective of the whole world
        "a new group": lambda: get_group(range(size), timeout=123.0),
    }
    for name, call in calls.items():
        started = time.monotonic()
        said = _in_a_fork(call)
        assert time.monotonic() - started < 10, (name, said)
        assert said.startswith("RuntimeError: "), (name, said)
        assert f"forked from rank {rank} (pid {os.getpid()})" in said, (name, said)
        assert "Run collectives in the rank itself" in said, (name, said)
    # what needs no communication answers as the parent would
    assert _in_a_fork(world) == repr((rank, size))
    # an async call in flight at the fork: its wait in the child raises, the parent's works
    handle = dist.all_reduce(torch.full((4,), rank + 1.0), async_op=True)
    said = _in_a_fork(handle.wait)
    assert said.startswith("RuntimeError: all_reduce: this process was forked"), said
    assert handle.wait().tolist() == [size * (size + 1) / 2] * 4
    # the parents' world goes on, every rank's result checked
    assert dist.all_gather_object(rank) == list(range(size))
    assert dist.all_reduce(torch.ones(1)).item() == size


FORKED_EXITS = """
import os, sys, time
import torch
import torch.distributed as td

td.init_process_group("gloo")  # torch's own: distkit's collectives not loaded yet
import distkit.dist as dist
from distkit.utils import get_group

rank = td.get_rank()
child = os.fork()
if child == 0:
    import signal
    signal.alarm(60)  # a child that hangs (distkit failing this test) ends, not lingers
    for call in (lambda: dist.all_reduce(torch.ones(1)), lambda: get_group([0, 1], timeout=9.0)):
        started = time.monotonic()
        try:
            call()
            print("child: no error")
        except RuntimeError as exc:
            print(f"child: {time.monotonic() - started:.1f} s: {exc}")
    sys.exit(3)  # a real exit: atexit hooks and all
_, status = os.waitpid(child, 0)
print("child exit", os.waitstatus_to_exitcode(status))
print("parents", dist.all_gather_object(rank), dist.all_reduce(torch.ones(1)).item())
"""


def test_a_forked_child_that_exits_is_not_taken_for_its_rank(tmp_path):
    # A world made by torch, distkit imported but not used before the fork: the child was
    # not told it is one (distkit's fork hooks came with its modules) and waited. A child
    # that made a group ended in a board of its own, whose exit note said "rank 0 exited"
    # and ended the parents' world.
    codes, outs = _by_hand(tmp_path, FORKED_EXITS)
    assert codes == [0, 0], outs
    for rank, (out, err) in enumerate(outs):
        said = [line for line in out.splitlines() if line.startswith("child: ")]
        assert len(said) == 2, (out, err)
        for line in said:
            seconds = float(line.split()[1])
            assert seconds < 5 and f"forked from rank {rank} (pid " in line, line
        assert "child exit 3" in out, (out, err)
        assert "parents [0, 1] 2.0" in out, (out, err)
