"""CUDA tensors and the nccl backend: skipped on a machine without a GPU (CI has none).

NCCL refuses two ranks on one GPU, so nccl worlds larger than one need as many GPUs as
ranks; with fewer, those worlds are skipped. CUDA tensors on gloo ranks run with one GPU:
gloo communicates through the CPU and distkit moves the data there and back.
"""

from __future__ import annotations

import pytest
import torch
from conftest import world

import distkit.dist as dist
from distkit.testing import ranks
from distkit.utils import cast_data_device, get_comm_device, get_data_device

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device")

#: nccl worlds this machine can hold: one GPU per rank
NCCL_WORLDS = tuple(n for n in (1, 2, 4) if n <= max(GPUS, 1))


def _cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _tensor_collectives_keep_device_and_values() -> None:
    rank, size = world()
    dev = _cuda()
    ranks_sum = sum(range(1, size + 1))

    t = torch.full((3,), float(rank + 1), device=dev)
    assert dist.all_reduce(t) is t and t.device == dev
    assert t.tolist() == [float(ranks_sum)] * 3
    t = torch.full((2,), float(rank), device=dev)
    dist.all_reduce(t, op="mean")
    assert t.tolist() == pytest.approx([sum(range(size)) / size] * 2)

    # a CPU tensor on an nccl group goes to the GPU and comes back in place
    c = torch.tensor([rank + 1.0])
    assert dist.all_reduce(c) is c and c.device.type == "cpu" and c.item() == ranks_sum

    mine = torch.arange(rank + 1, dtype=torch.float32, device=dev)  # uneven lengths
    out = dist.all_gather(mine)
    assert len(out) == size and out[rank] is mine
    for r, got in enumerate(out):
        assert got.device == dev and got.tolist() == list(range(r + 1))

    b = torch.full((4,), float(rank), device=dev)
    assert dist.broadcast(b, src=size - 1).tolist() == [float(size - 1)] * 4

    r = dist.reduce(torch.full((2,), 1.0, device=dev), dst=0)
    if rank == 0:
        assert r.tolist() == [float(size)] * 2

    g = dist.gather(torch.tensor([rank], device=dev), dst=0)
    assert [x.item() for x in g] == (list(range(size)) if rank == 0 else [])

    rs = dist.reduce_scatter(torch.arange(2 * size, dtype=torch.float32, device=dev))
    assert rs.device == dev and rs.tolist() == [2.0 * rank * size, (2.0 * rank + 1) * size]

    sent = [torch.full((r + 1,), float(rank), device=dev) for r in range(size)]
    got = dist.all_to_all(sent)
    assert [x.tolist() for x in got] == [[float(r)] * (rank + 1) for r in range(size)]
    assert all(x.device == dev for x in got)

    pieces = [torch.tensor([float(r)], device=dev) for r in range(size)]
    sc = dist.scatter(pieces if rank == 0 else None, src=0)
    assert sc.device == dev and sc.item() == rank
    dist.barrier()


def _objects_with_cuda_tensors() -> None:
    rank, size = world()
    dev = _cuda()
    mine = {"rank": rank, "t": torch.full((2,), float(rank), device=dev)}

    everyone = dist.all_gather_object(mine)
    assert [o["rank"] for o in everyone] == list(range(size))
    for r, o in enumerate(everyone):
        assert o["t"].device.type == "cuda" and o["t"].tolist() == [float(r)] * 2

    got = dist.broadcast_object(mine if rank == 0 else None, src=0)
    assert got["rank"] == 0 and got["t"].device.type == "cuda" and got["t"].tolist() == [0.0] * 2

    objs = [{"big": torch.arange(300_000, device=dev)}, "x"] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    assert objs[1] == "x" and torch.equal(objs[0]["big"].cpu(), torch.arange(300_000))

    gathered = dist.gather_object(rank * 10, dst=0)
    assert gathered == ([r * 10 for r in range(size)] if rank == 0 else None)

    results = [torch.tensor([i], device=dev) for i in range(rank, 10, size)]
    collected = dist.collect_results(results, 10)
    if rank == 0:
        assert [x.item() for x in collected] == list(range(10))
    streamed = [x.item() for x in dist.iter_results(results, 10)]
    assert streamed == (list(range(10)) if rank == 0 else [])


