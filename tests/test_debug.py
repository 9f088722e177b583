"""Hang diagnostics: the debug mode's mismatch catalogue, and timeouts that name ranks."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import debug_mode, mismatch, world

import distkit.dist as dist
from distkit import _settings
from distkit.testing import ranks
from distkit.utils import get_group


@ranks(2, 3)
def test_debug_different_op_on_one_rank():
    rank, _ = world()
    text = mismatch(lambda: dist.all_reduce(torch.ones(2), op="max" if rank == 1 else "sum"))
    assert "rank 1: all_reduce(data={'dtype': 'float32', 'shape': [2]}, op=max)" in text
    assert "They must agree on: op" in text


@ranks(2, 3)
def test_debug_a_rank_skips_a_collective():
    rank, _ = world()

    def call():
        if rank == 1:
            dist.barrier()  # rank 1 skipped the all_reduce the others are in
        else:
            dist.all_reduce(torch.ones(1))

    text = mismatch(call)
    assert "rank 1: barrier() at tests/test_debug.py" in text
    assert "a rank\nthat skips one" in text or "that skips one" in text


@ranks(2, 3)
def test_debug_different_dtypes():
    rank, _ = world()
    dtype = torch.float64 if rank == 1 else torch.float32
    text = mismatch(lambda: dist.all_reduce(torch.ones(2, dtype=dtype)))
    assert "'dtype': 'float64'" in text and "They must agree on: data.dtype" in text


@ranks(2, 3)
def test_debug_shapes_that_must_match():
    rank, _ = world()
    text = mismatch(lambda: dist.all_reduce(torch.ones(rank + 1)))
    assert "They must agree on: data.shape" in text
    text = mismatch(lambda: dist.broadcast(torch.ones(rank + 2)))
    assert "broadcast(" in text


@ranks(2, 3)
def test_debug_same_shape_promises_that_do_not_hold():
    rank, _ = world()
    text = mismatch(lambda: dist.gather(torch.ones(rank + 1), same_shape=True))
    assert "gather(data=" in text and "They must agree on: data.shape" in text
    text = mismatch(lambda: dist.all_gather(torch.ones(rank + 1), same_shape=True))
    assert "They must agree on: data.shape" in text


@ranks(2, 3)
def test_debug_different_src_and_dst():
    rank, _ = world()
    text = mismatch(lambda: dist.broadcast(torch.ones(1), src=rank % 2))
    assert "They must agree on: src" in text
    text = mismatch(lambda: dist.gather_object(rank, dst=0 if rank else 1))
    assert "gather_object(dst=1" in text and "They must agree on: dst" in text


@ranks(1, 2, 3)
def test_debug_mode_accepts_what_may_legitimately_differ():
    rank, size = world()
    with debug_mode():
        out = dist.all_gather(torch.ones(rank + 1))  # uneven shapes are allowed here
        assert [t.numel() for t in out] == [r + 1 for r in range(size)]
        rows = dist.all_to_all([torch.ones(rank + d + 1) for d in range(size)])
        assert [t.numel() for t in rows] == [rank + s + 1 for s in range(size)]
        got = dist.scatter([torch.ones(r + 1) for r in range(size)] if rank == 0 else None)
        assert got.numel() == rank + 1
        assert dist.all_gather_object("x" * (rank * 5000)) == [
            "x" * (r * 5000) for r in range(size)
        ]
        stats = dist.all_reduce_dict({"loss": torch.tensor(1.0), "n": torch.tensor(2)})
        assert stats["n"].item() == 2 * size
        assert dist.collect_results([rank], size, dst=None) == list(range(size))


@ranks(3, timeout=60)
def test_timeout_names_the_ranks_that_never_arrived():
    rank, _ = world()
    _settings.set("hang_grace", 2.0)
    first = get_group([0, 1], timeout=2)  # creating groups is collective: every rank
    second = get_group([1, 2], timeout=2)
    if rank == 0:  # waits for rank 1 on [0, 1]
        with pytest.raises(dist.CollectiveTimeoutError) as info:
            dist.all_reduce(torch.ones(1), group=first)
        text = str(info.value)
        assert "all_reduce timed out on rank 0 (rank 0 of group [0, 1])" in text
        assert "Rank(s) 1 never arrived at this call" in text
        assert (
            "rank 1 is waiting in all_reduce (its call #1 on group [1, 2]) at tests/test_debug.py"
            in text
        )
        assert info.value.missing == [1]
        assert "The backend said:" in text
    elif rank == 1:  # skipped [0, 1]; waits for rank 2 on [1, 2]
        with pytest.raises(dist.CollectiveTimeoutError) as info:
            dist.all_reduce(torch.ones(1), group=second)
        text = str(info.value)
        # ranks are named by their global rank, their place in the group beside it
        assert "all_reduce timed out on rank 1 (rank 0 of group [1, 2])" in text
        assert "rank 2 posted nothing within 2 s: it is not waiting in a distkit collective" in text
    else:  # rank 2 never comes
        time.sleep(5)
    dist.barrier()  # the default group was never involved: it still works


def test_debug_mode_from_the_environment():
    from helpers_subprocess import run

    code = "import distkit.dist as d; print(d.get_debug())"
    assert run(["-c", code], DISTKIT_DEBUG="1").stdout.strip() == "True"
    assert run(["-c", code]).stdout.strip() == "False"


# -- timeouts on sub-groups, and a second timeout in the same world -------------------


def _hang_on_subgroups() -> str:
    """Rank 0 waits on [0, 1], rank 1 on [1, 2], rank 2 never comes; groups have no
    timeout of their own, so they take the world's (4 s)."""
    rank = dist.get_rank()
    _settings.set("hang_grace", 3.0)
    first, second = get_group([0, 1]), get_group([1, 2])
    start = time.monotonic()
    if rank == 2:
        time.sleep(10)
        return ""
    with pytest.raises(dist.CollectiveTimeoutError) as info:
        dist.all_reduce(torch.ones(1), group=first if rank == 0 else second)
    assert time.monotonic() - start < 15, "the sub-group waited longer than the world's timeout"
    return str(info.value)


