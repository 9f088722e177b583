"""all_reduce_dict, all_reduce_params, sync_random_seed, collect_results."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

import pytest
import torch
from conftest import WORLDS, world
from torch.utils.data import DistributedSampler

import distkit.dist as dist
from distkit.testing import ranks
from distkit.utils import get_group


@ranks(*WORLDS)
def test_all_reduce_dict_any_key_order():
    rank, size = world()
    items = [
        ("loss", torch.tensor(float(rank))),
        ("count", torch.tensor(rank + 1)),
        ("vec", torch.ones(3) * rank),
    ]
    if rank % 2:
        items.reverse()  # ranks built their dicts in different orders
    data = dict(items)
    tensors = dict(data)
    out = dist.all_reduce_dict(data, op="sum")
    assert out is data and all(out[k] is tensors[k] for k in data)  # updated in place
    assert out["loss"].item() == sum(range(size))
    assert out["count"].item() == sum(range(1, size + 1))
    assert out["vec"].tolist() == [float(sum(range(size)))] * 3
    mean = dist.all_reduce_dict({"a": torch.tensor(float(rank)), "b": torch.tensor([2.0])}, "mean")
    assert mean["a"].item() == pytest.approx(sum(range(size)) / size)
    assert mean["b"].tolist() == [2.0]
    with pytest.raises(TypeError, match=r"data\['n'\] must be a torch.Tensor"):
        dist.all_reduce_dict({"n": 3})
    with pytest.raises(TypeError, match=r"op='bxor' needs an integer or bool data\['c'\]"):
        dist.all_reduce_dict({"c": torch.tensor(1.0)}, op="bxor")
    ints = dist.all_reduce_dict({"c": torch.tensor(rank + 1)}, op="mean")
    assert ints["c"].item() == sum(range(1, size + 1)) // size  # positive: truncated down


@ranks(*WORLDS)
def test_all_reduce_params_buckets():
    rank, size = world()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    before = [p.detach().clone() for p in model.parameters()]
    gathered = dist.all_gather_object(before)
    out = dist.all_reduce_params(model.parameters(), bucket_size_mb=1e-5, op="mean")
    assert [id(p) for p in out] == [id(p) for p in model.parameters()]
    for i, p in enumerate(model.parameters()):
        expected = sum(g[i] for g in gathered) / size
        assert torch.allclose(p.detach(), expected)
    counts = [torch.tensor([rank]), torch.tensor([1.0])]
    dist.all_reduce_params(counts, coalesce=False)
    assert counts[0].item() == sum(range(size)) and counts[1].item() == size


@ranks(*WORLDS)
def test_sync_random_seed_is_shared():
    seeds = dist.all_gather_object(dist.sync_random_seed())
    assert len(set(seeds)) == 1 and 0 <= seeds[0] < 2**31


def sampler_results(size: int, rank: int, world_size: int, **kwargs):
    """What rank evaluates under a DistributedSampler, as (index, value) results."""
    sampler = DistributedSampler(range(size), num_replicas=world_size, rank=rank, **kwargs)
    indices = list(sampler)
    # a real None result for every index divisible by 7, to prove None survives
    return indices, [None if i % 7 == 0 else {"i": i} for i in indices]


def truth(size: int) -> list:
    return [None if i % 7 == 0 else {"i": i} for i in range(size)]


@ranks(*WORLDS)
def test_collect_results_distributed_sampler_padding():
    rank, size = world()
    for n in (1, 10, 11, 23):  # divisible and not by the world size
        _, results = sampler_results(n, rank, size, shuffle=False)
        out = dist.collect_results(results, n)
        assert out == (truth(n) if rank == 0 else None)
        everywhere = dist.collect_results(results, n, dst=None)
        assert everywhere == truth(n)


@ranks(*WORLDS)
def test_collect_results_contiguous_shards():
    rank, size = world()
    n = 23
    bounds = [n * r // size for r in range(size + 1)]  # uneven contiguous blocks
    mine = truth(n)[bounds[rank] : bounds[rank + 1]]
    out = dist.collect_results(mine, n, order="contiguous", dst=size - 1)
    assert out == (truth(n) if rank == size - 1 else None)


@ranks(*WORLDS)
def test_collect_results_by_indices_with_shuffle():
    rank, size = world()
    n = 17
    indices, results = sampler_results(n, rank, size, shuffle=True, seed=3)
    out = dist.collect_results(results, n, indices=indices, dst=None)
    assert out == truth(n)


@ranks(*WORLDS)
def test_collect_results_errors():
    rank, size = world()
    _, results = sampler_results(10, rank, size, shuffle=False, drop_last=True)
    if size in (3, 4):  # drop_last loses samples: reported on dst, not silently shortened
        if rank == 0:
            with pytest.raises(ValueError, match="fewer than size=10"):
                dist.collect_results(results, 10)
        else:
            assert dist.collect_results(results, 10) is None
    with pytest.raises(ValueError, match="unknown order 'zigzag'"):
        dist.collect_results([], 0, order="zigzag")
    with pytest.raises(ValueError, match="indices has 1 entries but results has 2"):
        dist.collect_results([1, 2], 2, indices=[0])
    with pytest.raises(TypeError, match="results must be a list"):
        dist.collect_results("abc", 3)
    with pytest.raises(ValueError, match="dataset indices were evaluated by no rank"):
        dist.collect_results([rank], size + 1, indices=[rank], dst=None)
    assert dist.collect_results_cpu(["a"] * 2, 1 * size) == (["a"] * size if rank == 0 else None)


@ranks(2, timeout=120)
def test_collect_results_one_million_results_per_rank():
    rank, size = world()
    n = 1_000_000
    results = [{"i": i * size + rank} for i in range(n)]
    out = dist.collect_results(results, n * size)
    if rank == 0:
        assert len(out) == n * size
        assert all(item["i"] == i for i, item in enumerate(out))
    else:
        assert out is None


@ranks(1, 2, 3)
def test_collect_results_shows_progress_on_the_receiver_only():
    rank, size = world()
    from distkit.dist import evaluation

    calls = []
    original = evaluation.track

    def recording_track(iterable, description, **kwargs):
        calls.append((description, kwargs.get("delay")))
        return original(iterable, description, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(evaluation, "track", recording_track)
        dist.collect_results([rank] * 10, 10 * size, dst=size - 1)
    assert calls == ([("collect_results", 1.0)] if rank == size - 1 else [])


@ranks(*WORLDS)
def test_all_reduce_dict_says_which_key_has_which_dtype_on_which_rank():
    rank, size = world()
    # the same keys everywhere; "loss" is float16 on rank 1 only
    data = {"loss": torch.tensor(1.0, dtype=torch.float16 if rank == 1 else torch.float32)}
    data["n"] = torch.tensor(rank)
    if size < 2:  # one rank: nothing to disagree with
        assert dist.all_reduce_dict(data) is data and data["n"].item() == 0
        return
    others = ", ".join(str(r) for r in range(size) if r != 1)
    with pytest.raises(ValueError) as info:
        dist.all_reduce_dict(data)
    msg = str(info.value)
    where = f"rank {others}" if size == 2 else f"ranks {others}"
    assert f"data['loss'] is torch.float32 on {where} and torch.float16 on rank 1" in msg
    assert (
        "Give data['loss'] one dtype on every rank: cast it before the call, e.g. "
        "data['loss'] = data['loss'].to(torch.float32)"
    ) in msg
    assert "missing" not in msg and "add the missing ones" not in msg  # no key is missing
    assert f"(on rank {rank} of {size})" in msg
    # shapes: said as such; keys: the missing key and the ranks without it
    with pytest.raises(ValueError, match=r"data\['v'\] has shape \(2,\) on rank") as info:
        dist.all_reduce_dict({"v": torch.ones(2 if rank == 0 else 3)})
    assert "one shape on every rank" in str(info.value) and "cast it" not in str(info.value)
    lacking = ", ".join(str(r) for r in range(1, size))
    with pytest.raises(ValueError, match=rf"key 'b' is missing on ranks? {lacking}\b") as info:
        dist.all_reduce_dict({"a": torch.ones(1), **({"b": torch.ones(1)} if rank == 0 else {})})
    assert "add the missing ones" in str(info.value) and "cast it" not in str(info.value)
    same = dist.all_reduce_dict({"loss": torch.tensor(1.0)})  # every rank still in step
    assert same["loss"].item() == size


@ranks(2, 3, timeout=30)
def test_the_helpers_options_are_checked_at_every_call_not_only_the_first():
    """The default check looks at the first calls of a line, and a helper's inner calls
    (its layout check, one reduction per dtype) take those visits: a rank with another op
    at a later call got the others' sums as its maxima (all_reduce_dict) with no error,
    and another bucketing aborted the process in gloo (all_reduce_params)."""
    rank, size = world()
    last = size - 1
    for call in range(6):
        odd = rank == last and call == 4
        data = {"a": torch.tensor([1.0 + rank, 10.0]), "n": torch.tensor([rank + 1])}
        try:
            dist.all_reduce_dict(data, op="max" if odd else "sum")
        except ValueError as exc:
            said = str(exc)
            assert call == 4, (call, said)
            assert (
                f"op is sum on {'rank 0' if size == 2 else 'ranks 0, 1'} and max on rank {last}"
                in said
            )
            assert (
                f"\n  rank {last}: {{'a': torch.float32 (2,), 'n': torch.int64 (1,)}}, op=max\n"
                in said
            )
            assert "Pass the same op on every rank" in said, said
        else:
            assert call != 4, "the op that differs was not caught"
            assert data["a"].tolist() == [float(sum(range(1, size + 1))), 10.0 * size], call
    for call in range(6):
        odd = rank == last and call == 4
        params = [torch.ones(4), torch.ones(2, 2)]
        mib = 25 if rank else 25.0  # the same size: they agree
        differs = {
            "coalesce": dict(coalesce=not odd),
            "bucket_size_mb": dict(bucket_size_mb=1e-6 if odd else mib),
        }
        for times, (option, kwargs) in enumerate(differs.items(), 1):
            try:
                dist.all_reduce_params(params, **{"bucket_size_mb": mib, **kwargs})
            except ValueError as exc:
                said = str(exc)
                assert call == 4, (call, said)
                assert f"the ranks disagree on {option}" in said, said
                assert f"Pass the same {option}" in said, said
            else:
                assert call != 4, f"a {option} that differs was not caught"
            want = 1 if call == 4 else size**times  # refused: untouched
            assert all(torch.equal(p, torch.full_like(p, want)) for p in params), (call, option)
    # no limit, said two ways, agrees; NaN is refused, on every rank
    limits = dist.all_reduce_params([torch.ones(2)], bucket_size_mb=-1 if rank else float("inf"))
    assert torch.equal(limits[0], torch.full((2,), float(size)))
    with pytest.raises(ValueError, match="bucket_size_mb must be a number of MiB, got nan"):
        dist.all_reduce_params([torch.ones(2)], bucket_size_mb=float("nan") if rank == last else 1)
    # keys that print alike (1 and "1") line up in any insertion order
    keyed = {1: torch.tensor([1.0]), "1": torch.tensor([100.0])}
    got = dist.all_reduce_dict(dict(reversed(keyed.items())) if rank else keyed)
    assert got[1].item() == size and got["1"].item() == 100.0 * size
    assert dist.all_gather_object(rank) == list(range(size))  # still in step


class _Keyed(NamedTuple):
    members: frozenset
    n: int


@ranks(*WORLDS)
def test_all_reduce_dict_keys_are_spelled_alike_in_every_process_or_refused():
    """A frozenset key's repr lists its members in hash-table order, which differs between
    processes (and here by insertion order: 0 and 8 share a slot), so equal dicts were
    refused as different keys. Two keys of one type that print alike (NaNs) were paired
    by insertion order, silently."""
    rank, size = world()
    members = [8, 0] if rank % 2 else [0, 8]
    assert (repr(frozenset(members)) == "frozenset({8, 0})") == bool(rank % 2)
    data = {
        frozenset(members): torch.tensor([1.0]),
        ("k", frozenset(members)): torch.ones(2),
        _Keyed(frozenset(members), 1): torch.ones(1),
    }
    got = dist.all_reduce_dict(data)
    assert got[_Keyed(frozenset([0, 8]), 1)].tolist() == [float(size)]
    assert got[frozenset([0, 8])].tolist() == [float(size)]
    assert got[("k", frozenset([0, 8]))].tolist() == [float(size)] * 2
    nans = {float("nan"): torch.tensor([1.0]), float("nan"): torch.tensor([2.0])}
    assert len(nans) == 2
    with pytest.raises(
        ValueError,
        match=r"data has two keys of type float that print alike "
        r"\(nan\): the ranks cannot tell which of them is which",
    ) as info:
        dist.all_reduce_dict(nans)
    if dist.is_distributed():
        assert f"(on rank {rank} of {size})" in str(info.value)
    assert [t.item() for t in nans.values()] == [1.0, 2.0]  # untouched
    # on one rank only: every rank raises, naming it
    last = size - 1
    odd = nans if rank == last else {"x": torch.tensor([1.0]), "y": torch.ones(1)}
    with pytest.raises(ValueError, match="two keys of type float that print alike") as info:
        dist.all_reduce_dict(odd)
    if rank != last:
        assert f"rank {last} " in str(info.value), str(info.value)
    assert dist.all_gather_object(rank) == list(range(size))  # still in step


@ranks(2, 3)
def test_all_reduce_params_says_which_tensor_differs_on_which_rank():
    """Tensors of one total size in another shape or order were flattened into one bucket
    and added across each other silently (mmengine does the same)."""
    rank, size = world()
    for coalesce in (True, False):
        # 6 + 4 numbers everywhere: rank 1 holds its two tensors in the other order
        params = [torch.ones(2, 3), torch.ones(4)]
        if rank == 1:
            params.reverse()
        with pytest.raises(ValueError) as info:
            dist.all_reduce_params(params, coalesce=coalesce)
        msg = str(info.value)
        assert "the ranks passed different tensors" in msg
        assert "params[0] has shape (2, 3) on rank" in msg and "(4,) on rank 1" in msg
        assert "one shape on every rank" in msg and f"(on rank {rank} of {size})" in msg
        assert "\n  rank 1: [torch.float32 (4,), torch.float32 (2, 3)]\n" in msg
        assert all(torch.equal(p, torch.ones_like(p)) for p in params)  # untouched
    shape = (3, 2) if rank == 1 else (2, 3)  # one size, another shape
    with pytest.raises(ValueError, match=r"params\[0\] has shape \(2, 3\) on rank"):
        dist.all_reduce_params([torch.ones(shape)])
    fewer = [torch.ones(2)] * (1 if rank == size - 1 else 2)
    with pytest.raises(ValueError, match=rf"params\[1\] is missing on rank {size - 1}\b"):
        dist.all_reduce_params(fewer)
    with pytest.raises(
        ValueError, match=r"(?s)params\[0\] is torch.float32 on rank.*Give params\[0\]"
    ):
        dist.all_reduce_params([torch.ones(2, dtype=torch.float64 if rank == 1 else torch.float32)])
    many = [torch.ones(i + 1) for i in range(30)]  # every shape differs on rank 1
    with pytest.raises(ValueError) as info:
        dist.all_reduce_params(many[::-1] if rank == 1 else many)
    msg = str(info.value)  # the first few of each, and how many in all
    assert "(30 differences in all)" in msg and "(30 tensors in all)" in msg
    assert len(msg) < 3000, len(msg)
    same = dist.all_reduce_params([torch.ones(2, 3), torch.ones(4)])  # still in step
    assert all(torch.equal(p, torch.full_like(p, size)) for p in same)
    if size == 3:  # on a sub-group: global ranks, as the default check names them
        get_group([1, 2])  # creating a group is collective: every rank makes it
        if rank in (1, 2):
            with pytest.raises(ValueError) as info:
                dist.all_reduce_params([torch.ones(rank + 1)], group=[1, 2])
            msg = str(info.value)
            assert "the ranks of group [1, 2] passed different tensors" in msg
            assert "params[0] has shape (2,) on rank 1 and (3,) on rank 2" in msg, msg
            assert "\n  rank 2 (rank 1): [torch.float32 (3,)]\n" in msg
            assert f"(on rank {rank - 1} of 2)" in msg
        dist.barrier()


@ranks(2, 3, timeout=20)
def test_a_bad_argument_on_one_rank_raises_on_every_rank_and_leaves_them_in_step():
    """Raised on that rank alone, before the reduction, the others waited in it and
    paired it with that rank's next call: another call's sums, no error."""
    rank, size = world()
    last = size - 1
    cases = [
        (
            lambda bad: dist.all_reduce_params([torch.ones(2), "oops" if bad else torch.ones(2)]),
            TypeError,
            "params[1] must be a torch.Tensor",
        ),
        (
            lambda bad: dist.all_reduce_params([torch.ones(2)], op="band" if bad else "sum"),
            TypeError,
            "op='band' needs an integer or bool params[0]",
        ),
        (
            lambda bad: dist.all_reduce_dict({"a": "oops" if bad else torch.ones(1)}),
            TypeError,
            "data['a'] must be a torch.Tensor",
        ),
        (
            lambda bad: dist.all_reduce_dict({"a": torch.ones(1)}, op="median" if bad else "sum"),
            ValueError,
            "median",
        ),
    ]
    for call, kind, said in cases:
        with pytest.raises(kind) as info:
            call(rank == last)
        msg = str(info.value)
        assert said in msg, msg
        if rank != last:
            assert f"rank {last} passed bad arguments: " in msg, msg
        assert msg.count("(on rank ") == 1 and f"(on rank {rank} of {size})" in msg, msg
        # the next call pairs with the next call on every rank
        assert (
            dist.all_reduce_params([torch.full((2,), rank + 1.0)])[0].tolist()
            == [float(sum(range(1, size + 1)))] * 2
        )


class Lazy(Sequence):
    """Results read on access (as from disk): reading ``bad`` fails from its read number
    ``after + 1`` on (``after=0``: every read fails)."""

    def __init__(self, items: list, bad: int = -1, after: int = 0) -> None:
        self.items, self.bad, self.after = items, bad, after
        self.reads = 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        item = self.items[i]
        if i == self.bad:
            self.reads += 1
            if self.reads > self.after:
                raise OSError(f"cannot read sample {i}")
        return item


@ranks(2, 3, timeout=20)
def test_collect_results_a_result_that_cannot_be_read_stops_every_rank():
    rank, size = world()
    last = size - 1
    for dst in (0, None):
        results = Lazy([rank] * 3, bad=1 if rank == last else -1)
        if rank == last:  # its own error, as its sequence raised it
            with pytest.raises(OSError, match="cannot read sample 1"):
                dist.collect_results(results, 3 * size, dst=dst)
        else:  # the rank and the original error, within seconds (not the group's timeout)
            named = f"rank {last} could not read results[1]: OSError: cannot read sample 1"
            with pytest.raises(RuntimeError, match=re.escape(named)):
                dist.collect_results(results, 3 * size, dst=dst)
    assert dist.collect_results(Lazy([rank] * 2), 2 * size, dst=None) == [
        r for _ in range(2) for r in range(size)
    ]
    assert dist.all_gather_object(rank) == list(range(size))


@ranks(2, 3, timeout=20)
def test_bad_indices_on_one_rank_raise_on_every_rank_and_leave_them_in_step():
    """Raised on that rank alone, before the first round, the others waited in the round,
    and paired it with that rank's next call: wrong results, no error."""
    rank, size = world()
    last = size - 1
    short = f"rank {last} passed bad arguments: indices has 1 entries but results has 2"
    floats = f"rank {last} passed bad arguments: indices[0] must be an int"
    for bad, kind, named in (([0], ValueError, short), ([0.5, 1.0], TypeError, floats)):
        indices = bad if rank == last else [2 * rank, 2 * rank + 1]
        for streamed, dst in ((False, 0), (False, None), (True, 0)):
            with pytest.raises(kind) as info:
                if streamed:
                    list(dist.iter_results([rank] * 2, 2 * size, dst=dst, indices=indices))
                else:
                    dist.collect_results([rank] * 2, 2 * size, dst=dst, indices=indices)
            if rank != last:  # the rank and its error, within seconds
                assert named in str(info.value), (streamed, dst, str(info.value))
    bad = rank == last  # a serializer, a chunk size: the same, for both collectors
    with pytest.raises(ValueError, match=f"rank {last} passed bad arguments: serializer|json"):
        dist.collect_results([rank] * 2, 2 * size, serializer="json" if bad else None)
    with pytest.raises(TypeError, match=f"rank {last} passed bad arguments: chunk_bytes|got int 0"):
        list(dist.iter_results([rank] * 2, 2 * size, chunk_bytes=0 if bad else 1024))
    # a dst out of range on one rank: checked with the rest, before the first round
    out_of_range = f"rank {last} passed bad arguments: dst={size} is out of range"
    for streamed in (False, True):
        dst = size if bad else 0
        with pytest.raises(ValueError) as info:
            if streamed:
                list(dist.iter_results([rank] * 2, 2 * size, dst=dst))
            else:
                dist.collect_results([rank] * 2, 2 * size, dst=dst)
        mine = f"dst={size} is out of range for a group of size {size}"
        assert (mine if bad else out_of_range) in str(info.value), (streamed, str(info.value))
    # every rank still in step: the next calls pair up
    got = dist.collect_results([rank] * 2, 2 * size, indices=[2 * rank, 2 * rank + 1])
    assert got == ([r for r in range(size) for _ in range(2)] if rank == 0 else None)
    assert dist.all_gather_object(rank) == list(range(size))


