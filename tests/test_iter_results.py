"""iter_results: collect_results' layouts, streamed to dst in rounds of bounded bytes."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
import torch
from conftest import WORLDS, world
from test_helpers import Lazy, sampler_results, truth
from torch.utils.data import DistributedSampler

import distkit.dist as dist
from distkit import _settings
from distkit.testing import ranks
from distkit.utils import get_group


def streamed(results, size, **kwargs) -> list:
    """Everything iter_results yields here (nothing on ranks other than dst)."""
    with dist.iter_results(results, size, **kwargs) as stream:
        return list(stream)


@ranks(*WORLDS)
def test_same_results_as_collect_results_in_every_layout():
    rank, size = world()
    last = max(size - 1, 0)
    for n in (0, 1, 10, 11, 23):
        _, results = sampler_results(n, rank, size, shuffle=False)
        for chunk in (1, 64, 1 << 25):  # one result per round, a few, all at once
            out = streamed(results, n, chunk_bytes=chunk)
            assert out == (truth(n) if rank == 0 else [])
        out = streamed(results, n, dst=last)
        assert out == (truth(n) if rank == last else [])
        assert out == (dist.collect_results(results, n, dst=last) or [])
        bounds = [n * r // max(size, 1) for r in range(max(size, 1) + 1)]
        mine = truth(n)[bounds[rank] : bounds[rank + 1]]
        out = streamed(mine, n, order="contiguous", chunk_bytes=100)
        assert out == (truth(n) if rank == 0 else [])
        indices, shuffled = sampler_results(n, rank, size, shuffle=True, seed=5)
        out = streamed(shuffled, n, indices=indices, chunk_bytes=200)
        assert out == (truth(n) if rank == 0 else [])


@ranks(*WORLDS)
def test_uneven_shards_tensors_and_own_objects():
    rank, size = world()
    # rank r holds r + 1 results: interleaved round-robin skips the short ranks
    results = [{"rank": rank, "k": k, "t": torch.full((k + 1,), rank)} for k in range(rank + 1)]
    total = sum(range(1, max(size, 1) + 1))
    out = streamed(results, total, chunk_bytes=300)
    if rank != 0:
        assert out == []
        return
    expected = [(r, k) for k in range(max(size, 1)) for r in range(max(size, 1)) if k <= r]
    assert [(o["rank"], o["k"]) for o in out] == expected
    for o in out:
        assert torch.equal(o["t"], torch.full((o["k"] + 1,), o["rank"]))
    assert out[0] is results[0]  # dst's own results are its own objects


@ranks(*WORLDS)
def test_shuffling_sampler_restores_dataset_order():
    rank, size = world()
    n = 19
    sampler = DistributedSampler(range(n), num_replicas=max(size, 1), rank=rank, seed=7)
    sampler.set_epoch(3)
    results = [f"sample {i}" for i in sampler]  # evaluated in the sampler's shuffled order
    expected = [f"sample {i}" for i in range(n)]
    assert streamed(results, n, sampler=sampler) == (expected if rank == 0 else [])
    assert dist.collect_results(results, n, sampler=sampler, dst=None) == expected
    if size > 1:  # without the sampler the order is the shuffled one, as documented
        assert dist.collect_results(results, n, dst=None) != expected


@ranks(0, 2, 3)
def test_dst_stopping_early_releases_the_other_ranks():
    rank, size = world()
    results = [[rank, k] for k in range(50)]
    n = 50 * max(size, 1)
    with dist.iter_results(results, n, chunk_bytes=64) as stream:
        first = [item for _, item in zip(range(7), stream)]  # dst breaks off after 7
    assert first == ([[k % max(size, 1), k // max(size, 1)] for k in range(7)] if rank == 0 else [])
    # the consumer raises in the middle of a second stream: the others are told to stop
    with pytest.raises(KeyError) if rank == 0 else _nothing():
        with dist.iter_results(results, n, chunk_bytes=64) as stream:
            for i, _item in enumerate(stream):
                if i == 20:
                    raise KeyError("consumer failed")
    # a stream closed before it was read
    dist.iter_results(results, n).close()
    # a bare loop that breaks off on dst, and a stream dropped unread: once dst lets go
    # of them the others are told to stop (the streams on the other ranks are drained)
    for item in dist.iter_results(results, n, chunk_bytes=64):
        assert item == [0, 0]
        break
    if rank == 0:
        dist.iter_results(results, n)
    else:
        assert list(dist.iter_results(results, n)) == []
    # then every rank is in step again
    assert dist.all_gather_object(rank) == list(range(max(size, 1)))


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class Unpicklable:
    def __reduce__(self):
        raise TypeError("no pickling here")


@ranks(*WORLDS)
def test_errors_are_raised_on_every_rank():
    rank, size = world()
    with pytest.raises(TypeError, match="iter_results: results must be a list"):
        dist.iter_results("abc", 3)
    with pytest.raises(TypeError, match="chunk_bytes must be a positive int"):
        dist.iter_results([1], 1, chunk_bytes=0)
    with pytest.raises(ValueError, match="unknown order 'zigzag'"):
        dist.iter_results([], 0, order="zigzag")
    with pytest.raises(ValueError, match="indices has 1 entries but results has 2"):
        dist.iter_results([1, 2], 2, indices=[0])
    with pytest.raises(ValueError, match="dst=9 is out of range"):
        dist.iter_results([1], 1, dst=9)
    with pytest.raises(ValueError, match="both sampler and indices"):
        dist.iter_results([0], 1, indices=[0], sampler=DistributedSampler(range(1), 1, 0))
    with pytest.raises(TypeError, match="sampler must be a DistributedSampler"):
        dist.iter_results([0], 1, sampler=range(1))
    last = max(size - 1, 0)
    # one rank's result cannot be pickled: it raises its own error, every other rank
    # raises a TypeError naming it (each message with one "iter_results:" prefix)
    bad = [1, Unpicklable()] if rank == last else [1, 2]
    match = r"results\[1\] \(Unpicklable\)" if rank == last else f"rank {last} could not send"
    with pytest.raises(TypeError, match=match) as info:
        dist.iter_results(bad, 2 * max(size, 1))
    assert str(info.value).count("iter_results:") == 1, str(info.value)
    # too few results for size: dst finds out, and tells every rank
    with pytest.raises(ValueError, match="fewer than size=100"):
        dist.iter_results([rank], 100)
    with pytest.raises(ValueError, match="evaluated by no rank"):
        dist.iter_results([rank], size + 1, indices=[rank])
    assert dist.all_gather_object(rank) == list(range(max(size, 1)))


@ranks(2, 3)
def test_indices_on_some_ranks_only_is_an_error_for_both_collectors():
    rank, size = world()
    results = [f"r{rank}-{i}" for i in range(2)]
    indices = {"indices": [2 * rank, 2 * rank + 1]} if rank == 0 else {}
    disagree = "rank 1 and dst (rank 0) disagree: one passed indices"
    with pytest.raises(ValueError, match=re.escape(disagree)):
        with dist.iter_results(results, 2 * size, **indices) as stream:
            list(stream)
    with pytest.raises(ValueError, match=re.escape(disagree)):  # from dst's first round
        dist.collect_results(results, 2 * size, **indices)
    other = 1 if rank == 0 else 0  # the first rank that did the opposite
    with pytest.raises(ValueError, match=re.escape(f"rank {other} and rank {rank} disagree")):
        dist.collect_results(results, 2 * size, dst=None, **indices)
    assert dist.all_gather_object(rank) == list(range(size))


class Point:  # a plain class: the safe serializer refuses it unless allowed
    def __init__(self, x: int) -> None:
        self.x = x


class BreaksOnSecondPickle:
    """Pickles once (the sizing pass), then fails (when it is sent)."""

    calls = 0

    def __reduce__(self):
        BreaksOnSecondPickle.calls += 1
        if BreaksOnSecondPickle.calls > 1:
            raise RuntimeError("broke while being sent")
        return (BreaksOnSecondPickle, ())


@ranks(2, 3)
def test_failures_while_streaming_stop_every_rank():
    rank, size = world()
    # dst refuses what a rank sends (safe serializer): dst raises, and so does every
    # rank still serving it (told by dst), so that none goes on to its next collective;
    # every rank raises UnsafeObjectError naming the sender, whether the results come in
    # rounds (chunk_bytes=1) or, being small, with the plan when the stream opens
    results = [Point(rank)] * 3
    for chunk in (1, 1 << 20):
        if rank == 0:
            with pytest.raises(dist.UnsafeObjectError, match="rank 1 sent an object") as info:
                streamed(results, 3 * size, serializer="safe", chunk_bytes=chunk)
        else:
            stopped = r"^iter_results: rank 0 stopped the call: rank 1 sent an object"
            with pytest.raises(dist.UnsafeObjectError, match=stopped) as info:
                streamed(results, 3 * size, serializer="safe", chunk_bytes=chunk)
        assert info.value.rank == 1
        assert info.value.global_name == "test_iter_results.Point"
        assert str(info.value).count("iter_results:") == 1  # one prefix
    # a result that breaks while it is sent: its rank raises its own error, dst a TypeError
    # naming it, and the rank that was asked at the same time is drained, then told
    BreaksOnSecondPickle.calls = 0
    results = [BreaksOnSecondPickle() if rank == 1 else rank]
    if rank == 0:
        with pytest.raises(TypeError, match="rank 1 could not send its results"):
            streamed(results, size, chunk_bytes=1)
    elif rank == 1:
        with pytest.raises(TypeError, match="broke while being sent"):
            streamed(results, size, chunk_bytes=1)
    else:
        with pytest.raises(TypeError, match="rank 0 stopped the call: rank 1 could not send"):
            streamed(results, size, chunk_bytes=1)
    assert dist.all_gather_object(rank) == list(range(size))


@ranks(3)
def test_a_subgroup_streams_to_its_dst():
    rank, _ = world()
    get_group([1, 2])  # creating a group is collective: every rank makes it
    if rank != 0:
        results = [f"{rank}:{k}" for k in range(5)]
        out = streamed(results, 10, group=[1, 2], dst=1, chunk_bytes=100)
        expected = [f"{1 + k % 2}:{k // 2}" for k in range(10)]
        assert out == (expected if rank == 2 else [])
    assert dist.all_gather_object(rank) == [0, 1, 2]


@ranks(2, 3, timeout=30)
def test_two_streams_open_at_once_keep_their_own_results():
    rank, size = world()
    n = 5 * size
    preds = [("pred", rank, k) for k in range(5)]
    targets = [("target", rank, k) for k in range(5)]
    expected = [(("pred", i % size, i // size), ("target", i % size, i // size)) for i in range(n)]
    for chunk in (1, 64, 1 << 25):  # a round per result, a few, everything in the plans
        a = dist.iter_results(preds, n, chunk_bytes=chunk)
        b = dist.iter_results(targets, n, chunk_bytes=chunk)
        assert list(zip(a, b)) == (expected if rank == 0 else [])
        del a, b  # dst's targets stream, one step short of its end, tells the others
    with dist.iter_results(preds, n, chunk_bytes=1) as a:
        with dist.iter_results(targets, n, chunk_bytes=1) as b:
            assert list(zip(a, b)) == (expected if rank == 0 else [])
    assert dist.all_gather_object(rank) == list(range(size))


@ranks(2, 3, timeout=20)
def test_a_stream_to_another_dst_while_one_is_open_is_refused_on_every_rank():
    rank, size = world()
    last = size - 1
    # two ranks each serving the other's stream would wait for each other forever
    for chunk in (1, 1 << 25):
        with dist.iter_results([rank], size, chunk_bytes=chunk) as first:
            with pytest.raises(ValueError, match="streams open at the same time must all go"):
                dist.iter_results([rank], size, dst=last, chunk_bytes=chunk)
            assert list(first) == (list(range(size)) if rank == 0 else [])
        with dist.iter_results([rank], size, dst=last) as second:  # the first is closed
            assert list(second) == (list(range(size)) if rank == last else [])
    assert dist.all_gather_object(rank) == list(range(size))


@ranks(2, 3, timeout=20)
def test_a_result_that_cannot_be_read_stops_every_rank():
    rank, size = world()
    last = size - 1
    n = 4 * size
    # (whose read fails, how many reads succeed first, chunk_bytes): the sizing read of a
    # rank; the read that puts small results in its plan; the read that sends them in a
    # round; dst's own read as it yields its result
    for culprit, after, chunk in ((last, 0, 1), (last, 1, 1 << 20), (last, 1, 1), (0, 1, 1)):
        results = Lazy([(rank, k) for k in range(4)], bad=2 if rank == culprit else -1, after=after)
        if rank == culprit:  # its own error, as its sequence raised it
            with pytest.raises(OSError, match="cannot read sample 2"):
                streamed(results, n, chunk_bytes=chunk)
        else:  # the rank and the original error, within seconds (not the group's timeout)
            named = f"rank {culprit} could not read results[2]: OSError: cannot read sample 2"
            with pytest.raises(RuntimeError, match=re.escape(named)):
                streamed(results, n, chunk_bytes=chunk)
    assert dist.all_gather_object(rank) == list(range(size))


@ranks(*WORLDS, timeout=20)
def test_an_index_past_int64_raises_on_every_rank():
    rank, size = world()
    size = max(size, 1)
    last = size - 1
    for bad in (2**63, -(2**63) - 1, 2**70):
        indices = [bad] if rank == last else [rank]
        named = f"rank {last} reported dataset index {bad}, outside 0..{size - 1}"
        with pytest.raises(ValueError, match=re.escape(named)):
            streamed([rank], size, indices=indices)
    assert dist.all_gather_object(rank) == list(range(size))


@ranks(2, 3, timeout=30)
def test_only_the_results_count_against_the_safe_serializers_max_bytes():
    rank, size = world()
    # 2000 small results per rank, with their indices: each pack of about 300 bytes
    # decodes well within 10 kB, the plan's sizes and indices (16 kB each) would not
    dist.set_serializer("safe", max_bytes=10_000)
    n = 2000
    indices = [size * i + rank for i in range(n)]
    out = streamed(indices, n * size, indices=indices, chunk_bytes=300)
    assert out == (list(range(n * size)) if rank == 0 else [])


@ranks(2, 3, timeout=40)
def test_a_consumer_slower_than_the_groups_timeout():
    rank, size = world()
    group = get_group(list(range(size)), timeout=2)  # its collectives time out after 2 s
    results = [(rank, k) for k in range(2)]
    got = []
    with dist.iter_results(results, 2 * size, group=group, chunk_bytes=1) as stream:
        for item in stream:
            got.append(item)
            if len(got) <= 2:
                time.sleep(2.5)  # the serving ranks wait longer than the timeout
    assert got == ([(i % size, i // size) for i in range(2 * size)] if rank == 0 else [])
    dist.barrier()  # meet first (default group): the ranks leave the stream at different times
    assert dist.all_gather_object(rank, group=group) == list(range(size))


@ranks(2, 3, timeout=40)
def test_a_rank_that_does_not_iterate_is_named_by_dst():
    rank, size = world()
    _settings.set("hang_grace", 1.0)
    group = get_group(list(range(size)), timeout=2)
    last = size - 1
    stream = dist.iter_results([(rank, k) for k in range(3)], 3 * size, group=group, chunk_bytes=1)
    created = (
        rf"rank {last} created iter_results at tests/test_iter_results.py:\d+ in "
        r"test_a_rank_that_does_not_iterate_is_named_by_dst but has not iterated it"
    )
    if rank == 0:  # dst names the rank, where it created the stream, and what it does
        with pytest.raises(dist.CollectiveTimeoutError, match=created) as info:
            list(stream)
        assert info.value.missing == [last]
        assert "it is not waiting in a distkit collective" in str(info.value)
    elif rank == last:  # busy past the timeout and the grace, then it iterates: told
        time.sleep(5)
        with pytest.raises(dist.CollectiveTimeoutError, match="rank 0 stopped the call: "):
            list(stream)
    else:  # the others, serving, are told
        with pytest.raises(dist.CollectiveTimeoutError, match=created):
            list(stream)
    # no backend timeout happened: the group works (after meeting on the default group:
    # rank 0 leaves the stream seconds before the busy rank does)
    dist.barrier()
    assert dist.all_gather_object(rank, group=group) == list(range(size))


@ranks(2, 3, timeout=40)
def test_the_serving_ranks_name_a_dst_that_went_elsewhere():
    rank, size = world()
    _settings.set("hang_grace", 2.0)
    group = get_group(list(range(size)), timeout=2)
    stream = dist.iter_results([rank], size, group=group, chunk_bytes=1)
    if rank == 0:  # dst forgets to iterate, and waits in another collective
        with pytest.raises(dist.CollectiveTimeoutError) as info:
            dist.barrier(group)
        assert "is waiting in iter_results" in str(info.value), str(info.value)
        stream.close()
    else:
        with pytest.raises(dist.CollectiveTimeoutError) as info:
            list(stream)
        text = str(info.value)
        assert "dst (rank 0) stopped asking for results of the stream created at" in text
        assert "it is waiting in barrier" in text, text
        assert info.value.missing == [0]
    assert dist.all_gather_object(rank) == list(range(size))  # the default group works


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_growth_mib(body) -> float:
    """How far this process's resident memory rose above its level before ``body``.

    The kernel's high-water mark is reset first where it can be (clear_refs); a thread
    sampling VmRSS every millisecond backs it up.
    """
    base = _rss_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        exact = True
    except OSError:
        exact = False
    high = [base]
    running = [True]

    def sample() -> None:
        while running[0]:
            high[0] = max(high[0], _rss_kib("VmRSS"))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        body()
    finally:
        running[0] = False
        sampler.join()
    peak = max(high[0], _rss_kib("VmHWM")) if exact else high[0]
    return (peak - base) / 1024


@pytest.mark.slow
@ranks(2, timeout=300)
def test_dst_memory_stays_bounded_while_streaming_240_mb():
    rank, _ = world()
    rng = np.random.default_rng(rank)
    results = [rng.random(131072) for _ in range(120)]  # 120 arrays of 1 MiB per rank
    counted = []

    def stream() -> None:
        n = total = 0
        with dist.iter_results(results, 240) as items:
            for item in items:
                n += 1
                total += item.nbytes
        counted.append((n, total))

    def collect() -> None:
        out = dist.collect_results(results, 240)
        counted.append(len(out) if out is not None else 0)
        del out

    streaming = peak_growth_mib(stream)
    collecting = peak_growth_mib(collect)
    print(
        f"rank {rank}: peak RSS growth iter_results {streaming:.1f} MiB, "
        f"collect_results {collecting:.1f} MiB"
    )
    if rank == 0:
        assert counted == [(240, 240 * 2**20), 240]
        assert streaming < 64, streaming
        assert collecting > 100, collecting  # what iter_results avoids: all of rank 1's
    else:
        assert counted == [(0, 0), 0]
    return streaming, collecting
