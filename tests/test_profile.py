"""The communication profile: who makes the others wait, and at which line.

Every rank's rows are checked (they must be the same list everywhere), the blame is
measured against a straggler whose delays are known, and the trace is read back.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import ROOT, in_fresh_world, modern_compile, world
from helpers_subprocess import script_env

import distkit.dist as dist
from distkit import _registry
from distkit.dist.guard import record as _record
from distkit.testing import ranks

pytestmark = pytest.mark.timeout(120)


def _line() -> int:
    return sys._getframe(1).f_lineno


def _row(rows, op: str, line: int):
    found = [r for r in rows if r.op == op and r.site.endswith(f"test_profile.py:{line}")]
    assert len(found) == 1, rows
    return found[0]


def _same_everywhere(rows) -> None:
    """The rows are one list on every rank (a function of every rank's records)."""
    every = dist.all_gather_object(rows)
    assert all(other == every[0] for other in every), every


@ranks(2)
def test_a_straggler_is_blamed_at_its_line():
    rank, _ = world()
    x = torch.ones(4)
    with dist.profile() as prof:
        for i in range(100):
            if rank == 1 and i % 10 == 0:
                time.sleep(0.05)  # rank 1 is 50 ms late for every 10th call
            dist.all_reduce(x)
            slow = _line() - 1
        for _ in range(20):
            dist.broadcast(x, src=0)  # on time: nobody to blame
            punctual = _line() - 1
    _same_everywhere(prof.rows)
    row = _row(prof.rows, "all_reduce", slow)
    assert (row.calls, row.bytes) == (100, 100 * 16)
    assert set(row.late) == {0, 1}
    # 10 x 50 ms, plus what the load adds (1.4 s seen with the suite on 4 workers beside
    # other work on 2 cores): the floor is what the test is about
    assert 0.45 <= row.late[1] <= 3.0, row
    # the blame is rank 1's: rank 0's own lateness is scheduling noise (63 ms over the 100
    # calls seen in CI's suite against rank 1's 544; 161 against 532 with the suite and
    # two busy loops on 2 cores)
    assert row.late[1] >= 2 * row.late[0], row
    assert row.seconds >= 0.2, row  # rank 0 waited inside the calls (half the average)
    other = _row(prof.rows, "broadcast", punctual)
    assert other.calls == 20
    assert sum(other.late.values()) < 0.1 * row.late[1], other


def _late_evaluate(x):
    time.sleep(0.1)  # rank 1 evaluates more slowly, and calls from here
    dist.all_reduce(x)
    return _line() - 1


@ranks(2, 3)
def test_a_rank_that_calls_from_another_line_is_blamed_at_its_own():
    """The row took the lowest rank's call site: rank 1, late in its own function,
    was blamed at rank 0's line, which it never ran."""
    rank, size = world()
    x = torch.ones(2)
    with dist.profile() as prof:
        for _ in range(3):
            if rank == 1:
                late_at = _late_evaluate(x)
            else:
                dist.all_reduce(x)
                waits_at = _line() - 1
    _same_everywhere(prof.rows)
    sites = dist.all_gather_object(late_at if rank == 1 else waits_at)
    late = _row(prof.rows, "all_reduce", sites[1])
    assert (late.calls, late.bytes, set(late.late)) == (3, 3 * 8, {1}), late
    assert late.late[1] >= 0.25, late
    waited = _row(prof.rows, "all_reduce", sites[0])
    assert (waited.calls, set(waited.late)) == (3, {r for r in range(size) if r != 1}), waited
    assert sum(waited.late.values()) < 0.5 * late.late[1], waited
    assert waited.seconds >= 0.25, waited  # they waited inside, at their own line


@ranks(0)
def test_a_single_process_records_every_kind_of_call():
    x = torch.ones(3)
    with dist.profile() as prof:
        dist.all_reduce(x, op="max")
        reduce_at = _line() - 1
        dist.all_reduce(x)  # the shortcut's own case: it must take the recorded path
        plain_at = _line() - 1
        dist.all_gather_object({"a": 1})
        object_at = _line() - 1
        dist.all_reduce_dict({"loss": torch.ones(2, dtype=torch.float64)})
        dict_at = _line() - 1
        dist.collect_results(["a", "b"], 2)
        collect_at = _line() - 1
        dist.barrier()
        barrier_at = _line() - 1
    assert _row(prof.rows, "all_reduce", reduce_at).bytes == 12
    assert _row(prof.rows, "all_reduce", plain_at).calls == 1
    assert _row(prof.rows, "all_gather_object", object_at).calls == 1
    assert _row(prof.rows, "all_reduce_dict", dict_at).bytes == 16
    assert _row(prof.rows, "collect_results", collect_at).calls == 1
    assert _row(prof.rows, "barrier", barrier_at).calls == 1
    assert len(prof.rows) == 6, prof.rows  # a helper's inner calls are its own call
    assert all(row.late == {0: 0.0} for row in prof.rows)
    # closed: the shortcuts are back to the no-op, and nothing more is recorded
    assert _record.active is None and not _registry.diverted
    assert dist.all_reduce(x) is x
    assert len(prof.records) == 6


@ranks(0, 2)
def test_an_exception_in_the_block_merges_nothing_and_keeps_the_records():
    x = torch.ones(2)
    with pytest.raises(ValueError, match="from the loop"):
        with dist.profile() as prof:
            dist.all_reduce(x)
            raise ValueError("from the loop")
    assert prof.rows is None
    assert [(e.op, e.seq > 0 or dist.get_world_size() == 1) for e in prof.records] == [
        ("all_reduce", True)
    ]
    assert dist.all_reduce(torch.ones(1)).item() == dist.get_world_size()  # no one hangs
    with dist.profile():  # and a new profile opens
        pass


@ranks(3)
def test_sub_groups_are_attributed_to_their_own_ranks():
    from distkit.utils import get_group

    rank, _ = world()
    get_group([1, 2])  # created by every rank (torch's new_group is collective)
    with dist.profile() as prof:
        if rank in (1, 2):
            dist.all_reduce(torch.ones(2), group=[1, 2])
        pair_at = _line() - 1
        dist.all_reduce(torch.ones(2))
        world_at = _line() - 1
    _same_everywhere(prof.rows)
    assert set(_row(prof.rows, "all_reduce", pair_at).late) == {1, 2}
    assert set(_row(prof.rows, "all_reduce", world_at).late) == {0, 1, 2}
    assert _row(prof.rows, "all_reduce", pair_at).calls == 1


def _mesh_dimensions_are_attributed_to_their_own_ranks():
    from torch.distributed.device_mesh import init_device_mesh

    rank, _ = world()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for group in (mesh["tp"], (mesh, "dp")):  # a group's first call sets it up: not timed
        dist.all_reduce(torch.ones(2), group=group)
    with dist.profile() as prof:
        if rank // 2 == 1:  # the second row of the mesh is late: ranks 2 and 3
            time.sleep(0.2)
        dist.all_reduce(torch.ones(2), group=mesh["tp"])  # rows: [0, 1] and [2, 3]
        tp_at = _line() - 1
        dist.all_reduce(torch.ones(2), group=(mesh, "dp"))  # columns: [0, 2] and [1, 3]
        dp_at = _line() - 1
    _same_everywhere(prof.rows)
    tp, dp = _row(prof.rows, "all_reduce", tp_at), _row(prof.rows, "all_reduce", dp_at)
    assert (tp.calls, dp.calls) == (2, 2)  # one call per group of each dimension
    # within a row of the mesh both ranks arrive together: nobody is late at tp_at;
    # the late row shows up within each column, at dp_at
    assert set(tp.late) == set(dp.late) == {0, 1, 2, 3}
    assert sum(tp.late.values()) < 0.1, tp
    assert tp.late[2] < 0.1 and tp.late[3] < 0.1, tp
    assert dp.late[0] < 0.05 and dp.late[1] < 0.05, dp
    assert 0.15 <= dp.late[2] <= 0.6 and 0.15 <= dp.late[3] <= 0.6, dp


def test_mesh_dimensions_are_attributed_to_their_own_ranks():
    in_fresh_world(_mesh_dimensions_are_attributed_to_their_own_ranks, 4, timeout=120)


@ranks(2)
def test_a_profile_of_a_sub_group():
    from distkit.utils import get_group

    rank, _ = world()
    get_group([0])  # created by every rank (torch's new_group is collective)
    if rank == 1:
        return  # rank 1 is not in the profile's group
    with dist.profile(group=[0]) as prof:
        dist.all_reduce(torch.ones(1), group=[0])
    assert [r.late for r in prof.rows] == [{0: 0.0}]


@ranks(2)
def test_the_chrome_trace_has_a_track_per_rank_and_a_slice_per_call(tmp_path):
    path = tmp_path / "trace.json"
    with dist.profile(trace=str(path)):
        for _ in range(3):
            dist.all_reduce(torch.ones(2))
            at = _line() - 1
    dist.barrier()
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert tracks == {0: "rank 0", 1: "rank 1"}
    calls = [e for e in events if e["ph"] == "X"]
    assert len(calls) == 6
    assert {e["name"] for e in calls} == {f"all_reduce tests/test_profile.py:{at}"}
    for r in (0, 1):
        mine = sorted((e for e in calls if e["pid"] == r), key=lambda e: e["ts"])
        assert [e["args"]["call"] for e in mine] == sorted(e["args"]["call"] for e in mine)
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in mine)


