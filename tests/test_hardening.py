"""Errors instead of hangs: one rank's bad input raises on every rank, within seconds.

Each case here once left the other ranks waiting for the collective timeout (30
minutes by default), computed garbage, or aborted the process.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import WORLDS, debug_mode, mismatch, world

import distkit.dist as dist
from distkit.testing import ranks


def raised(exc, call) -> str:
    """Run ``call``, which must raise ``exc`` within a few seconds; return the message."""
    start = time.monotonic()
    with pytest.raises(exc) as info:
        call()
    assert time.monotonic() - start < 10, "raised only after waiting on the other ranks"
    return str(info.value)


@ranks(1, 2, 3)
def test_scatter_with_bad_data_on_src_raises_on_every_rank():
    rank, size = world()
    src = size - 1
    bad = {
        "None": (TypeError, None, "data must be a list of"),
        "too long": (ValueError, [torch.ones(1)] * (size + 1), f"must hold {size} tensors"),
        "mixed dtypes": (
            TypeError,
            [torch.ones(1)] * (size - 1) + [torch.ones(1, dtype=torch.int8)],
            "data mixes dtypes",
        ),
    }
    for label, (exc, data, text) in bad.items():
        if label == "mixed dtypes" and size == 1:
            continue
        msg = raised(exc, lambda d=data: dist.scatter(d if rank == src else None, src=src))
        assert text in msg, (label, msg)
        if rank != src:
            assert f"src (rank {src}) passed bad arguments: " in msg, msg
    # the group is intact afterwards
    assert dist.scatter([torch.tensor([r]) for r in range(size)] if rank == 0 else None) == rank


@ranks(1, 2, 3)
def test_scatter_object_list_with_bad_data_on_src_raises_on_every_rank():
    rank, size = world()
    for exc, data, text in (
        (TypeError, None, "data must be a list of"),
        (ValueError, list(range(size + 1)), f"data must hold {size} objects"),
    ):
        msg = raised(exc, lambda d=data: dist.scatter_object_list(d if rank == 0 else None))
        assert text in msg
        if rank != 0:
            assert f"scatter_object_list: rank 0 passed bad arguments: {text}" in msg, msg
    assert dist.scatter_object_list(list(range(size)) if rank == 0 else None) == rank


class Hostile:
    """Unpicklable, and its ``__getattr__`` raises KeyError, not AttributeError."""

    def __init__(self) -> None:
        self.lock = __import__("threading").Lock()

    def __getattr__(self, name):
        raise KeyError(name)


@ranks(*WORLDS)
def test_unpicklable_object_with_a_hostile_getattr_fails_on_every_rank():
    rank, size = world()
    last = size - 1
    obj = Hostile() if rank == last else {"ok": rank}
    msg = raised(TypeError, lambda: dist.all_gather_object(obj))
    if rank == last:
        assert "cannot be pickled" in msg
    else:
        assert f"rank {last} could not send its object" in msg
    assert dist.all_gather_object(rank) == list(range(size))


@ranks(*WORLDS)
def test_more_than_25_dims_work_in_every_collective():
    rank, size = world()
    many = torch.arange(2 * (rank + 1)).reshape([1] * 29 + [rank + 1, 2])  # 31 dims
    out = dist.all_gather(many)
    assert [tuple(t.shape) for t in out] == [(1,) * 29 + (r + 1, 2) for r in range(size)]
    assert all(torch.equal(t.flatten(), torch.arange(2 * (r + 1))) for r, t in enumerate(out))
    got = dist.gather(many, dst=0)
    assert [t.dim() for t in got] == ([31] * size if rank == 0 else [])
    rows = [torch.full([1] * (26 + d), rank) for d in range(size)]  # 26 + d dims to rank d
    back = dist.all_to_all(rows)
    assert [t.dim() for t in back] == [26 + rank] * size
    assert [int(t.flatten()[0]) for t in back] == list(range(size))
    mine = dist.scatter([torch.zeros([1] * (30 + r)) for r in range(size)] if rank == 0 else None)
    assert mine.dim() == 30 + rank


@ranks(*WORLDS)
def test_all_reduce_dict_with_different_keys_raises_on_every_rank():
    rank, size = world()
    data = {"a": torch.tensor(1.0), ("b" if rank == 0 else "c"): torch.tensor(2.0)}
    if size == 1 or not dist.is_distributed():
        assert dist.all_reduce_dict(data) is data  # one rank: nothing to disagree with
        return
    msg = raised(ValueError, lambda: dist.all_reduce_dict(data))
    assert "the ranks passed dicts with different keys, dtypes or shapes" in msg
    assert "rank 0: {'a': torch.float32 (), 'b': torch.float32 ()}" in msg
    assert "rank 1: {'a': torch.float32 (), 'c': torch.float32 ()}" in msg
    # shapes and dtypes count too; an empty dict on one rank as well
    for odd in ({"a": torch.ones(2)}, {"a": torch.tensor(1)}, {}):
        raised(
            ValueError, lambda o=odd: dist.all_reduce_dict(o if rank == 1 else {"a": torch.ones(1)})
        )
    same = dist.all_reduce_dict({"a": torch.tensor(1.0)})
    assert same["a"].item() == size


@ranks(2, 3)
def test_debug_mode_catches_inconsistent_all_to_all_single_splits():
    rank, size = world()
    data = torch.arange(2 * size)
    # rank 1 expects 3 rows from rank 0, which sends it 2
    wrong = [3 if (rank == 1 and s == 0) else 2 for s in range(size)]
    msg = mismatch(lambda: dist.all_to_all_single(data, wrong, [2] * size))
    assert "rank 1 expects 3 rows from rank 0, which sends it 2" in msg
    # different rows per rank with even splits: each expects as many as it sends
    uneven = torch.arange(size * (rank + 1))
    mismatch(lambda: dist.all_to_all_single(uneven))
    # what is consistent passes
    with debug_mode():
        out = dist.all_to_all_single(torch.arange(size) + 10 * rank)
    assert out.tolist() == [10 * s + rank for s in range(size)]


@ranks(2, 3)
def test_debug_mode_catches_dtype_mismatches_before_the_backend_runs():
    rank, _ = world()
    dtype = torch.float64 if rank == 1 else torch.float32
    msg = mismatch(lambda: dist.broadcast(torch.ones(3, dtype=dtype)))
    assert "They must agree on: data.dtype" in msg
    # raw torch aborts the process on this one (SIGABRT); debug mode raises first
    msg = mismatch(lambda: dist.all_reduce(torch.ones(3, dtype=dtype)))
    assert "They must agree on: data.dtype" in msg
    assert dist.all_reduce(torch.ones(1)).item() == dist.get_world_size()


# -- autograd: the same result in every world ------------------------------------------


@ranks(*WORLDS)
def test_tensors_that_require_grad_give_results_without_autograd_history():
    rank, size = world()
    leaf = torch.ones(2, requires_grad=True)
    out = dist.all_gather(leaf)
    assert out[rank] is leaf
    assert all(not t.requires_grad for r, t in enumerate(out) if r != rank)
    got = dist.gather(torch.ones(2, requires_grad=True), dst=0)
    assert all(t.grad_fn is None for t in got)
    mean = dist.all_reduce(leaf, op="mean")  # in place into a leaf that requires grad
    assert mean is leaf and leaf.is_leaf and leaf.requires_grad and leaf.grad_fn is None
    assert leaf.tolist() == [1.0, 1.0]
    nonleaf = torch.ones(2, requires_grad=True) * 2
    history = nonleaf.grad_fn
    assert dist.all_reduce(nonleaf, op="mean").grad_fn is history  # no new history
    chunk = dist.reduce_scatter(torch.ones(2 * size, requires_grad=True))
    assert not chunk.requires_grad and chunk.grad_fn is None
    moved = dist.all_to_all_single(torch.ones(size, requires_grad=True))
    assert not moved.requires_grad


@ranks(*WORLDS)
def test_expanded_tensors_are_reduced_and_broadcast_in_place():
    rank, size = world()
    t = torch.full((1,), float(rank + 1)).expand(3)  # three elements, one memory location
    out = dist.all_reduce(t)
    assert out is t and t.tolist() == [float(sum(range(1, size + 1)))] * 3
    b = torch.full((2, 1), float(rank)).expand(2, 4)
    assert dist.broadcast(b, src=size - 1) is b and b.tolist() == [[float(size - 1)] * 4] * 2
    gathered = dist.all_gather(torch.ones(1).expand(3))
    assert [g.tolist() for g in gathered] == [[1.0] * 3] * size
    if size > 1:  # ranks that expand differently: the result cannot be written in place
        mixed = torch.ones(1).expand(3) if rank == 0 else torch.arange(3.0)
        if rank == 0:
            with pytest.raises(ValueError, match=r"expand\(\)ed view"):
                dist.all_reduce(mixed)
        else:
            dist.all_reduce(mixed)


@ranks(2)
def test_a_second_thread_on_a_busy_group_raises_instead_of_aborting():
    import threading

    rank, _ = world()
    if rank == 1:
        time.sleep(2)  # keeps rank 0's first thread inside its barrier
        dist.barrier()
        return
    waiting = threading.Thread(target=dist.barrier, name="trainer")
    waiting.start()
    time.sleep(0.5)
    msg = raised(RuntimeError, lambda: dist.all_reduce(torch.ones(1)))
    assert "thread 'trainer' is in a collective on this group already" in msg
    waiting.join(10)
    assert not waiting.is_alive()


@ranks(0, 2, 3)
def test_a_default_device_set_by_the_user_does_not_move_distkits_own_buffers():
    """``torch.set_default_device`` (common in LLM code) moves every tensor made without
    a device: distkit's staging buffers name theirs, or a "meta" or "cuda" default would
    put them where distkit writes through CPU pointers (a crash, not an error)."""
    rank, size = world()
    cpu = torch.device("cpu")
    torch.set_default_device("meta")
    try:
        obj = {"rank": rank, "t": torch.arange(70_000, device=cpu) + rank}
        gathered = dist.all_gather_object(obj)
        assert [g["rank"] for g in gathered] == list(range(size))
        assert all(
            torch.equal(g["t"], torch.arange(70_000, device=cpu) + r)
            for r, g in enumerate(gathered)
        )
        assert dist.broadcast_object({"x": torch.ones(3, device=cpu)}, src=0)["x"].device == cpu
        uneven = dist.all_gather(torch.ones(rank + 300_000, device=cpu))
        assert [u.numel() for u in uneven] == [r + 300_000 for r in range(size)]
        summed = dist.reduce_scatter(torch.ones(2 * size, device=cpu))
        assert summed.tolist() == [float(size)] * 2
        got = dist.collect_results([rank] * 3, 3 * size)  # rank 0 gets them, in order
        assert got == (list(range(size)) * 3 if rank == 0 else None)
        with debug_mode():
            assert dist.all_reduce(torch.ones(1, device=cpu)).item() == size
        if size > 1:
            nxt, prv = (rank + 1) % size, (rank - 1) % size
            ring = dist.exchange({nxt: torch.full((300_000,), rank, device=cpu)}, [prv])
            assert torch.equal(ring[prv], torch.full((300_000,), prv, device=cpu))
            if rank == 0:
                for k in range(3):
                    dist.send(torch.full((4, 70_000), k, device=cpu), 1)
                dist.send({"k": torch.ones(2, device=cpu)}, 1)
            elif rank == 1:
                for k in range(3):
                    assert torch.equal(dist.recv(0), torch.full((4, 70_000), k, device=cpu))
                assert dist.recv(0)["k"].device == cpu
    finally:
        torch.set_default_device(None)


#: torch's factories that place a tensor on the default device unless told otherwise
_FACTORIES = {"empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor", "eye"}
#: tools whose tensors are their own workload, made in processes they start
_TOOLS = ("bench.py", "bench_peers.py", "scale_bench.py", "scale_model.py", "testing")


def test_every_tensor_distkit_makes_names_its_device():
    import ast

    from conftest import ROOT

    unnamed, seen = [], 0
    for path in sorted((ROOT / "distkit").rglob("*.py")):
        if any(part in _TOOLS for part in path.relative_to(ROOT / "distkit").parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and node.func.attr in _FACTORIES
            ):
                seen += 1
                if not any(k.arg == "device" for k in node.keywords):
                    unnamed.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert seen > 30 and unnamed == [], unnamed  # (the scan sees distkit's factories)
