"""Tensor-aware encoding, the rounds it takes, and the safe serializer."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import decimal
import os
import tempfile

import numpy as np
import pytest
import torch
from conftest import collective_calls, world
from helpers_subprocess import run

import distkit.dist as dist
from distkit.dist.backends import objects as _torch_objects
from distkit.dist.codec import wire as _wire
from distkit.testing import ranks

Pair = collections.namedtuple("Pair", "left right")


@dataclasses.dataclass
class Box:
    label: str
    value: torch.Tensor


class Evil:
    """Unpickling this runs os.makedirs(path): the classic pickle attack, made harmless."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.makedirs, (self.path, 0o777, True)


def plain_data(rank: int) -> dict:
    return {
        "t": torch.arange(rank + 3, dtype=torch.float16),
        "nested": [{"a": (1, 2.5, None, True)}, {"b": b"bytes", "c": {1, 2}}],
        "ordered": collections.OrderedDict(z=1, a=2),
        "default": collections.defaultdict(list, {"k": [rank]}),
        "when": datetime.datetime(2026, 11, 22, 12, rank),
        "money": decimal.Decimal("1.25"),
        "array": np.arange(600, dtype=np.float64) * rank,
        "small_array": np.float32(rank),
        "meta": (torch.Size([2, rank]), torch.device("cpu"), torch.bfloat16),
        "complex": complex(rank, 1),
        "range": range(rank),
    }


@ranks(1, 2, 3)
def test_safe_serializer_loads_plain_data():
    rank = dist.get_rank()
    out = dist.all_gather_object(plain_data(rank), serializer="safe")
    for r, got in enumerate(out):
        want = plain_data(r)
        assert torch.equal(got["t"], want["t"]) and got["t"].dtype == torch.float16
        assert got["nested"] == want["nested"] and got["ordered"] == want["ordered"]
        assert got["default"] == want["default"] and got["default"].default_factory is list
        assert (got["when"], got["money"], got["complex"]) == (want["when"], 1.25, complex(r, 1))
        assert np.array_equal(got["array"], want["array"]) and got["small_array"] == r
        assert got["meta"] == want["meta"] and got["range"] == range(r)


@ranks(2, 3)
def test_safe_serializer_refuses_code_and_runs_none_of_it():
    rank, size = world()
    marker = dist.broadcast_object(tempfile.mktemp(prefix="distkit-evil-") if rank == 0 else None)
    sender = size - 1
    mine = Evil(marker) if rank == sender else {"fine": rank}
    if rank == sender:
        out = dist.all_gather_object(mine, serializer="safe")  # nothing of its own decoded
        assert out[rank] is mine
    else:
        with pytest.raises(dist.UnsafeObjectError) as info:
            dist.all_gather_object(mine, serializer="safe")
        message = str(info.value)
        assert f"rank {sender} sent an object that needs os.makedirs" in message
        assert "refuses" in message and f"(on rank {rank} of {size})" in message
        assert info.value.rank == sender and info.value.global_name == "os.makedirs"
    dist.barrier()
    assert not os.path.exists(marker), "the refused payload ran code"
    # the same payload under plain pickle does run: the test's payload is a real attack
    dist.all_gather_object(mine, serializer="pickle")
    dist.barrier()
    assert os.path.isdir(marker)
    dist.barrier()
    if rank == 0:
        os.rmdir(marker)


@ranks(2, 3)
def test_safe_serializer_allow_list_and_process_setting():
    rank, size = world()
    obj = {"box": Box(f"r{rank}", torch.ones(2) * rank), "pair": Pair(rank, [rank])}
    dist.set_serializer("safe")
    assert dist.get_serializer() == "safe"
    with pytest.raises(
        dist.UnsafeObjectError, match=r"needs test_serial\.Box|needs test_serial\.Pair"
    ):
        dist.all_gather_object(obj)
    dist.set_serializer("safe", allow=[Box, "test_serial.Pair"])
    out = dist.all_gather_object(obj)
    assert [o["box"].label for o in out] == [f"r{r}" for r in range(size)]
    assert all(torch.equal(o["box"].value, torch.ones(2) * r) for r, o in enumerate(out))
    assert [o["pair"] for o in out] == [Pair(r, [r]) for r in range(size)]
    # every object collective honours the process-wide setting
    if rank != 0:
        with pytest.raises(dist.UnsafeObjectError):
            dist.broadcast_object(collections.ChainMap({}) if rank == 0 else None)
    else:
        dist.broadcast_object(collections.ChainMap({}))