def _second_timeout() -> str:
    """After one timeout, a second one must not read the first one's posts."""
    rank = dist.get_rank()
    _settings.set("hang_grace", 2.0)
    first, second = get_group([0, 1]), get_group([1, 2])
    again = get_group([0, 1], timeout=4)  # fresh connections for the second hang
    if rank == 0:  # first hang: rank 1 waits in a barrier elsewhere
        with pytest.raises(dist.CollectiveTimeoutError):
            dist.all_reduce(torch.ones(1), group=first)
    elif rank == 1:
        with pytest.raises(dist.CollectiveTimeoutError):
            dist.barrier(second)
    else:
        time.sleep(7)
    if rank == 0:  # second hang: rank 1 is busy, in no collective at all
        with pytest.raises(dist.CollectiveTimeoutError) as info:
            dist.broadcast(torch.ones(1), group=again)
        return str(info.value)
    time.sleep(10)
    return ""


@pytest.fixture
def short_world():
    from distkit.local.pool import RankPool

    pool = RankPool(3, timeout=60, pg_timeout=4)
    yield pool
    pool.close()


def test_subgroups_take_the_worlds_timeout_and_name_where_ranks_wait(short_world):
    texts = short_world.run(_hang_on_subgroups)
    assert "rank 1 is waiting in all_reduce (its call #1 on group [1, 2])" in texts[0]
    assert "rank 2 posted nothing" in texts[1]  # global rank 2 (rank 1 of [1, 2]) slept
    assert all("Connection closed" not in t for t in texts[:2])


def test_a_second_timeout_does_not_read_the_first_ones_posts(short_world):
    text = short_world.run(_second_timeout)[0]
    assert "rank 1 posted nothing" in text, text
    assert "barrier" not in text, "a stale post from the first hang was read"


def test_two_threads_of_a_rank_timing_out_at_once_keep_their_own_posts():
    # a rank's threads that time out together (a handle waited in one, a collective in
    # another) post where they wait under the rank's one key: the second wrote over the
    # first's, and the first to leave took both away, so the other ranks read where the
    # wrong thread waits, or that the rank posted nothing
    import threading

    from torch.distributed import HashStore

    from distkit.dist.guard import diagnose

    store = HashStore()
    here = {"group": [0, 1], "gid": "0", "call": "all_reduce", "seq": 7, "site": "a.py:1"}
    there = {"group": [0, 1], "gid": "3", "call": "gather", "seq": 2, "site": "b.py:2"}
    posted, leave = threading.Event(), threading.Event()

    def other_thread():
        diagnose.post(store, 0, there)
        posted.set()
        leave.wait(10)
        diagnose.unpost(store, 0)

    thread = threading.Thread(target=other_thread)
    thread.start()
    assert posted.wait(10)
    diagnose.post(store, 0, here)
    # a rank waiting in group 0's call 7 reads this thread's post, one in group 3's the other's
    assert diagnose._gather_posts(store, [0], "0", 7) == {0: here}
    assert diagnose._gather_posts(store, [0], "3", 2) == {0: there}
    diagnose.unpost(store, 0)  # this thread leaves its call: the other one's post stays
    assert diagnose._gather_posts(store, [0], "0", 7) == {0: there}
    leave.set()
    thread.join(10)
    assert not store.check(["distkit/where/0"])
