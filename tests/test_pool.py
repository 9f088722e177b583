"""The rank pool: every rank's traceback on failure, hangs stopped, no process left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from helpers_subprocess import alive, script_env

import distkit.dist as dist
from distkit.testing import RankError, RankPool, RankTimeout
from distkit.utils import get_group


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


# -- a world a task broke, groups torn down under a slower rank, an interrupted task ------


def times_out_on_the_world_and_catches_it():
    from distkit import _settings

    _settings.set("hang_grace", 0.5)  # the pool puts the settings back after the task
    if dist.get_rank() == 0:
        with pytest.raises(dist.CollectiveTimeoutError):
            dist.all_reduce(torch.ones(1))  # rank 1 never comes: gloo closes the pair
    else:
        time.sleep(4)
    return dist.get_rank()


def sums_ones():
    return dist.all_reduce(torch.ones(1)).item()


def test_a_world_broken_by_a_caught_timeout_is_restarted():
    with RankPool(2, timeout=30, pg_timeout=2) as p:
        assert p.run(times_out_on_the_world_and_catches_it) == [0, 1]
        assert p.run(sums_ones) == [2.0, 2.0]  # not "Connection closed by peer"
        assert p.restarts == 1


def creates_a_group_and_returns():
    size = dist.get_world_size()
    get_group([0, size - 1])  # the members may still be connecting as the first returns
    return True


def test_groups_are_torn_down_only_once_every_rank_finished():
    """A fast rank used to destroy the task's group while a slower one still connected
    to it (about 1 task in 20 failed, more under load)."""
    with RankPool(3, timeout=30) as p:
        for _ in range(100):
            assert p.run(creates_a_group_and_returns) == [True] * 3
        assert p.restarts == 0


def sleeps(seconds):
    time.sleep(seconds)
    return dist.get_rank()


def test_an_interrupted_task_never_answers_the_next_one():
    """Ctrl-C while the ranks still run a task: their late answers are not the next
    task's results, and the ranks are stopped at once."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    with RankPool(2, timeout=30) as p:
        # SIGUSR2, not SIGALRM: pytest-timeout's alarm must keep guarding this test
        old = signal.signal(signal.SIGUSR2, interrupt)
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR2))
        try:
            timer.start()
            start = time.monotonic()
            with pytest.raises(KeyboardInterrupt):
                p.run(sleeps, 20)
            assert time.monotonic() - start < 5
        finally:
            timer.cancel()
            signal.signal(signal.SIGUSR2, old)
        assert p.run(rank_and_pid)[1][0] == 1 and p.run(dist.get_world_size) == [2, 2]


def test_the_error_message_starts_with_the_failing_ranks_error(pool):
    with pytest.raises(RankError) as info:
        pool.run(fails_on_odd_ranks)
    assert str(info.value).splitlines()[0] == "ValueError: rank 1 refuses"
    assert "worker.py" not in str(info.value), "the pool's own frame is not the story"


FAILING_TEST = """
import distkit.dist as dist
from distkit.testing import ranks

@ranks(2)
def test_rank_one_refuses():
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
"""


def test_a_failing_ranks_test_shows_the_ranks_error_not_the_pool(tmp_path):
    (tmp_path / "test_refuses.py").write_text(FAILING_TEST)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_refuses.py"],
        cwd=tmp_path,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    out = proc.stdout
    assert "E   distkit.local.pool.RankError: ValueError: rank 1 refuses" in out, out
    assert "pool.py" not in out and "def _collect" not in out, out
    assert len(out.splitlines()) < 40, out
