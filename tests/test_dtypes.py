"""Every dtype a single process accepts works on gloo ranks too.

gloo refuses int16, uint16, uint32, uint64 and the float8 types ("Invalid scalar type");
distkit carries them as bytes and reduces them in a wider type (``distkit.dist.backends.gloo``).
Each case computes its expected value in float64 from what every rank passed.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import WORLDS, world

import distkit.dist as dist
from distkit import _settings
from distkit.testing import ranks
from distkit.utils import get_group

NARROW = [torch.int16, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn]


def values(rank: int, n: int = 3) -> torch.Tensor:
    """What ``rank`` passes: small positive numbers every narrow dtype holds exactly."""
    return torch.arange(n, dtype=torch.float64) + 1 + rank


def same(result: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """``result`` has ``dtype`` and the exact value, rounded once to ``dtype`` (float8)."""
    assert result.dtype == dtype
    assert result.to(torch.float64).tolist() == expected.to(dtype).to(torch.float64).tolist()


@ranks(*WORLDS)
@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_narrow_dtypes_reduce_like_wide_ones(dtype):
    rank, size = world()
    everyone = [values(r) for r in range(size)]
    t = values(rank).to(dtype)
    assert dist.all_reduce(t) is t
    same(t, sum(everyone), dtype)
    same(dist.all_reduce(values(rank).to(dtype), op="max"), everyone[-1], dtype)
    same(dist.all_reduce(values(rank).to(dtype), async_op=True).wait(), sum(everyone), dtype)
    if not dtype.is_floating_point:  # integer mean truncates, as for every integer dtype
        mean = dist.all_reduce(values(rank).to(dtype), op="mean")
        same(mean, torch.div(sum(everyone), size, rounding_mode="trunc"), dtype)
    r = dist.reduce(values(rank).to(dtype), dst=size - 1)
    same(r, sum(everyone) if rank == size - 1 else values(rank), dtype)
    chunks = dist.reduce_scatter(values(rank, 2 * size).to(dtype))
    same(chunks, sum(values(q, 2 * size) for q in range(size))[2 * rank : 2 * rank + 2], dtype)


@ranks(*WORLDS)
@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_narrow_dtypes_move_like_wide_ones(dtype):
    rank, size = world()
    t = values(rank).to(dtype)
    for out in (dist.all_gather(t, same_shape=True), dist.all_gather(t)):
        assert out[rank] is t
        for r, part in enumerate(out):
            same(part, values(r), dtype)
    uneven = dist.all_gather(values(rank, rank + 1).to(dtype))
    for r, part in enumerate(uneven):
        same(part, values(r, r + 1), dtype)
    gathered = dist.gather(t, dst=0)
    assert len(gathered) == (size if rank == 0 else 0)
    for r, part in enumerate(gathered):
        same(part, values(r), dtype)
    b = values(rank).to(dtype)
    assert dist.broadcast(b, src=size - 1) is b
    same(b, values(size - 1), dtype)
    scattered = dist.scatter([values(r).to(dtype) for r in range(size)] if rank == 0 else None)
    same(scattered, values(rank), dtype)
    received = dist.all_to_all([values(rank + 10 * r).to(dtype) for r in range(size)])
    for r, part in enumerate(received):
        same(part, values(r + 10 * rank), dtype)
    rows = dist.all_to_all_single(values(rank, size).to(dtype))
    same(rows, torch.tensor([values(r, size)[rank].item() for r in range(size)]), dtype)
    scalar = dist.all_gather(torch.tensor(rank + 1.0).to(dtype), same_shape=True)
    assert [p.shape for p in scalar] == [torch.Size([])] * size
    assert [p.to(torch.float64).item() for p in scalar] == [r + 1.0 for r in range(size)]


@ranks(*WORLDS)
def test_uint64_max_and_min_order_values_above_two_to_the_63():
    rank, size = world()
    big = 2**63 + 5
    mine = [big, 3] if rank == 0 else [7, big + rank]
    t = torch.tensor(mine, dtype=torch.uint64)
    everyone = [[big, 3]] + [[7, big + r] for r in range(1, size)]
    top = dist.all_reduce(t.clone(), op="max")
    low = dist.all_reduce(t.clone(), op="min")
    expect_top = [max(v[i] for v in everyone) for i in range(2)]
    expect_low = [min(v[i] for v in everyone) for i in range(2)]
    # uint64 -> int64 bits -> Python ints, compared exactly
    as_int = lambda x: [v % 2**64 for v in x.view(torch.int64).tolist()]  # noqa: E731
    assert as_int(top) == expect_top
    assert as_int(low) == expect_low


#: One dtype of every item size (1, 2, 4, 8 and 16 bytes), complex included.
EVERY_WIDTH = [torch.uint8, torch.bfloat16, torch.float32, torch.int64, torch.complex128]


def _numbers(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) + 1 + 10 * rank).to(dtype)


@ranks(*WORLDS)
@pytest.mark.parametrize("dtype", EVERY_WIDTH, ids=str)
def test_uneven_calls_in_a_loop_keep_every_item_size_aligned(dtype):
    # From the second call of a kind the data rides behind a header at a predicted size:
    # the header must keep it aligned for a 16-byte complex128 too (a 232-byte header
    # once made torch refuse to view the received bytes as complex128)
    rank, size = world()
    for n in (3, 3, 3, 5000, 5000, 5000):
        got = dist.all_gather(_numbers(rank, n + rank, dtype))
        assert [p.tolist() for p in got] == [
            _numbers(r, n + r, dtype).tolist() for r in range(size)
        ]
        sent = [_numbers(rank, n + d, dtype) for d in range(size)]
        got = dist.all_to_all(sent)
        assert [p.tolist() for p in got] == [
            _numbers(s, n + rank, dtype).tolist() for s in range(size)
        ]


@ranks(*WORLDS)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_gather_of_complex_tensors_of_one_shape(dtype):
    rank, size = world()
    t = _numbers(rank, 3, dtype) * (1 + 2j)
    got = dist.gather(t, dst=size - 1)
    expected = [(_numbers(r, 3, dtype) * (1 + 2j)).tolist() for r in range(size)]
    assert [p.tolist() for p in got] == (expected if rank == size - 1 else [])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes: compares float8 exactly, NaNs of values it cannot hold included."""
    return t.contiguous().view(torch.uint8)


