"""Object collectives: nested tensors, sizes inline and overflowing, unpicklable data."""

from __future__ import annotations

import collections
import dataclasses
import threading

import numpy as np
import pytest
import torch
from conftest import WORLDS, world

import distkit.dist as dist
from distkit.dist.backends import objects as _torch_objects
from distkit.testing import ranks

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Record:
    name: str
    values: torch.Tensor
    extra: dict


def payload(rank: int) -> dict:
    """An object whose size and contents depend on the rank (inline on some, not others)."""
    base = torch.arange(12, dtype=torch.float64).view(3, 4) + rank
    return {
        "rank": rank,
        "floats": torch.full((rank + 1, 2), rank + 0.5, dtype=torch.float32),
        "half": torch.ones(3, dtype=torch.bfloat16) * rank,
        "ints": torch.arange(rank * 5_000, dtype=torch.int64),  # 0 B up to 120 KiB
        "bools": torch.tensor([rank % 2 == 0, True]),
        "complex": torch.tensor([complex(rank, -rank)], dtype=torch.complex64),
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(rank * 1.5),
        "transposed": base.t(),  # non-contiguous
        "view": base[1:, ::2],  # a strided view into base
        "base": base,
        "same": None,  # filled below: the same tensor object twice
        "point": Point(torch.tensor([rank]), "p"),
        "record": Record(f"r{rank}", torch.tensor([rank, rank]), {"nested": [None, (1, 2)]}),
        "text": "x" * (rank * 3_000),
        "array": np.arange(rank * 400, dtype=np.float32),  # out-of-band above 1 KiB
        "param": torch.nn.Parameter(torch.ones(2) * rank),
        "grad": torch.ones(2, requires_grad=True),
    }


def expected(rank: int) -> dict:
    p = payload(rank)
    p["same"] = p["floats"]
    return p


def check_payload(got: dict, rank: int) -> None:
    want = expected(rank)
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert isinstance(got[key], torch.Tensor), key
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            assert torch.equal(got[key].detach(), value.detach()), key
        elif key == "array":
            assert np.array_equal(got[key], value)
        elif key == "point":
            assert isinstance(got[key], Point) and torch.equal(got[key].x, value.x)
        elif key == "record":
            assert got[key].name == value.name and got[key].extra == value.extra
            assert torch.equal(got[key].values, value.values)
        else:
            assert got[key] == value, key
    assert got["same"] is got["floats"], "one tensor object must arrive as one object"
    assert isinstance(got["param"], torch.nn.Parameter)
    assert got["grad"].requires_grad and not got["floats"].requires_grad


def make(rank: int) -> dict:
    p = payload(rank)
    p["same"] = p["floats"]
    return p


@ranks(*WORLDS)
def test_all_gather_object_nested_structures():
    rank, size = world()
    mine = make(rank)
    out = dist.all_gather_object(mine)
    assert len(out) == size and out[rank] is mine
    for r, obj in enumerate(out):
        check_payload(obj, r)


def tagged(rank: int) -> dict:
    """Tensors with attributes of their own, as code sets them (a note, a model-parallel
    flag on a parameter), small ones and one past the inline slot."""
    t = torch.full((3,), float(rank))
    t.note = f"rank {rank}"
    t.meta = {"step": rank, "w": torch.tensor([rank])}
    p = torch.nn.Parameter(torch.ones(2) * rank)
    p.tensor_model_parallel = bool(rank % 2)
    big = torch.zeros(70_000)
    big.tag = rank
    return {"t": t, "p": p, "big": big, "plain": torch.ones(1)}


