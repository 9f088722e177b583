"""The rank pool: every rank's traceback on failure, hangs stopped, no process left."""

from __future__ import annotations

import os
import time

import pytest
from helpers_subprocess import alive

import distkit.dist as dist
from distkit.testing import RankError, RankPool, RankTimeout


def fails_on_odd_ranks():
    if dist.get_rank() % 2:
        raise ValueError(f"rank {dist.get_rank()} refuses")
    return dist.get_rank()


def waits_on_rank_zero():
    if dist.get_rank() == 0:
        dist.barrier()  # the others never come
    return dist.get_rank()


def dies_on_rank_one():
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()


def rank_and_pid():
    return dist.get_rank(), os.getpid()


@pytest.fixture
def pool():
    p = RankPool(3, timeout=20, pg_timeout=30)
    yield p
    p.close()


def test_failure_reports_every_failing_rank(pool):
    with pytest.raises(RankError) as info:
        pool.run(fails_on_odd_ranks)
    text = str(info.value)
    assert "failed on rank(s) 1 of 3" in text and "rank 1 refuses" in text
    assert info.value.results == {0: 0, 2: 2}
    assert pool.run(dist.get_rank) == [0, 1, 2]  # the same ranks keep serving


def test_hang_is_stopped_with_stacks_and_the_pool_restarts(pool):
    first = pool.run(rank_and_pid)
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        pool.run(waits_on_rank_zero, timeout=2)
    assert time.monotonic() - start < 10
    text = str(info.value)
    assert "did not finish within 2 s on rank(s) 0 of 3" in text
    assert "in barrier" in text and "waits_on_rank_zero" in text  # rank 0's own stack
    assert info.value.results == {1: 1, 2: 2}
    assert not any(alive(pid) for _, pid in first), "hung ranks must be killed"
    again = pool.run(rank_and_pid)
    assert [r for r, _ in again] == [0, 1, 2] and pool.restarts == 1


def test_a_dead_rank_is_reported_and_replaced(pool):
    with pytest.raises(RankError, match=r"rank 1 died \(exit code 3\)"):
        pool.run(dies_on_rank_one, timeout=10)
    assert pool.run(dist.get_world_size) == [3, 3, 3]


def test_close_leaves_no_process():
    p = RankPool(2)
    pids = [pid for _, pid in p.run(rank_and_pid)]
    p.close()
    assert not any(alive(pid) for pid in pids)
