"""Tensor collectives: each check runs with no process group and on 1 to 4 gloo ranks."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import WORLDS, collective_calls, world

import distkit.dist as dist
from distkit import _settings
from distkit.testing import ranks
from distkit.utils import get_group


@ranks(*WORLDS)
def test_all_reduce_every_op():
    rank, size = world()
    values = [r + 1 for r in range(size)]
    cases = {
        "sum": sum(values),
        "SUM": sum(values),
        "max": max(values),
        "Min": min(values),
        "product": torch.tensor(values).prod().item(),
    }
    for op, expected in cases.items():
        t = torch.tensor([rank + 1, 10 * (rank + 1)])
        out = dist.all_reduce(t, op=op)
        assert out is t, "all_reduce must fill and return the caller's tensor"
        factor = 10 if op != "product" else 10**size
        assert t.tolist() == [expected, expected * factor], op
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, op="mean")
    assert t.item() == pytest.approx(sum(range(size)) / size)
    bits = torch.tensor([1 << rank, 0b1111], dtype=torch.int32)
    assert dist.all_reduce(bits.clone(), op="bor").tolist() == [(1 << size) - 1, 0b1111]
    assert dist.all_reduce(bits.clone(), op="band").tolist() == [1 if size == 1 else 0, 0b1111]
    xor = 0
    for r in range(size):
        xor ^= 1 << r
    assert dist.all_reduce(bits.clone(), op="bxor").tolist()[0] == xor
    t = torch.tensor([rank])
    assert dist.all_reduce(t, op=dist.ReduceOp.MAX).item() == size - 1


@ranks(*WORLDS)
def test_all_reduce_keeps_device_dtype_and_layout():
    rank, size = world()
    base = torch.arange(6, dtype=torch.float64).view(2, 3) * (rank + 1)
    t = base.t()  # non-contiguous: reduced in a staged copy, written back in place
    out = dist.all_reduce(t)
    assert out is t and not t.is_contiguous() and t.stride() == (1, 3)
    assert (out.dtype, out.device) == (torch.float64, torch.device("cpu"))
    expected = torch.arange(6, dtype=torch.float64).view(2, 3).t() * sum(range(1, size + 1))
    assert torch.equal(t, expected)
    z = torch.tensor(complex(rank, 1))
    mean = dist.all_reduce(z, "mean")
    assert (mean.dtype, mean.shape) == (torch.complex64, ())
    assert mean.item() == pytest.approx(complex(sum(range(size)) / size, 1))
    empty = torch.empty(0, 3, dtype=torch.int16)
    reduced = dist.all_reduce(empty)
    assert (reduced.shape, reduced.dtype) == ((0, 3), torch.int16)


@ranks(*WORLDS)
def test_all_reduce_async_handle_returns_the_result():
    rank, size = world()
    t = torch.tensor([rank + 1.0])
    handle = dist.all_reduce(t, async_op=True)
    out = handle.wait()
    assert out is t and t.item() == sum(range(1, size + 1))
    assert handle.is_completed()
    assert handle.wait() is t  # waiting again returns the same result


@ranks(*WORLDS)
def test_all_gather_uneven_shapes_and_own_entry():
    rank, size = world()
    mine = torch.arange((rank + 1) * 2, dtype=torch.float32).view(rank + 1, 2) + rank
    out = dist.all_gather(mine)
    assert len(out) == size and out[rank] is mine
    for r, t in enumerate(out):
        assert torch.equal(t, torch.arange((r + 1) * 2, dtype=torch.float32).view(r + 1, 2) + r)
    # different numbers of dims, and a 0-dim tensor
    mine = torch.tensor(rank) if rank % 2 == 0 else torch.full((rank, 1, 2), rank)
    out = dist.all_gather(mine)
    for r, t in enumerate(out):
        assert t.shape == (() if r % 2 == 0 else (r, 1, 2)) and bool((t == r).all())


@ranks(*WORLDS)
def test_all_gather_large_and_equal_shapes():
    rank, size = world()
    big = torch.full(((rank + 1) * 70_000,), rank, dtype=torch.int32)  # 280 KiB+: broadcasts
    out = dist.all_gather(big)
    assert [t.numel() for t in out] == [(r + 1) * 70_000 for r in range(size)]
    assert all(bool((t == r).all()) for r, t in enumerate(out))
    same = torch.full((3, 2), float(rank))
    out = dist.all_gather(same, async_op=True).wait()
    assert [t.tolist() for t in out] == [[[float(r)] * 2] * 3 for r in range(size)]


@ranks(2, 3)
def test_all_gather_dtype_mismatch_fails_on_every_rank():
    _settings.set("check", False)  # the backend's own check, beneath the default one
    rank = dist.get_rank()
    t = torch.zeros(2, dtype=torch.int64 if rank == 1 else torch.float32)
    with pytest.raises(TypeError, match="ranks sent different dtypes"):
        dist.all_gather(t)
    assert dist.all_gather(torch.ones(1))[rank].item() == 1  # the group still works


@ranks(*WORLDS)
def test_gather_uneven_to_last_rank():
    rank, size = world()
    dst = size - 1
    mine = torch.arange(rank + 2)
    out = dist.gather(mine, dst=dst)
    if rank == dst:
        assert [t.tolist() for t in out] == [list(range(r + 2)) for r in range(size)]
        assert out[rank] is mine
    else:
        assert out == []
    even = dist.gather(torch.tensor([rank]), dst=0)
    assert [t.item() for t in even] == (list(range(size)) if rank == 0 else [])


@ranks(*WORLDS)
def test_broadcast_in_place_from_last_rank():
    rank, size = world()
    t = torch.tensor([rank, rank * 2])
    out = dist.broadcast(t, src=size - 1)
    assert out is t and t.tolist() == [size - 1, 2 * (size - 1)]
    h = dist.broadcast(torch.tensor([float(rank)]), src=0, async_op=True)
    assert h.wait().item() == 0.0


@ranks(*WORLDS)
def test_reduce_to_dst_leaves_other_inputs_alone():
    rank, size = world()
    dst = size // 2
    t = torch.tensor([float(rank + 1)] * 4)
    out = dist.reduce(t, dst=dst, op="sum")
    assert out is t
    if rank == dst:
        assert t.tolist() == [float(sum(range(1, size + 1)))] * 4
    else:
        assert t.tolist() == [float(rank + 1)] * 4
    m = dist.reduce(torch.tensor([float(rank)]), dst=0, op="mean")
    if rank == 0:
        assert m.item() == pytest.approx(sum(range(size)) / size)


@ranks(*WORLDS)
def test_reduce_scatter_list_and_tensor():
    rank, size = world()
    chunks = [torch.tensor([float(r), 1.0]) * (rank + 1) for r in range(size)]
    out = dist.reduce_scatter(chunks)
    total = sum(range(1, size + 1))
    assert out.tolist() == [float(rank * total), float(total)]
    assert chunks[rank].tolist() == [float(rank * (rank + 1)), float(rank + 1)]  # untouched
    flat = torch.arange(size * 2, dtype=torch.float32)
    out = dist.reduce_scatter(flat, op="mean")
    assert out.tolist() == [float(2 * rank), float(2 * rank + 1)]
    assert out.data_ptr() != flat.data_ptr()
    out = dist.reduce_scatter([torch.tensor(r) for r in range(size)], op="max", async_op=True)
    assert out.wait().item() == rank


@ranks(*WORLDS)
def test_all_to_all_uneven_shapes():
    rank, size = world()
    data = [torch.full((rank + 1, dst + 1), rank * 10 + dst) for dst in range(size)]
    out = dist.all_to_all(data)
    assert out[rank] is data[rank]
    for src, t in enumerate(out):
        assert t.shape == (src + 1, rank + 1) and bool((t == src * 10 + rank).all())
    h = dist.all_to_all([torch.tensor([rank * size + d]) for d in range(size)], async_op=True)
    assert [t.item() for t in h.wait()] == [s * size + rank for s in range(size)]


@ranks(*WORLDS)
def test_all_to_all_single_splits():
    rank, size = world()
    # rank r sends (d + 1) rows to rank d; output sizes inferred
    splits = [d + 1 for d in range(size)]
    data = torch.cat([torch.full((d + 1, 2), rank * 100 + d) for d in range(size)])
    out = dist.all_to_all_single(data, input_split_sizes=splits)
    assert out.shape == (size * (rank + 1), 2)
    expected = torch.cat([torch.full((rank + 1, 2), s * 100 + rank) for s in range(size)])
    assert torch.equal(out, expected)
    given = dist.all_to_all_single(data, [rank + 1] * size, splits)
    assert torch.equal(given, expected)
    even = dist.all_to_all_single(torch.arange(size) + rank * size)
    assert even.tolist() == [s * size + rank for s in range(size)]
    assert even.data_ptr() != data.data_ptr()


@ranks(*WORLDS)
def test_scatter_uneven_from_src():
    rank, size = world()
    src = size - 1
    data = [torch.arange(r + 1) * 3 for r in range(size)] if rank == src else None
    out = dist.scatter(data, src=src)
    assert out.tolist() == [3 * i for i in range(rank + 1)]
    if rank == src:
        assert out is data[src]
    even = dist.scatter([torch.tensor([r]) for r in range(size)] if rank == 0 else None)
    assert even.item() == rank
    h = dist.scatter([torch.ones(2) * r for r in range(size)] if rank == 0 else None, async_op=True)
    assert h.wait().tolist() == [float(rank)] * 2


@ranks(*WORLDS)
def test_barrier_and_rank_list_groups():
    rank, size = world()
    dist.barrier()
    everyone = list(range(size))
    assert dist.all_reduce(torch.tensor([1]), group=everyone).item() == size
    assert dist.get_world_size(everyone) == size and dist.get_rank(everyone) == rank
    if size >= 3:
        evens = [r for r in range(size) if r % 2 == 0]
        from distkit.utils import get_group

        group = get_group(evens)  # collective: every rank creates it
        assert get_group(list(reversed(evens))) is group  # cached, order-insensitive
        if rank in evens:
            out = dist.all_gather(torch.tensor([rank]), group=evens)
            assert [t.item() for t in out] == evens
            assert dist.get_rank(evens) == evens.index(rank)
            b = dist.broadcast(torch.tensor([rank]), src=1, group=group)
            assert b.item() == evens[1]
        else:
            with pytest.raises(ValueError, match="not a member of group"):
                dist.all_gather(torch.tensor([rank]), group=evens)


# -- bad arguments: the same error in every world ------------------------------------


def raises(exc, fn, *args, **kwargs) -> str:
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    return str(info.value)


@ranks(*WORLDS)
def test_bad_arguments_fail_before_communicating():
    rank, size = world()
    where = f"(on rank {rank} of {size})"
    t = torch.ones(2)
    msg = raises(TypeError, dist.all_reduce, [1, 2])
    assert (
        msg.startswith("all_reduce: data must be a torch.Tensor, got a list of 2") and where in msg
    )
    msg = raises(ValueError, dist.all_reduce, t, op="median")
    assert msg.startswith("all_reduce: unknown op 'median'") and "sum, mean, max" in msg
    msg = raises(TypeError, dist.all_reduce, t, op="bxor")
    assert "needs an integer or bool" in msg
    msg = raises(TypeError, dist.all_reduce, torch.ones(1, dtype=torch.complex64), op="max")
    assert "not defined for complex" in msg
    msg = raises(ValueError, dist.broadcast, t, src=size)
    assert f"broadcast: src={size} is out of range for a group of size {size}" in msg
    assert f"from 0 to {size - 1}" in msg
    raises(ValueError, dist.reduce, t, dst=-1)
    raises(TypeError, dist.gather, t, dst="0")
    msg = raises(ValueError, dist.all_to_all, [t] * (size + 1))
    assert f"data must hold {size} tensors (one per rank), got {size + 1}" in msg
    raises(TypeError, dist.all_to_all, t)
    if size > 1:
        msg = raises(
            TypeError, dist.all_to_all, [t] * (size - 1) + [torch.ones(2, dtype=torch.int8)]
        )
        assert f"data mixes dtypes: data[0] is torch.float32, data[{size - 1}] is torch.int8" in msg
    if size > 1:
        msg = raises(
            ValueError, dist.reduce_scatter, [torch.ones(2)] * (size - 1) + [torch.ones(3)]
        )
        assert "data mixes shapes: data[0] is (2,), data[" in msg
    if size > 1:
        msg = raises(ValueError, dist.reduce_scatter, torch.ones(size * 2 + 1))
        assert "does not divide evenly by the group size" in msg
    msg = raises(ValueError, dist.reduce_scatter, torch.tensor(1.0))
    assert "does not divide evenly" in msg
    rows = torch.arange(size * 2)
    msg = raises(ValueError, dist.all_to_all_single, rows, input_split_sizes=[3] * size)
    assert f"input_split_sizes {[3] * size} sums to {3 * size}, but the tensor has" in msg
    msg = raises(
        ValueError, dist.all_to_all_single, rows, input_split_sizes=[-1] + [0] * (size - 1)
    )
    assert "input_split_sizes[0]=-1 is negative" in msg
    msg = raises(ValueError, dist.all_to_all_single, rows, input_split_sizes=[2] * (size + 1))
    assert f"must hold {size} sizes" in msg
    raises(TypeError, dist.all_to_all_single, rows, output_split_sizes=[1.5] * size)
    raises(TypeError, dist.all_gather, "tensor")
    raises(TypeError, dist.all_gather, t, group="world")
    msg = raises(ValueError, dist.all_gather, t, group=[0, size])
    assert f"rank {size} is out of range" in msg
    # src's bad list reaches every rank: src raises its own error, the others one naming it
    msg = raises(ValueError, dist.scatter, [t] * (size + 1) if rank == 0 else None, src=0)
    if rank == 0:
        assert f"data must hold {size} tensors (one per rank), got {size + 1}" in msg
    else:
        assert "scatter: src (rank 0) passed bad arguments: data must hold" in msg
        assert where in msg
    # after all those errors, the group still works: nothing was half-sent
    assert dist.all_reduce(torch.ones(1)).item() == size


@ranks(*WORLDS)
def test_same_shape_skips_the_shape_round():
    rank, size = world()
    t = torch.full((2, 3), float(rank))
    with collective_calls() as calls:
        out = dist.all_gather(t, same_shape=True)
    assert out[rank] is t and [o[0, 0].item() for o in out] == [float(r) for r in range(size)]
    assert calls == ([] if size == 0 or not dist.is_distributed() else ["all_gather_single"])
    fresh = get_group(range(size), timeout=31) if size else None  # no size history yet
    with collective_calls() as calls:
        dist.all_gather(t, group=fresh)
    if dist.is_distributed():  # without the promise: the shapes go too
        assert calls == ["all_gather_single", "all_gather_single"], calls
    big = torch.full((70_000,), rank, dtype=torch.int32)  # the broadcast path
    with collective_calls() as calls:
        assert [o[0].item() for o in dist.all_gather(big, same_shape=True)] == list(range(size))
    if dist.is_distributed():
        assert calls == ["broadcast"] * size, calls
    with collective_calls() as calls:
        g = dist.gather(torch.tensor([rank, rank]), dst=size - 1, same_shape=True)
    assert [o.tolist() for o in g] == ([[r, r] for r in range(size)] if rank == size - 1 else [])
    if dist.is_distributed():
        assert calls == ["gather"], calls
    with collective_calls() as calls:
        rows = dist.all_to_all(
            [torch.tensor([rank * 10 + d]) for d in range(size)], same_shape=True
        )
    assert [o.item() for o in rows] == [s * 10 + rank for s in range(size)]
    if dist.is_distributed():
        assert calls == ["all_to_all_single"], calls
    with collective_calls() as calls:
        dist.all_to_all([torch.tensor([rank * 10 + d]) for d in range(size)], group=fresh)
    if dist.is_distributed():  # without the promise: the shapes go too, then the data,
        # of which one rank alone has none to move (its own chunk comes back as passed)
        assert calls == ["all_to_all_single"] * (2 if size > 1 else 1), calls
    if size > 1:
        with pytest.raises(ValueError, match="data mixes shapes"):
            dist.all_to_all([torch.ones(1)] * (size - 1) + [torch.ones(2)], same_shape=True)


@ranks(*WORLDS)
def test_mean_keeps_the_dtype_as_mmengine_does():
    rank, size = world()
    ints = torch.tensor([rank + 1, -(rank + 1), 7], dtype=torch.int64)
    out = dist.all_reduce(ints, op="mean")
    total = sum(range(1, size + 1))
    assert out is ints and ints.dtype == torch.int64
    # truncation toward zero, like mmengine's float division copied back into the ints
    assert ints.tolist() == [int(total / size), int(-total / size), 7]
    small = dist.all_reduce(torch.tensor([rank], dtype=torch.int8), op="mean")
    assert small.dtype == torch.int8 and small.item() == int(sum(range(size)) / size)
    flags = dist.all_reduce(torch.tensor([rank == 0, False]), op="mean")
    assert flags.tolist() == [True, False]  # the or of the ranks' bools
    big = torch.tensor([2**53 + 1], dtype=torch.int64)  # exact, where float32 is not
    assert dist.all_reduce(big, op="mean").item() == 2**53 + 1
    chunks = dist.reduce_scatter(torch.full((size * 2,), rank + 1), op="mean")
    assert chunks.tolist() == [int(total / size)] * 2


@ranks(*WORLDS)
def test_reduce_scatter_every_op():
    rank, size = world()
    for op, combine in (
        ("sum", sum),
        ("max", max),
        ("min", min),
        ("product", lambda vs: __import__("math").prod(vs)),
    ):
        chunks = [torch.tensor([(rank + 1) * (r + 1), -rank]) for r in range(size)]
        out = dist.reduce_scatter(chunks, op=op)
        values = [[(k + 1) * (rank + 1), -k] for k in range(size)]
        assert out.tolist() == [combine(v[0] for v in values), combine(v[1] for v in values)], op
    bits = torch.tensor([1 << rank] * size * 2, dtype=torch.int32)
    expected = {"band": 0 if size > 1 else 1, "bor": (1 << size) - 1, "bxor": (1 << size) - 1}
    for op, value in expected.items():
        assert dist.reduce_scatter(bits, op=op).tolist() == [value, value], op


def _uneven_rows(rank: int, size: int, extra: int) -> list[torch.Tensor]:
    return [torch.full((rank + d + 1 + extra, 2), rank * 10 + d) for d in range(size)]


@ranks(2, 3)
def test_uneven_shapes_travel_beside_the_data_after_the_first_call():
    rank, size = world()
    group = get_group(range(size), timeout=29)  # a fresh group: no history yet

    def check_gather(extra: int):
        mine = torch.arange((rank + 1 + extra) * 3).view(-1, 3) + rank
        out = dist.all_gather(mine, group=group)
        for r, t in enumerate(out):
            assert torch.equal(t, torch.arange((r + 1 + extra) * 3).view(-1, 3) + r)

    def check_a2a(extra: int):
        out = dist.all_to_all(_uneven_rows(rank, size, extra), group=group)
        for s, t in enumerate(out):
            assert t.shape == (s + rank + 1 + extra, 2) and bool((t == s * 10 + rank).all())

    # all_gather's header round is asynchronous ("~"); all_to_all's is not
    for check, name, header in (
        (check_gather, "all_gather_single", "all_gather_single~"),
        (check_a2a, "all_to_all_single", "all_to_all_single"),
    ):
        # 1st call: nothing to predict from: the shapes, then the data (two rounds)
        with collective_calls(mark_async=True) as first:
            check(0)
        assert first == [header, name], first
        # same sizes again: one collective, each header in front of its data
        with collective_calls(mark_async=True) as again:
            check(0)
        assert again == [header], again
        # smaller: still one collective (padded); larger: the rest follows in a second one
        with collective_calls(mark_async=True) as smaller:
            check(-1 if check is check_a2a else 0)
        assert smaller == [header], smaller
        with collective_calls(mark_async=True) as larger:
            check(5)
        assert larger == [header, name], larger


@ranks(2, 3)
def test_all_to_all_single_infers_output_splits_beside_the_data():
    rank, size = world()
    splits = [d + rank + 1 for d in range(size)]
    data = torch.cat([torch.full((n, 2), rank * 100 + d) for d, n in enumerate(splits)])
    for _ in range(3):
        out = dist.all_to_all_single(data, input_split_sizes=splits)
        expected = torch.cat([torch.full((rank + s + 1, 2), s * 100 + rank) for s in range(size)])
        assert torch.equal(out, expected)


@ranks(2, 3)
def test_all_to_all_single_dtype_or_row_shape_mismatch_fails_on_every_rank():
    # Inferring the output sizes, each rank learns every rank's dtype and row shape from
    # the headers; once they reinterpreted other ranks' bytes as this rank's (garbage,
    # or a reshape error on some ranks only). The backend's own check, beneath the
    # default one (which catches the dtype first on the calls it checks)
    _settings.set("check", False)
    rank, size = world()
    splits = [rank + 1] * size  # rank r sends r + 1 rows to each rank

    def data(dtype=torch.float32, row=(3,)):
        return torch.full((size * (rank + 1), *row), float(rank), dtype=dtype)

    def fails(exc, what, fix):
        message = f"all_to_all_single: {what} (on rank {rank} of {size}). {fix}"
        return pytest.raises(exc, match=re.escape(message))

    def rows_differ(shapes, tail=""):
        listing = ", ".join(f"rank {r}: {shapes[r % 2]}" for r in range(size)) + tail
        return fails(
            ValueError,
            f"ranks sent rows of different shapes ({listing})",
            "Every rank's data must have the same shape after dim 0",
        )

    group = get_group(range(size), timeout=38)  # fresh in each world: no size history
    for _ in range(2):  # without, then with, a size history on the group
        dtypes = ", ".join(f"rank {r}: torch.float{64 if r == 1 else 32}" for r in range(size))
        with fails(TypeError, f"ranks sent different dtypes ({dtypes})", "Cast every rank"):
            dtype = torch.float64 if rank == 1 else torch.float32
            dist.all_to_all_single(data(dtype), input_split_sizes=splits, group=group)
        with rows_differ(["(3,)", "(4,)"]):
            dist.all_to_all_single(data(row=(3 + rank % 2,)), input_split_sizes=splits, group=group)
        with rows_differ(["(4,)", "(2, 2)"]):  # as many bytes per row
            row = (2, 2) if rank % 2 else (4,)
            dist.all_to_all_single(data(row=row), input_split_sizes=splits, group=group)
        # rows that differ only beyond the dims a header holds are named by their first,
        # and the message says where they differ
        with rows_differ(["(1, 1, 1, 1, ...) (6 dims)"] * 2, "; they differ after dim 4 of a row"):
            row = (1, 1, 1, 1, 2, 3) if rank % 2 else (1, 1, 1, 1, 3, 2)
            dist.all_to_all_single(data(row=row), input_split_sizes=splits, group=group)
        # nothing was half-sent: the group still works
        out = dist.all_to_all_single(data(), input_split_sizes=splits, group=group)
        expected = torch.cat([torch.full((s + 1, 3), float(s)) for s in range(size)])
        assert torch.equal(out, expected)


@ranks(*WORLDS)
def test_all_to_all_single_of_zero_width_rows():
    # rows of 0 bytes: the row counts come from the headers, not from the bytes
    rank, size = world()
    splits = [rank + d for d in range(size)]  # rank 0 sends itself no rows
    expected_rows = sum(s + rank for s in range(size))
    for row in ((0,), (2, 0)):
        data = torch.empty((sum(splits), *row), dtype=torch.int64)
        for _ in range(3):  # the first call of its kind on the group, then with history
            out = dist.all_to_all_single(data, input_split_sizes=splits)
            assert out.shape == (expected_rows, *row) and out.dtype == torch.int64
        out = dist.all_to_all_single(data, [s + rank for s in range(size)], splits)
        assert out.shape == (expected_rows, *row)
        even = dist.all_to_all_single(torch.empty((2 * size, *row)))
        assert even.shape == (2 * size, *row)


@ranks(*WORLDS)
def test_gather_leaves_the_callers_tensor_alone_on_dst():
    # td.gather copies every input into the output list, dst's own too: had dst's slot
    # been the caller's tensor, autograd would see an in-place write and an inference
    # tensor would be refused
    rank, size = world()
    x = torch.tensor([1.0 + rank, 2.0], requires_grad=True)
    y = x * 2
    loss = (y * y).sum()  # saves y for backward
    version = y._version
    got = dist.gather(y, dst=0)
    assert y._version == version
    loss.backward()
    assert x.grad.tolist() == [8.0 * (1 + rank), 16.0]
    if rank == 0:
        assert got[0] is y
        assert [p.tolist() for p in got] == [[2.0 * (1 + r), 4.0] for r in range(size)]
    with torch.inference_mode():
        frozen = torch.full((2,), float(rank))
    got = dist.gather(frozen, dst=0)
    assert [p.tolist() for p in got] == ([[float(r)] * 2 for r in range(size)] if rank == 0 else [])


@ranks(2, 3)
def test_async_uneven_all_gathers_waited_in_any_order_on_each_rank():
    # torch lets each rank wait on its handles whenever it likes: a second round or a
    # size history taken at wait() would pair up different calls across ranks
    rank, size = world()
    for _ in range(3):  # from the second call, sizes are predicted from the history
        a = dist.all_gather(torch.full((rank + 1,), 100.0 + rank), async_op=True)
        b = dist.all_gather(torch.full((2 * rank + 50_000,), 200.0 + rank), async_op=True)
        if rank % 2:  # odd ranks wait in reverse, and after a blocking call
            c = dist.all_gather(torch.tensor([rank]))
            got_b, got_a = b.wait(), a.wait()
        else:
            got_a, got_b = a.wait(), b.wait()
            c = dist.all_gather(torch.tensor([rank]))
        assert [p.tolist() for p in got_a] == [[100.0 + r] * (r + 1) for r in range(size)]
        assert [p.shape[0] for p in got_b] == [2 * r + 50_000 for r in range(size)]
        assert [set(p.tolist()) for p in got_b] == [{200.0 + r} for r in range(size)]
        assert [p.tolist() for p in c] == [[r] for r in range(size)]


@ranks(2, 3)
def test_all_to_all_keeps_this_ranks_own_chunk_out_of_the_collective(monkeypatch):
    """A rank's own chunk comes back as passed, so it is never copied into the send buffer
    nor sent to itself: its split is 0 bytes (same shapes) or its header alone (uneven)."""
    import torch.distributed as td

    from distkit.dist.backends import uneven as _uneven

    rank, size = world()
    splits = []
    real = td.all_to_all_single

    def spy(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        splits.append((output_split_sizes, input_split_sizes))
        return real(output, input, output_split_sizes, input_split_sizes, **kwargs)

    monkeypatch.setattr(td, "all_to_all_single", spy)
    monkeypatch.setattr(_uneven.td, "all_to_all_single", spy)
    chunks = [torch.full((1000,), float(rank * 10 + d)) for d in range(size)]
    out = dist.all_to_all(chunks, same_shape=True)
    assert out[rank] is chunks[rank]
    assert [o[0].item() for o in out] == [s * 10.0 + rank for s in range(size)]
    assert splits[-1][0][rank] == splits[-1][1][rank] == 0
    for _ in range(3):  # uneven: the first call learns the sizes, then one round each
        chunks = [torch.full((1000 + 10 * d,), float(rank * 10 + d)) for d in range(size)]
        out = dist.all_to_all(chunks)
        assert out[rank] is chunks[rank]
        for s in range(size):
            assert out[s].tolist() == [s * 10.0 + rank] * (1000 + 10 * rank)
    out_splits, in_splits = splits[-1]
    head = out_splits[rank]
    assert head == in_splits[rank] and head < 512, splits  # a header, no data
    assert all(n >= 4000 + head for r, n in enumerate(out_splits) if r != rank)


@ranks(*WORLDS)
def test_one_element_tensors_of_any_stride_move(monkeypatch):
    """torch calls a tensor of at most one element contiguous whatever its stride
    (``x[:, 0]`` of a batch of 1); its bytes are still read with stride 1."""
    rank, size = world()

    def odd(r, n=1):  # shape (n,), stride (4,): column 1 of an (n, 4) matrix
        return (torch.arange(4.0 * n).reshape(n, 4) + 100 * r)[:, 1]

    def want(r, n=1):
        return [100.0 * r + 1 + 4 * i for i in range(n)]

    assert odd(rank).stride() == (4,) and odd(rank).is_contiguous()
    assert [o.tolist() for o in dist.all_gather(odd(rank))] == [want(r) for r in range(size)]
    mixed = odd(rank) if rank % 2 else odd(rank, 3)[:0]  # one element, or none
    assert [o.tolist() for o in dist.all_gather(mixed)] == [
        want(r) if r % 2 else [] for r in range(size)
    ]
    got = dist.all_to_all([odd(rank + 10 * d) for d in range(size)])
    assert [g.tolist() for g in got] == [want(s + 10 * rank) for s in range(size)]
    g = dist.gather(odd(rank), dst=0)
    assert [o.tolist() for o in g] == ([want(r) for r in range(size)] if rank == 0 else [])
    splits = [1 if d == 0 else 0 for d in range(size)]
    rows = dist.all_to_all_single(odd(rank), input_split_sizes=splits)
    assert rows.tolist() == ([x for r in range(size) for x in want(r)] if rank == 0 else [])
    expanded = torch.tensor(5.0 + rank).expand(1)  # stride (0,)
    assert [o.tolist() for o in dist.all_gather(expanded)] == [[5.0 + r] for r in range(size)]
    obj = dist.all_gather_object({"t": odd(rank)})
    assert [o["t"].tolist() for o in obj] == [want(r) for r in range(size)]