@ranks(2, 3, timeout=30)
def test_ranks_that_disagree_on_the_collector_or_its_dst_raise_at_once_on_every_rank():
    """A dst unlike the others' raised the check of the status broadcast that followed
    the first round (broadcast, src), dropping the collector's own; collect_results on
    one rank and iter_results on another were a call number apart, so the check could
    not pair them, and every rank waited out the timeout."""
    rank, size = world()
    last = size - 1
    with pytest.raises(dist.CollectiveMismatchError) as info:
        dist.collect_results([rank] * 2, 2 * size, dst=last if rank == last else 0)
    said = str(info.value)
    assert said.startswith("collect_results: ") and "They must agree on: dst." in said, said
    assert f"rank {last}: collect_results(dst={last}, " in said, said
    for streamed_last in (True, False):  # the last rank streams, or only the others do
        with pytest.raises(dist.CollectiveMismatchError) as info:
            if streamed_last == (rank == last):
                list(dist.iter_results([rank] * 2, 2 * size))
            else:
                dist.collect_results([rank] * 2, 2 * size)
        said = str(info.value)
        assert f"rank 0: {'collect_results' if streamed_last else 'gather'}(" in said, said
        assert f"rank {last}: {'gather' if streamed_last else 'collect_results'}(" in said, said
    # with dst=None each rank orders and cuts by its own size and order: they must agree
    results = [f"s{i}" for i in range(rank, 2 * size, size)]
    for what, kwargs in (("size", dict(size=size)), ("order", dict(order="contiguous"))):
        with pytest.raises(ValueError) as info:
            dist.collect_results(
                results, **{"size": 2 * size, **(kwargs if rank == last else {})}, dst=None
            )
        said = str(info.value)
        assert f"the ranks passed different {what}s: {what}=" in said, said
        assert f"on rank {last}, and with dst=None" in said and f"(on rank {rank} of" in said, said
    # with dst given, dst's own size counts (as in mmengine): no error
    got = dist.collect_results(results, 2 * size if rank == 0 else size, dst=0)
    assert got == ([f"s{i}" for i in range(2 * size)] if rank == 0 else None)
    assert dist.all_gather_object(rank) == list(range(size))  # still in step