@ranks(*WORLDS)
def test_a_tensors_own_attributes_travel_with_it():
    """They were dropped on the way to other ranks (a single process kept them: it
    returns the objects themselves), while torch's pickling, so mmengine's, keeps them."""
    rank, size = world()
    for serializer in ("pickle", "safe"):
        out = dist.all_gather_object(tagged(rank), serializer=serializer)
        for r, got in enumerate(out):
            assert got["t"].note == f"rank {r}" and got["t"].meta["step"] == r, serializer
            assert torch.equal(got["t"].meta["w"], torch.tensor([r]))
            assert isinstance(got["p"], torch.nn.Parameter)
            assert got["p"].tensor_model_parallel == bool(r % 2)
            assert got["big"].tag == r and torch.equal(got["big"], torch.zeros(70_000))
            assert got["plain"].__dict__ == {}
    got = dist.broadcast_object(tagged(rank), src=size - 1)
    assert got["t"].note == f"rank {size - 1}" and got["big"].tag == size - 1
    # a name that hides one of the class's: pickle keeps it (as torch does), safe refuses
    hides = torch.ones(1)
    hides.inner = 5
    assert dist.all_gather_object(hides, serializer="pickle")[-1].__dict__ == {"inner": 5}
    if size > 1:  # (a single process decodes nothing: its own objects come back)
        hidden = "a tensor attribute named 'inner', which would hide torch.Tensor.inner"
        with pytest.raises(dist.UnsafeObjectError, match=hidden):
            dist.all_gather_object(hides, serializer="safe")
    # attributes that lead back to the tensor: references to it, not copies (nor an
    # endless recursion: they travel once the tensor is known)
    me = torch.full((70_000,), float(rank))
    me.me, me.meta = me, {"self": me}
    u, w = torch.ones(2), torch.zeros(2)
    u.w, w.u = w, u
    for serializer in ("pickle", "safe"):
        for r, (a, b) in enumerate(dist.all_gather_object([me, u], serializer=serializer)):
            assert a.me is a and a.meta["self"] is a and b.w.u is b, serializer
            assert torch.equal(a, torch.full((70_000,), float(r)))
    # an attribute that cannot be pickled: the same error in every world (a bare tensor
    # in a single process returns at once, as documented: its shortcut does not look)
    bad = torch.ones(2)
    bad.fn = lambda: 1
    for data in ([bad], {"t": bad}) + ((bad,) if size > 1 else ()):
        with pytest.raises(TypeError, match=r"\.fn \(function\) cannot be pickled"):
            dist.all_gather_object(data)
    assert dist.all_gather_object(rank) == list(range(size))


@ranks(*WORLDS)
def test_all_gather_object_plain_values_and_sizes():
    rank, size = world()
    assert dist.all_gather_object(rank) == list(range(size))
    assert dist.all_gather_object(None) == [None] * size
    big = ["y" * 1000] * (rank * 300)  # 0 B to 900 KB: inline and exact-size broadcasts
    out = dist.all_gather_object(big)
    assert [len(o) for o in out] == [r * 300 for r in range(size)]
    assert all(o == ["y" * 1000] * (r * 300) for r, o in enumerate(out))
    medium = "z" * (_torch_objects.INLINE_BYTES + 10 * rank)  # several medium overflows
    assert dist.all_gather_object(medium) == [
        "z" * (_torch_objects.INLINE_BYTES + 10 * r) for r in range(size)
    ]


@ranks(*WORLDS)
def test_received_tensors_own_their_memory_and_land_on_cpu():
    rank = dist.get_rank()
    out = dist.all_gather_object([torch.ones(4) * rank, torch.zeros(2)])
    for r, (a, b) in enumerate(out):
        assert a.device.type == "cpu" and a.tolist() == [float(r)] * 4
        if r != rank:
            # small parts of the receive buffer are copied out: nothing else is kept
            # alive with them, or written by torch.save with them
            for t in (a, b):
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
            assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
            a += 1  # writable, and does not touch its neighbour
            assert b.tolist() == [0.0, 0.0]
    moved = dist.all_gather_object(torch.ones(1), map_location="cpu")
    assert all(t.device.type == "cpu" for t in moved)


@ranks(*WORLDS)
def test_a_kept_slice_never_holds_other_data():
    import io

    rank, _ = world()
    big = torch.full((2_000_000,), float(rank))  # 8 MB: received without a copy
    out = dist.all_gather_object({"big": big, "small": torch.tensor([rank, rank])})
    for r, got in enumerate(out):
        if r == rank:
            assert got["big"] is big
            continue
        small, large = got["small"], got["big"]
        assert large.untyped_storage().nbytes() == large.numel() * 4  # exactly its bytes
        start, length = large.untyped_storage().data_ptr(), large.untyped_storage().nbytes()
        assert not start <= small.untyped_storage().data_ptr() < start + length
        saved = io.BytesIO()
        torch.save(small[:1], saved)  # a slice of a small result: a small checkpoint
        assert saved.tell() < 2000, saved.tell()


@ranks(*WORLDS)
def test_gather_object_to_dst():
    rank, size = world()
    dst = size - 1
    mine = make(rank)
    out = dist.gather_object(mine, dst=dst)
    if rank == dst:
        assert len(out) == size and out[rank] is mine
        for r, obj in enumerate(out):
            check_payload(obj, r)
    else:
        assert out is None