def _device_helpers() -> None:
    dev = _cuda()
    assert get_comm_device() == (dev if dist.get_backend() == "nccl" else torch.device("cpu"))
    nested = {"a": [torch.ones(1, device=dev)], "b": (torch.zeros(2),)}
    with pytest.raises(ValueError, match="different devices"):
        get_data_device(nested)
    moved = cast_data_device(nested, "cpu")
    assert get_data_device(moved) == torch.device("cpu")
    back = cast_data_device(moved, dev)
    assert get_data_device(back).type == "cuda" and back["a"][0].item() == 1.0


def _point_to_point_on_the_gpu() -> None:
    """Rings of changing shapes (past every capacity: NCCL needs exact sizes, so frames are
    padded or sent in two messages), objects with CUDA tensors, and send/recv in order."""
    rank, size = world()
    dev = _cuda()
    home = dev if dist.get_backend() == "nccl" else torch.device("cpu")  # the comm device
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    for step, n in enumerate([3, 3, 3, 100_000, 0, 2_000_000, 2_000_000, 7]):
        mine = torch.full((n + rank,), float(rank * 10 + step), device=dev)
        got = dist.exchange({nxt: mine}, [prv])[prv]
        if prv == rank:
            assert got is mine
            continue
        assert got.device == home and got.shape == (n + prv,)
        assert bool((got == float(prv * 10 + step)).all())
    obj = {"r": rank, "x": torch.arange(4, device=dev) + rank, "big": torch.ones(300_000)}
    got = dist.exchange({nxt: obj}, [prv])[prv]
    assert got["r"] == prv and got["x"].cpu().tolist() == [prv + i for i in range(4)]
    assert torch.equal(got["big"].cpu(), torch.ones(300_000))
    if size == 1:
        with pytest.raises(ValueError, match="is this rank"):
            dist.send(torch.ones(1, device=dev), 0)
        return
    sizes = [5, 5, 1 << 20, 1, 0]
    if rank == 0:
        for n in sizes:
            dist.send(torch.arange(n, dtype=torch.int32, device=dev), 1)
        dist.isend(torch.ones(2, 3, dtype=torch.bfloat16, device=dev).t(), 1).wait()
        dist.send({"t": torch.ones(2, device=dev)}, 1)
    elif rank == 1:
        for n in sizes:
            t = dist.recv(0)
            assert t.device == home and t.dtype == torch.int32
            assert torch.equal(t.cpu(), torch.arange(n, dtype=torch.int32))
        t = dist.irecv(0).wait()
        assert t.device == home and t.shape == (3, 2) and t.dtype == torch.bfloat16
        assert t.is_contiguous() and bool((t == 1).all())
        assert dist.recv(0)["t"].cpu().tolist() == [1.0, 1.0]
    dist.barrier()


@ranks(*NCCL_WORLDS, timeout=120, backend="nccl")
def test_nccl_point_to_point():
    _point_to_point_on_the_gpu()


@ranks(0, 2, 3, timeout=120)
def test_cuda_point_to_point_on_gloo():
    _point_to_point_on_the_gpu()


@ranks(*NCCL_WORLDS, timeout=120, backend="nccl")
def test_nccl_tensor_collectives():
    assert dist.get_backend() == "nccl"
    _tensor_collectives_keep_device_and_values()


@ranks(*NCCL_WORLDS, timeout=120, backend="nccl")
def test_nccl_object_collectives():
    _objects_with_cuda_tensors()


@ranks(*NCCL_WORLDS, timeout=120, backend="nccl")
def test_nccl_device_helpers():
    _device_helpers()


@ranks(0, 2, 3, timeout=120)
def test_cuda_tensors_on_gloo():
    _tensor_collectives_keep_device_and_values()


@ranks(0, 2, 3, timeout=120)
def test_cuda_objects_on_gloo():
    _objects_with_cuda_tensors()


@ranks(0, 2, timeout=120)
def test_cuda_device_helpers_on_gloo():
    _device_helpers()