class Broken:
    """A sampler whose order cannot be read (it raises RuntimeError)."""

    def set_epoch(self, epoch: int) -> None:
        pass

    def __iter__(self):
        raise RuntimeError("sampler broke")

    def __len__(self) -> int:
        return 2


@ranks(2, 3, timeout=20)
def test_a_failing_sampler_or_indices_on_some_ranks_only_raise_on_every_rank():
    rank, size = world()
    last = size - 1
    for dst in (0, None):
        sampler = Broken() if rank == last else None
        with pytest.raises(RuntimeError) as info:
            dist.collect_results([rank] * 2, 2 * size, dst=dst, sampler=sampler)
        assert "sampler broke" in str(info.value)  # on the last rank: its own error
        assert str(info.value).count("(on rank ") == (rank != last), str(info.value)
        # indices on the last rank only: every rank raises (dst did, the others went on)
        indices = [2 * rank, 2 * rank + 1] if rank == last else None
        with pytest.raises(ValueError, match="disagree: one passed indices") as info:
            dist.collect_results([rank] * 2, 2 * size, dst=dst, indices=indices)
        assert str(info.value).count("(on rank ") == 1, str(info.value)
    got = dist.collect_results([rank] * 2, 2 * size, dst=None)
    assert got == [r for _ in range(2) for r in range(size)]