@ranks(*WORLDS)
def test_broadcast_object_list_in_place():
    rank, size = world()
    src = size - 1
    objects = ["foo", 12, {1: 2}, make(src)] if rank == src else [None] * rank
    out = dist.broadcast_object_list(objects, src=src)
    assert out is objects and len(objects) == 4
    assert objects[:3] == ["foo", 12, {1: 2}]
    check_payload(objects[3], src)
    large = [bytes(range(256)) * 1000] if rank == 0 else []
    assert dist.broadcast_object_list(large) == [bytes(range(256)) * 1000]


@ranks(*WORLDS)
def test_broadcast_object():
    rank, size = world()
    obj = make(0) if rank == 0 else None
    got = dist.broadcast_object(obj)
    if rank == 0:
        assert got is obj
    check_payload(got, 0)
    assert dist.broadcast_object(rank, src=size - 1) == size - 1


@ranks(*WORLDS)
def test_scatter_object_list():
    rank, size = world()
    src = size // 2
    data = [make(r) for r in range(size)] if rank == src else None
    got = dist.scatter_object_list(data, src=src)
    check_payload(got, rank)
    if rank == src:
        assert got is data[src]
    small = dist.scatter_object_list([f"to {r}" for r in range(size)] if rank == 0 else None)
    assert small == f"to {rank}"


@ranks(*WORLDS)
def test_all_to_all_object():
    rank, size = world()
    data = [
        {"from": rank, "to": d, "t": torch.full((d + 1,), rank), "pad": "w" * (rank * d * 3000)}
        for d in range(size)
    ]
    out = dist.all_to_all_object(data)
    assert out[rank] is data[rank]
    for src, obj in enumerate(out):
        assert obj["from"] == src and obj["to"] == rank
        assert obj["t"].tolist() == [src] * (rank + 1) and len(obj["pad"]) == src * rank * 3000
    assert dist.all_to_all_object([rank] * size) == list(range(size))


@ranks(*WORLDS)
def test_unpicklable_object_fails_on_every_rank():
    rank, size = world()
    bad = {"ok": 1, "lock": threading.Lock()}
    where = f"(on rank {rank} of {size})"
    # everyone passes something unpicklable
    with pytest.raises(TypeError, match=r"data\['lock'\] \(lock\) cannot be pickled") as info:
        dist.all_gather_object(bad)
    assert where in str(info.value)
    with pytest.raises(TypeError, match=r"data\[1\]\[0\] \(function\) cannot be pickled"):
        dist.gather_object([1, [lambda: 0]])
    if size > 1:
        # only the last rank's object is bad: it names its object, the others name it
        last = size - 1
        obj = bad if rank == last else {"ok": rank}
        with pytest.raises(TypeError) as info:
            dist.all_gather_object(obj)
        if rank == last:
            assert "data['lock'] (lock) cannot be pickled" in str(info.value)
        else:
            said = str(info.value)  # the sender's error, without its call name and place
            assert said.startswith(
                f"all_gather_object: rank {last} could not send its object: data['lock'] (lock) "
                "cannot be pickled"
            ), said
            assert said.count("all_gather_object") == 1 and said.count("(on rank") == 1, said
            assert said.endswith(f"(on rank {rank} of {size})"), said
        with pytest.raises(TypeError):
            dist.broadcast_object(bad if rank == 0 else None)
        rows = [bad if d == 0 else d for d in range(size)] if rank == last else list(range(size))
        with pytest.raises(TypeError, match=r"could not send|cannot be pickled"):
            dist.all_to_all_object(rows)
    # the group still works
    assert dist.all_gather_object(rank) == list(range(size))