def _same_bits(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(_bits(got), _bits(expected))


@ranks(*WORLDS)
@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_narrow_dtypes_move_uneven_shapes_in_a_loop(dtype):
    # Uneven calls move bytes, with each rank's dtype and shape in a header: the first
    # call of a kind on a group sends the headers first, later ones in front of the data,
    # and from 256 KiB (40_000 uint64) all_gather moves each rank's bytes by broadcast
    rank, size = world()
    for n in (3, 3, 3, 40_000, 40_000):
        mine = _numbers(rank, n + rank, dtype)
        got = dist.all_gather(mine)
        assert got[rank] is mine
        for r, part in enumerate(got):
            _same_bits(part, _numbers(r, n + r, dtype))
        sent = [_numbers(rank, n + d, dtype).view(-1, 1) for d in range(size)]
        got = dist.all_to_all(sent)
        assert got[rank] is sent[rank]
        for s, part in enumerate(got):
            _same_bits(part, _numbers(s, n + rank, dtype).view(-1, 1))
        splits = [n + d for d in range(size)]
        rows = torch.cat([_numbers(rank, 2 * k, dtype).view(k, 2) for k in splits])
        got = dist.all_to_all_single(rows, input_split_sizes=splits)
        expected = torch.cat([_numbers(s, 2 * (n + rank), dtype).view(-1, 2) for s in range(size)])
        _same_bits(got, expected)
        gathered = dist.gather(mine, dst=size - 1)
        assert len(gathered) == (size if rank == size - 1 else 0)
        for r, part in enumerate(gathered):
            _same_bits(part, _numbers(r, n + r, dtype))


#: Pairs of dtypes ranks pass, at least one of which gloo carries as bytes: as uint8
#: bytes, every one of these looked alike, and uneven calls returned garbage (or
#: failed deep inside torch on one rank) instead of raising.
DIFFERING = [
    (torch.int16, torch.uint16),  # one item size
    (torch.int16, torch.uint32),  # different item sizes
    (torch.uint64, torch.int16),
    (torch.int16, torch.float16),  # a narrow dtype and a native one
    (torch.float8_e4m3fn, torch.uint8),
]


@ranks(2, 3)
@pytest.mark.parametrize("dtypes", DIFFERING, ids=lambda pair: "-".join(map(str, pair)))
def test_uneven_calls_of_narrow_dtypes_differing_across_ranks_fail_on_every_rank(dtypes):
    _settings.set("check", False)  # the backend's own check, beneath the default one
    rank, size = world()
    dtype = dtypes[rank % 2]
    listing = ", ".join(f"rank {r}: {dtypes[r % 2]}" for r in range(size))
    fix = "Cast every rank's tensor to one dtype first"

    def fails(fn: str, what: str = "ranks sent"):
        message = f"{fn}: {what} different dtypes ({listing}) (on rank {rank} of {size}). {fix}"
        return pytest.raises(TypeError, match=re.escape(message))

    group = get_group(range(size), timeout=37)  # fresh in each world: no size history
    for n in (3, 3):  # the first call of each kind (headers first), then with history
        with fails("all_gather"):
            dist.all_gather(_numbers(rank, n + rank, dtype), group=group)
        with fails("all_to_all", "ranks sent this rank"):
            dist.all_to_all([_numbers(rank, n + d, dtype) for d in range(size)], group=group)
        splits = [n + d for d in range(size)]
        with fails("all_to_all_single"):
            data = _numbers(rank, sum(splits), dtype)
            dist.all_to_all_single(data, input_split_sizes=splits, group=group)
        with fails("gather"):
            dist.gather(_numbers(rank, n + rank, dtype), dst=size - 1, group=group)
        # nothing was half-sent: the group works, and its calls now have a size history
        common = dtypes[0]
        got = dist.all_gather(_numbers(rank, n + rank, common), group=group)
        for r, part in enumerate(got):
            _same_bits(part, _numbers(r, n + r, common))
        got = dist.all_to_all([_numbers(rank, n + d, common) for d in range(size)], group=group)
        for s, part in enumerate(got):
            _same_bits(part, _numbers(s, n + rank, common))
        got = dist.all_to_all_single(
            _numbers(rank, sum(splits), common), input_split_sizes=splits, group=group
        )
        start = sum(splits[:rank])  # where each rank's rows for this one begin
        expected = [_numbers(s, sum(splits), common)[start : start + n + rank] for s in range(size)]
        _same_bits(got, torch.cat(expected))


#: dtypes gloo refuses and torch barely computes with: e8m0 (scales, powers of two only)
#: converts to float32; float4_e2m1fn_x2 (two values per byte) has no arithmetic at all
EXOTIC = [getattr(torch, n) for n in ("float8_e8m0fnu", "float4_e2m1fn_x2") if hasattr(torch, n)]


def raw(rank: int, dtype: torch.dtype, n: int = 4) -> torch.Tensor:
    """``n`` values of ``dtype`` that depend on ``rank``, from their bytes."""
    return ((torch.arange(n) + 13 * rank) % 251).to(torch.uint8).view(dtype)


def bits(t: torch.Tensor) -> list[int]:
    return t.view(torch.uint8).tolist()


@ranks(*WORLDS)
@pytest.mark.parametrize("dtype", EXOTIC, ids=str)
def test_dtypes_torch_barely_computes_with_still_move(dtype):
    rank, size = world()
    t = raw(rank, dtype)
    for out in (dist.all_gather(t, same_shape=True), dist.all_gather(t)):
        assert out[rank] is t and [bits(p) for p in out] == [
            bits(raw(r, dtype)) for r in range(size)
        ]
    b = raw(rank, dtype)
    assert dist.broadcast(b, src=size - 1) is b and bits(b) == bits(raw(size - 1, dtype))
    for same_shape in (True, False):
        got = dist.all_to_all(
            [raw(rank + 3 * d, dtype) for d in range(size)], same_shape=same_shape
        )
        assert [bits(p) for p in got] == [bits(raw(s + 3 * rank, dtype)) for s in range(size)]
    rows = dist.all_to_all_single(raw(rank, dtype, 2 * size))  # an even split
    assert bits(rows) == [
        b for s in range(size) for b in bits(raw(s, dtype, 2 * size))[2 * rank : 2 * rank + 2]
    ]
    scattered = dist.scatter([raw(r, dtype) for r in range(size)] if rank == 0 else None)
    assert bits(scattered) == bits(raw(rank, dtype))
    if dtype == getattr(torch, "float8_e8m0fnu", None):  # reduced in float32, rounded once
        powers = [torch.tensor([2.0**r, 2.0 ** (size - r)]) for r in range(size)]
        same(dist.all_reduce(powers[rank].to(dtype), op="max"), torch.stack(powers).amax(0), dtype)
        same(dist.all_reduce(powers[rank].to(dtype)), sum(powers), dtype)
    elif dist.is_distributed():  # float4: nothing to add with, on any rank
        with pytest.raises(TypeError, match="float4_e2m1fn_x2 tensors cannot be reduced"):
            dist.all_reduce(raw(rank, dtype))
        assert dist.all_gather_object(rank) == list(range(size))  # nobody was left waiting