class Point:  # a plain class: the safe serializer refuses it unless allowed
    def __init__(self, x: int) -> None:
        self.x = x


@ranks(2, 3, timeout=20)
def test_collect_results_refused_in_a_later_round_raises_on_every_rank():
    rank, size = world()
    from distkit.dist import evaluation

    last = size - 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(evaluation, "CHUNK_ITEMS", 2)  # rounds of 2 results per rank
        for dst in (0, last, None):
            # the last rank's third result (round 2) is refused by every receiver; the
            # ranks that decode nothing of it (the senders, the last rank itself) raise
            # the same error, told by dst (by the ranks that refused it, with dst=None)
            results = [rank, rank, Point(rank), rank] if rank == last else [rank] * 4
            if dst == last:
                continue  # dst decodes nothing of its own: nothing to refuse
            refused = f"rank {last} sent an object that needs test_helpers.Point"
            with pytest.raises(dist.UnsafeObjectError, match=refused) as info:
                dist.collect_results(results, 4 * size, dst=dst, serializer="safe")
            assert info.value.rank == last
            assert info.value.global_name == "test_helpers.Point"
            assert str(info.value).count("collect_results:") == 1
        # and the group is in step: the next collective gets nobody's leftover round
        assert dist.all_gather_object(rank) == list(range(size))
        out = dist.collect_results([rank] * 5, 5 * size, serializer="safe")
        assert out == ([r for _ in range(5) for r in range(size)] if rank == 0 else None)