@ranks(2)
def test_an_object_whose_class_the_receiver_lacks_names_the_sender_and_the_class():
    import os
    import sys
    import tempfile
    import types

    rank, _ = world()
    here = types.ModuleType("only_on_rank_1")  # importable on rank 1 alone

    class Only:
        pass

    Only.__module__, Only.__qualname__ = here.__name__, "Only"
    here.Only = Only
    if rank == 1:
        sys.modules[here.__name__] = here
    try:
        if rank == 1:
            assert isinstance(dist.all_gather_object(Only())[1], Only)
        else:
            with pytest.raises(ModuleNotFoundError) as info:
                dist.all_gather_object(rank)
            assert str(info.value).startswith(
                "all_gather_object: rank 1 sent an object that needs only_on_rank_1.Only, "
                "which this rank cannot import (on rank 0 of 2): No module named"
            )
            assert "Make only_on_rank_1 importable on every rank" in str(info.value)
        # a name its module lacks on the receiver: its AttributeError, said the same way
        Only.__module__ = "types"
        if rank == 1:
            types.Only = Only  # type: ignore[attr-defined]
            dist.gather_object(Only(), dst=0)
        else:
            missing = r"rank 1 sent an object that needs types\.Only, which this rank cannot"
            with pytest.raises(AttributeError, match=missing):
                dist.gather_object(rank, dst=0)
        # a module whose import raises on the receiver (a GPU library on a CPU rank):
        # that error's class, with the sender and the class
        Only.__module__ = "raises_on_rank_0"
        if rank == 1:
            sys.modules["raises_on_rank_0"] = here
            here.Only = Only
            dist.broadcast_object(Only(), src=1)
        else:
            folder = tempfile.mkdtemp()
            with open(os.path.join(folder, "raises_on_rank_0.py"), "w") as f:
                f.write("raise RuntimeError('no GPU library here')\n")
            sys.path.insert(0, folder)
            try:
                with pytest.raises(RuntimeError) as info:
                    dist.broadcast_object(None, src=1)
            finally:
                sys.path.remove(folder)
            assert str(info.value).startswith(
                "broadcast_object: rank 1 sent an object that needs raises_on_rank_0.Only, "
                "which this rank cannot import (on rank 0 of 2): no GPU library here. "
                "Importing raises_on_rank_0 fails on this rank"
            ), info.value
    finally:
        for name in (here.__name__, "raises_on_rank_0"):
            sys.modules.pop(name, None)
        if hasattr(types, "Only"):
            del types.Only
    assert dist.all_gather_object(rank) == [0, 1]


@ranks(2, 3, timeout=30)
def test_a_bad_map_location_on_one_rank_raises_where_it_is_heard_and_keeps_them_in_step():
    """Refused on that rank alone before the call, the others waited in it and paired it
    with that rank's next call: another call's objects, no error. That rank now takes
    its part in the call (sending what is wrong where it sends), then raises."""
    rank, size = world()
    last = size - 1
    t = torch.full((1,), float(rank))
    every, nobody = set(range(size)), {last}
    cases = {  # the call, and which ranks raise: the last one, and those it sends to
        "all_gather_object": (lambda loc: dist.all_gather_object(t, map_location=loc), every),
        "all_to_all_object": (
            lambda loc: dist.all_to_all_object([t] * size, map_location=loc),
            every,
        ),
        "gather_object to 0": (lambda loc: dist.gather_object(t, 0, map_location=loc), {0, last}),
        "gather_object to it": (lambda loc: dist.gather_object(t, last, map_location=loc), nobody),
        "broadcast_object from it": (
            lambda loc: dist.broadcast_object(t, src=last, map_location=loc),
            every,
        ),
        "broadcast_object from 0": (
            lambda loc: dist.broadcast_object(t, src=0, map_location=loc),
            nobody,
        ),
        "scatter_object_list from it": (
            lambda loc: dist.scatter_object_list(
                [t] * size if rank == last else None, src=last, map_location=loc
            ),
            every,
        ),
    }
    for name, (call, raising) in cases.items():
        loc = "xla" if rank == last else None  # no torch.xla here: refused
        if rank in raising:
            with pytest.raises(ValueError) as info:
                call(loc)
            said = "map_location='xla', but this process has no xla device"
            if rank != last:
                said = f"rank {last} passed bad arguments: {said}"
            assert said in str(info.value), (name, str(info.value))
        else:
            call(loc)
        assert dist.all_gather_object(rank) == list(range(size)), name  # still in step


@ranks(*WORLDS)
def test_object_argument_errors():
    rank, size = world()
    with pytest.raises(TypeError, match="broadcast_object_list: data must be a list"):
        dist.broadcast_object_list("not a list")
    with pytest.raises(ValueError, match=f"data must hold {size} objects"):
        dist.all_to_all_object([1] * (size + 1))
    with pytest.raises(ValueError, match="dst=-1 is out of range"):
        dist.gather_object(1, dst=-1)
    # src's bad list reaches every rank: src raises its own error, the others one naming it
    with pytest.raises(TypeError) as info:
        dist.scatter_object_list(None if rank == 0 else ["ignored"])
    said = (
        "data must be a list" if rank == 0 else "rank 0 passed bad arguments: data must be a list"
    )
    assert f"scatter_object_list: {said}" in str(info.value)
    with pytest.raises(ValueError, match=f"data must hold {size} objects"):
        dist.scatter_object_list([1] * (size + 1) if rank == 0 else None)
    assert dist.all_gather_object(rank) == list(range(size))