@ranks(0)
def test_profiles_do_not_nest():
    with dist.profile():
        with pytest.raises(RuntimeError, match="profiles do not nest"):
            with dist.profile():
                pass


SCRIPT = """
    import torch, distkit.dist as dist
    dist.init_dist()
    for _ in range(5):
        dist.all_reduce(torch.ones(2))
    {end}
"""


def test_a_whole_run_under_distkit_launch_profile(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(SCRIPT.format(end="dist.destroy_dist()")))
    trace = tmp_path / "trace.json"
    args = ["-m", "distkit", "launch", "-n", "2", "--profile", str(trace), str(script)]
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    assert "where ranks waited for each other" in proc.stderr
    assert "run.py:5" in proc.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    assert sorted(e["pid"] for e in events if e["ph"] == "X") == [0] * 5 + [1] * 5


def test_a_single_process_run_without_destroy_dist_is_reported_at_exit(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(SCRIPT.format(end="")))
    trace = tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=script_env(DISTKIT_PROFILE=str(trace)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "run.py:5" in proc.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    assert len([e for e in events if e["ph"] == "X"]) == 5


# -- what an adversarial review tried -------------------------------------------------------


@modern_compile
@ranks(0)
def test_a_compiled_function_runs_in_a_profile_unrecorded():
    @torch.compile(backend="eager", fullgraph=True)
    def step(x):
        return dist.all_reduce(x * 2) + 1

    with dist.profile() as prof:
        assert step(torch.ones(2)).tolist() == [3.0, 3.0]
    assert prof.rows == []


@ranks(2)
def test_calls_from_another_thread_are_their_own_calls():
    import threading

    from distkit.utils import get_group

    side = get_group([0, 1], timeout=60)  # the thread's own group: one group, one thread
    x = torch.ones(2)

    def worker():
        for _ in range(20):
            dist.all_reduce(x, group=side)

    with dist.profile() as prof:
        thread = threading.Thread(target=worker)
        thread.start()
        for _ in range(20):
            dist.all_reduce_dict({"a": torch.ones(1)})
        thread.join()
    _same_everywhere(prof.rows)
    assert sorted((r.op, r.calls) for r in prof.rows) == [
        ("all_reduce", 20),
        ("all_reduce_dict", 20),
    ]


@ranks(2)
def test_a_call_with_nothing_to_reduce_counts_once():
    # its one message (the check that every rank passed the same tensors) is not a call
    with dist.profile() as prof:
        dist.all_reduce_params([])
    assert [(r.op, r.calls, sorted(r.late)) for r in prof.rows] == [
        ("all_reduce_params", 1, [0, 1])
    ]


@ranks(3)
def test_calls_reaching_outside_the_profiles_group_are_not_recorded():
    from distkit.utils import get_group

    rank, _ = world()
    get_group([0, 1])  # created by every rank (torch's new_group is collective)
    if rank == 2:
        dist.all_reduce(torch.ones(1))
        return
    with dist.profile(group=[0, 1]) as prof:
        dist.all_reduce(torch.ones(1))  # the world's: rank 2 records nothing
        dist.all_reduce(torch.ones(1), group=[0, 1])
        pair_at = _line() - 1
    assert [(r.op, r.site, set(r.late)) for r in prof.rows] == [
        ("all_reduce", f"tests/test_profile.py:{pair_at}", {0, 1})
    ]


@ranks(2)
def test_a_rank_that_left_with_an_exception_is_named_not_mixed_up():
    rank, _ = world()
    merge: Exception | None = None
    try:
        with dist.profile():
            dist.all_reduce(torch.ones(1))
            if rank == 1:
                raise KeyError("rank 1 fails")
    except KeyError:
        pass
    except Exception as exc:  # rank 0's merge
        merge = exc
    if rank == 1:  # its next collective meets rank 0's merge: the default check says so
        with pytest.raises(dist.CollectiveMismatchError, match="rank 0: profile"):
            dist.all_gather_object({"user": rank})
    else:
        assert isinstance(merge, dist.CollectiveMismatchError), merge
        assert "rank 1: all_gather_object" in str(merge)
    assert dist.all_reduce(torch.ones(1)).item() == 2  # and the group goes on


@ranks(2)
def test_rows_agree_when_the_ranks_work_in_different_directories(tmp_path):
    import os

    rank, _ = world()
    here = os.getcwd()
    os.chdir(tmp_path if rank == 1 else here)
    try:
        with dist.profile() as prof:
            dist.all_reduce(torch.ones(1))
    finally:
        os.chdir(here)
    _same_everywhere(prof.rows)


@ranks(0)
def test_a_profile_used_again_forgets_the_last_rows():
    prof = dist.profile()
    with prof:
        dist.all_reduce(torch.ones(1))
    assert prof.rows
    with pytest.raises(ValueError):
        with prof:
            raise ValueError
    assert prof.rows is None and prof.records == []