def test_serializer_arguments_are_checked(settings):
    with pytest.raises(ValueError, match="serializer must be 'pickle' or 'safe', got 'json'"):
        dist.all_gather_object(1, serializer="json")
    with pytest.raises(ValueError, match="set_serializer"):
        dist.set_serializer("yaml")
    with pytest.raises(TypeError, match="allow: give classes"):
        dist.set_serializer("safe", allow=[3])


def test_serializer_from_the_environment():
    code = "import distkit.dist as d; print(d.get_serializer())"
    assert run(["-c", code], DISTKIT_SERIALIZER="safe").stdout.strip() == "safe"
    # the single-process fast paths (atoms, flat dicts) must not skip the check
    for obj in ("7", "{'a': 1}", "[{'a': 1}]"):
        bad = f"import distkit.dist as d; d.all_gather_object({obj})"
        proc = run(
            ["-c", f"import sys\ntry:\n    {bad}\nexcept ValueError as e:\n    print(e)"],
            DISTKIT_SERIALIZER="yolo",
        )
        assert "serializer must be 'pickle' or 'safe', got 'yolo'" in proc.stdout, obj


# -- the device part, exercised on the CPU ------------------------------------------------


def _cpu_as_device(comm):
    """Pretend the group's accelerator is the CPU: every tensor goes to the device part."""
    cpu = _torch_objects._Channel(comm, comm.pg, torch.device("cpu"))
    return cpu, _torch_objects._Channel(comm, comm.pg, torch.device("cpu"))


def payload(rank: int, dst: int = 0):
    return {
        "rank": rank,
        "f32": torch.full((rank + 1, 3), float(rank)),
        "i8": torch.arange(rank * 7, dtype=torch.int8),
        "empty": torch.empty(0, 2, dtype=torch.float64),
        "strided": torch.arange(20.0).view(4, 5)[:, ::2] + rank,
        "big": torch.full((rank * 40_000,), rank, dtype=torch.int32),  # device part > slot
        "text": "p" * (rank * 5000),
        "dst": dst,
    }


def check(got: dict, rank: int, dst: int = 0) -> None:
    want = payload(rank, dst)
    assert got["rank"] == rank and got["text"] == want["text"] and got["dst"] == dst
    for key in ("f32", "i8", "empty", "strided", "big"):
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


@ranks(1, 2, 3)
def test_device_part_path_for_every_object_collective():
    rank, size = world()
    decode = _wire.decode
    seen = []  # per decoded object: did its tensors come through the device part?

    def recording_decode(enc, *args, **kwargs):
        seen.append(enc.dev is not None)
        return decode(enc, *args, **kwargs)

    encoded = _wire.encode(payload(rank), "data", "f", None, torch.device("cpu"))
    assert encoded.dev is not None and encoded.dev.numel() > 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_torch_objects, "_channels", _cpu_as_device)
        mp.setattr(_wire, "decode", recording_decode)
        out = dist.all_gather_object(payload(rank))
        for r, got in enumerate(out):
            check(got, r)
        gathered = dist.gather_object(payload(rank), dst=size - 1)
        if rank == size - 1:
            for r, got in enumerate(gathered):
                check(got, r)
        check(dist.broadcast_object(payload(0) if rank == 0 else None), 0)
        check(
            dist.scatter_object_list([payload(r) for r in range(size)] if rank == 0 else None), rank
        )
        rows = dist.all_to_all_object([payload(rank, d) for d in range(size)])
        for src, got in enumerate(rows):
            check(got, src, rank)
    # objects decoded here: one from every other rank in all_gather and all_to_all, and
    # from src in broadcast and scatter; on the gather's dst, one from every other rank
    expected = 2 * (size - 1) + (rank != 0) * 2 + (size - 1 if rank == size - 1 else 0)
    assert len(seen) == expected and all(seen), seen  # each through the device part