@ranks(*WORLDS)
def test_every_plain_tensor_can_be_sent():
    import warnings

    rank, _ = world()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype in torch
        nested = torch.nested.nested_tensor([torch.ones(2) * rank, torch.ones(3)])
    kinds = {
        "sparse": torch.eye(2).to_sparse() * rank,
        "mkldnn": (torch.ones(2) * rank).to_mkldnn(),  # arrives as a dense tensor
        "nested": nested,
        "meta": torch.empty(3, device="meta"),
    }
    out = dist.all_gather_object(kinds)
    assert out[rank] is kinds
    for r, got in enumerate(out):
        if r == rank:
            continue
        assert torch.equal(got["sparse"].to_dense(), torch.eye(2) * r)
        assert got["mkldnn"].layout is torch.strided and got["mkldnn"].tolist() == [float(r)] * 2
        assert got["nested"].is_nested and got["nested"].unbind()[0].tolist() == [float(r)] * 2
        assert got["meta"].is_meta
    alone = torch.ones(2).to_mkldnn()
    assert dist.all_gather_object(alone)[rank] is alone


def _collector_state(tag):
    """Rebuilt on the receiver: records whether the garbage collector runs meanwhile."""
    import gc

    return (tag, gc.isenabled())


class _Probe:
    def __init__(self, tag):
        self.tag = tag

    def __reduce__(self):
        return (_collector_state, (self.tag,))


def _gc_failing():
    raise ValueError("a reduce function that fails on the receiver")


class _Failing:
    def __reduce__(self):
        return (_gc_failing, ())


@ranks(2, 3)
def test_unpickling_pauses_the_garbage_collector_and_restores_it():
    import gc

    rank, size = world()
    got = dist.all_gather_object([_Probe(rank), {"box": [rank]}])
    # other ranks' objects were rebuilt with the collector paused; this rank's is its own
    assert [g[0] for g in got if isinstance(g[0], tuple)] == [
        (r, False) for r in range(size) if r != rank
    ]
    assert gc.isenabled()
    if rank == 0:  # the source keeps its own object; receivers rebuild it, and fail
        dist.broadcast_object(_Failing(), src=0)
    else:
        with pytest.raises(Exception, match="fails on the receiver"):
            dist.broadcast_object(None, src=0)
    assert gc.isenabled(), "a failed unpickling restores the collector too"
    gc.disable()
    try:  # a collector the program disabled stays disabled
        dist.all_gather_object(_Probe(rank))
        assert not gc.isenabled()
    finally:
        gc.enable()


def _refused_on_receivers(src):
    rank = dist.get_rank()
    if rank != src:
        raise ValueError(f"rank {rank} refuses this part")
    return rank


class _ReceiverFails:
    """Pickles on any rank; unpickling it raises on every rank but rank 0."""

    def __reduce__(self):
        return (_refused_on_receivers, (0,))


def _long(n):
    """A list whose pickle stream is long (``n`` small dicts sharing one list)."""
    shared = ["shared", 1]
    return [{"id": i, "score": i / 3, "label": "cat", "shared": shared} for i in range(n)]


@ranks(2, 3)
def test_a_long_object_that_fails_stops_every_rank_and_keeps_them_in_step():
    rank, size = world()
    items = _long(50_000)
    # the source fails deep in a long object: every rank raises, naming the source
    bad = [*items, threading.Lock()]
    with pytest.raises(TypeError) as info:
        dist.broadcast_object(bad if rank == 0 else None)
    if rank == 0:
        assert "obj[50000] (lock) cannot be pickled" in str(info.value)
    else:
        assert "rank 0 could not send its object: obj[50000] (lock)" in str(info.value)
    # a receiver fails to unpickle part way: it still takes every message of the call
    tricky = [*items[:20_000], _ReceiverFails(), *items]
    if rank == 0:
        assert dist.broadcast_object(tricky) is tricky
    else:
        with pytest.raises(ValueError, match=f"rank {rank} refuses this part"):
            dist.broadcast_object(None)
    # the group is still in step: the next collectives pair up as they should
    assert dist.broadcast_object(items if rank == 1 else None, src=1) == items
    assert dist.all_gather_object(rank) == list(range(size))