class _Holds:
    def __init__(self) -> None:
        self.fn = lambda: 1  # cannot be pickled


@ranks(*WORLDS)
def test_collect_results_names_an_unpicklable_result_by_its_index_in_results():
    """It named the round's payload: data[0][1] for results[3] (in rounds of 2)."""
    rank, size = world()
    from distkit.dist import evaluation

    last = size - 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(evaluation, "CHUNK_ITEMS", 2)  # rounds of 2 results per rank
        for dst in (0, None):
            results = [0, 1, 2, _Holds()] if rank == last else [0, 1, 2, 3]
            with pytest.raises(TypeError) as info:
                dist.collect_results(results, 4 * size, dst=dst)
            said = str(info.value)
            culprit = "results[3].fn (function) cannot be pickled"
            told = f"rank {last} could not send its object: {culprit}"
            if rank == last:
                assert said.startswith(f"collect_results: {culprit}"), said
            elif dst is None or rank == dst:
                assert said.startswith(f"collect_results: {told}"), said
            else:  # it heard of it from dst
                assert said.startswith(f"collect_results: rank {dst} stopped the call: {told}")
            assert said.count("(on rank") == 1, said
    assert dist.all_gather_object(rank) == list(range(size))


@ranks(3, timeout=20)
def test_collect_results_an_unpicklable_result_with_a_large_one_elsewhere():
    rank, size = world()
    # rank 1 cannot pickle its result while rank 2 sends more than one slot: dst must
    # still take rank 2's bytes, or rank 2 waits in its send until the group's timeout
    results = [lambda: rank] if rank == 1 else ["x" * 20000 if rank == 2 else "y"]
    match = "cannot be pickled" if rank == 1 else "rank 1 could not send its object"
    with pytest.raises(TypeError, match=match):
        dist.collect_results(results, size)
    assert dist.all_gather_object(rank) == list(range(size))