@ranks(1, 2, 3)
def test_map_location_and_meta_tensors():
    rank = dist.get_rank()
    out = dist.all_gather_object(
        {"t": torch.ones(2) * rank, "m": torch.empty(3, device="meta")}, map_location="meta"
    )
    for r, got in enumerate(out):
        if r != rank:
            assert got["t"].device.type == "meta" and got["t"].shape == (2,)
        assert got["m"].device.type == "meta" and got["m"].shape == (3,)


@ranks(2, 3)
def test_numpy_arrays_arrive_without_a_copy():
    rank = dist.get_rank()
    # 800 KB: most of its rank's receive buffer, so it stays there, uncopied
    out = dist.all_gather_object([np.full(100_000, rank, dtype=np.int64), torch.ones(3)])
    for r, (array, tensor) in enumerate(out):
        assert np.array_equal(array, np.full(100_000, r)) and array.flags.writeable
        if r != rank:
            assert not array.flags.owndata  # a view of the receive buffer
            # and the small tensor beside it was copied out of that buffer
            address = array.__array_interface__["data"][0]
            assert not address <= tensor.untyped_storage().data_ptr() < address + array.nbytes


# -- rounds --------------------------------------------------------------------------------


@ranks(2, 3)
def test_small_objects_take_one_round_large_ones_two():
    rank, size = world()

    def rounds(call):
        with collective_calls() as calls:
            call()
        return calls

    assert rounds(lambda: dist.all_gather_object({"loss": 0.5, "rank": rank})) == [
        "all_gather_single"
    ]
    assert rounds(lambda: dist.broadcast_object({"lr": 0.1})) == ["broadcast"]
    assert rounds(lambda: dist.gather_object(rank)) == ["gather"]
    assert rounds(lambda: dist.all_to_all_object([rank] * size)) == ["all_to_all_single"]
    big = torch.ones(1_000_000) if rank == 1 else torch.ones(1)
    calls = rounds(lambda: dist.all_gather_object(big))
    # slot round, then one exact-size broadcast for the one rank that overflowed
    assert calls == ["all_gather_single", "broadcast"], calls


def test_large_tensors_can_be_left_out_of_the_cpu_part_and_decoded_from_their_own_buffers():
    from distkit.dist.core.comm import Comm

    comm = Comm(None, 0, 1, None)
    big = [torch.full((100_000,), float(i)) for i in range(40)]  # 16 MB: most go apart
    obj = {"big": big, "small": torch.arange(3), "same": big[0], "array": np.arange(5)}
    enc = _wire.encode(obj, "data", "send", comm, apart=True)
    sizes, dev_bytes = _wire.apart_sizes(enc.cpu)
    assert dev_bytes == 0 and sizes == [a.numel() for a in enc.apart]
    assert len(enc.apart) >= 37 and enc.cpu.numel() < 2 << 20  # at most 1/16 stays inline
    # sent apart straight from the tensors: no copy on the way out
    assert any(a.data_ptr() == big[-1].data_ptr() for a in enc.apart)
    received = tuple(a.clone() for a in enc.apart)  # each in memory of its own
    got = _wire.decode(_wire.Encoded(enc.cpu.clone(), None, received))
    assert got["same"] is got["big"][0] and got["small"].tolist() == [0, 1, 2]
    for i, t in enumerate(got["big"]):
        assert torch.equal(t, big[i])
    owned = [t for t in got["big"] if any(t.data_ptr() == a.data_ptr() for a in received)]
    assert len(owned) == len(received)  # views of their own buffers, never copied
    import pickle

    with pytest.raises(pickle.UnpicklingError, match=r"sent apart\) was not received whole"):
        _wire.decode(_wire.Encoded(enc.cpu.clone(), None, received[:-1]))
    with pytest.raises(pickle.UnpicklingError, match="tensors were received apart"):
        _wire.decode(_wire.Encoded(enc.cpu.clone(), None, (*received, received[0])))
