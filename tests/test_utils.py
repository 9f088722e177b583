"""distkit.utils: devices, moving nested data, and the group cache."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import tempfile
import time

import pytest
import torch
import torch.distributed as td

import distkit.dist as dist
from distkit.testing import ranks
from distkit.utils import (
    cast_data_device,
    get_comm_device,
    get_cpu_group,
    get_data_device,
    get_group,
)
from distkit.utils.device import backend_device_types
from distkit.utils.groups import supports_cpu


@pytest.mark.parametrize(
    ("config", "types"),
    [
        ("nccl", ["cuda"]),
        ("gloo", ["cpu"]),
        ("mpi", ["cpu"]),
        ("hccl", ["npu"]),
        ("cncl", ["mlu"]),
        ("mccl", ["musa"]),
        ("xccl", ["xpu"]),
        ("cpu:gloo,cuda:nccl", ["cuda", "cpu"]),
        ("cpu:gloo,cuda:gloo", ["cpu", "cuda"]),  # how torch reports a plain gloo group
        ("cpu:gloo,npu:hccl", ["npu", "cpu"]),
    ],
)
def test_backend_device_types(config, types):
    assert backend_device_types(config) == types


def test_supports_cpu():
    assert supports_cpu("gloo") and supports_cpu("cpu:gloo,cuda:nccl")
    assert not supports_cpu("nccl") and not supports_cpu("cuda:nccl")


def test_comm_device_without_process_group():
    assert get_comm_device() == torch.device("cpu")
    assert get_cpu_group() is None and get_group([0]) is None


def test_data_device_nested_and_errors():
    data = {"a": [torch.zeros(1), (torch.ones(2),)], "b": {torch.ones(1)}}
    assert get_data_device(data) == torch.device("cpu")
    assert get_data_device(t for t in [torch.ones(1)]) == torch.device("cpu")  # any iterable
    # as in mmengine: tensors only, and no empty container
    with pytest.raises(TypeError, match=r"but data\['b'\] is int 3 \(get_data_device: data may"):
        get_data_device({"a": torch.ones(1), "b": 3})
    for bad in ("123", 123, None, [torch.ones(1), "x"]):
        with pytest.raises(TypeError, match="get_data_device"):
            get_data_device(bad)
    with pytest.raises(ValueError, match=r"data\[1\] is an empty list"):
        get_data_device([torch.ones(1), []])
    if torch.backends.mps.is_available() or torch.cuda.is_available():  # pragma: no cover
        other = "cuda" if torch.cuda.is_available() else "mps"
        with pytest.raises(ValueError, match="different devices"):
            get_data_device([torch.zeros(1), torch.zeros(1, device=other)])


Pair = collections.namedtuple("Pair", "x y")


def test_cast_data_device_preserves_types():
    t = torch.ones(2)
    data = {
        "pair": Pair(t, "meta"),
        "ordered": collections.OrderedDict(b=t, a=[t, 1]),
        "default": collections.defaultdict(list, {"k": t}),
        "tuple": (t, None),
        "set": {1, 2},
    }
    out = cast_data_device(data, "cpu")
    assert type(out["pair"]) is Pair and out["pair"].y == "meta" and out["pair"].x is t
    assert type(out["ordered"]) is collections.OrderedDict
    assert list(out["ordered"]) == ["b", "a"]
    assert type(out["default"]) is collections.defaultdict
    assert out["default"].default_factory is list
    assert type(out["tuple"]) is tuple and out["set"] == {1, 2}
    assert out is not data  # containers are rebuilt, tensors on the device kept as they are
    target = {"x": torch.zeros(2)}
    cast_data_device({"x": torch.full((2,), 3.0)}, "cpu", out=target)
    assert target["x"].tolist() == [3.0, 3.0]
    with pytest.raises(TypeError, match="out must have the structure of data"):
        cast_data_device([t], "cpu", out=(t,))
    # data itself must be a tensor or a non-empty container (as in mmengine); inside one,
    # empty containers and values other than tensors pass through (unlike mmengine)
    inner = cast_data_device({"boxes": [], "name": "x", "t": t}, "cpu")
    assert inner == {"boxes": [], "name": "x", "t": t}
    for bad, error in (("x", TypeError), (None, TypeError), ([], ValueError), ({}, ValueError)):
        with pytest.raises(error, match="cast_data_device"):
            cast_data_device(bad, "cpu")


@pytest.mark.parametrize(
    ("ranks_arg", "error", "match"),
    [
        ([1], ValueError, "rank 1 is out of range for a world of size 1"),
        ([], ValueError, "must not be empty"),
        ([0, 0], ValueError, "must not repeat"),
        (["0"], TypeError, "must hold ints"),
        (3, TypeError, "must be a list of global ranks"),
    ],
)
def test_get_group_bad_ranks(ranks_arg, error, match):
    with pytest.raises(error, match=match):
        get_group(ranks_arg)


@ranks(1, 2, 3)
def test_group_cache_and_cpu_group():
    size = dist.get_world_size()
    world = dist.get_default_group()
    assert get_group(range(size)) is world  # the whole world is the default group
    assert get_cpu_group() is world  # gloo moves CPU tensors itself
    assert get_comm_device() == torch.device("cpu")
    if size > 1:
        g = get_group([0, size - 1])
        assert get_group((size - 1, 0)) is g
        assert get_group([0, size - 1], backend="gloo") is g  # default backend named
        if dist.get_rank() in (0, size - 1):
            assert dist.get_backend(g) == "gloo"
        else:
            with pytest.raises(ValueError, match="is not a member of the group"):
                dist.get_backend(g)


@ranks(3, 4)
def test_ranks_that_create_different_groups_raise_on_every_rank():
    """torch pairs the groups ranks create by number alone: each rank naming only its
    own group (or the same groups in another order) joined ranks into groups they did
    not ask for, and reduced across them silently, while the others hung."""
    rank, size = dist.get_rank(), dist.get_world_size()
    fix = "Every rank must create every group, in the same order, members or not"
    if size == 4:  # each rank names only its own group, as a collective's group=
        mine = [0, 2] if rank % 2 == 0 else [1, 3]
        with pytest.raises(ValueError) as info:
            dist.all_reduce(torch.ones(1), group=mine)
        text = str(info.value)
        assert text.startswith(f"all_reduce: group={mine}: the ranks create different"), text
        assert re.search(
            r"\[0, 2\] at tests/test_utils.py:\d+ in \w+ on ranks 0, 2 and "
            r"\[1, 3\] at tests/test_utils.py:\d+ in \w+ on ranks 1, 3",
            text,
        ), text
        assert fix in text and text.endswith(f"(on rank {rank} of {size})"), text
    # the same groups, in another order on rank 0
    first, second = [0, 1], [1, 2]
    with pytest.raises(ValueError) as info:
        for g in (first, second) if rank == 0 else (second, first):
            get_group(g)
    text = str(info.value)
    assert "get_group: the ranks create different process groups at the world's group" in text
    assert "[0, 1] at tests/test_utils.py:" in text and "[1, 2] at tests/test_utils.py:" in text
    assert fix in text
    # nothing was created: every rank goes on in step, and groups made alike work
    groups = [get_group(g) for g in ([0, 2], [1, size - 1])]
    for g, members in zip(groups, ([0, 2], [1, size - 1])):
        if rank in members:
            total = dist.all_reduce(torch.tensor([10.0**rank]), group=g)
            assert total.item() == sum(10.0**r for r in members)
    assert dist.all_gather_object(rank) == list(range(size))


@ranks(3)
def test_a_group_created_on_its_members_only_is_refused_at_once():
    """Members that created a group while another rank went on to a collective waited in
    torch's creation (or, with no barrier there, went on, and numbered later groups apart
    from the others). They raise within seconds, and the ranks stay in step."""
    rank, size = dist.get_rank(), dist.get_world_size()
    start = time.monotonic()
    if rank in (0, 1):
        with pytest.raises(dist.CollectiveMismatchError) as info:
            dist.all_reduce(torch.ones(1), group=[0, 1])
        text = str(info.value)
        assert text.startswith("get_group: rank 2 waits in barrier at tests/test_utils.py:"), text
        assert "the group is created on some ranks only" in text, text
        assert time.monotonic() - start < 15, "raised only after a long wait"
    dist.barrier()
    group = get_group([0, 1])  # made alike on every rank: it works
    if rank in (0, 1):
        assert dist.all_reduce(torch.tensor([rank + 1.0]), group=group).item() == 3.0
    assert dist.all_gather_object(rank) == list(range(size))


class _SlowOnTwo:
    """Decoded slowly on rank 2: it is still "in" the gather after the others left it."""

    def __setstate__(self, state):
        if dist.get_rank() == 2:
            time.sleep(2)
        self.__dict__.update(state)


@ranks(3)
def test_a_rank_still_decoding_a_finished_collective_is_not_a_skipped_creation():
    """Rank 2, still in all_gather_object (decoding), was taken for a rank waiting there
    for the others: a correct program was refused as a group created on some ranks."""
    rank, size = dist.get_rank(), dist.get_world_size()
    slow = _SlowOnTwo()
    slow.rank = rank
    assert [o.rank for o in dist.all_gather_object(slow)] == list(range(size))
    group = get_group([0, 1])  # every rank: rank 2 comes late, but comes
    if rank in (0, 1):
        assert dist.all_reduce(torch.tensor([rank + 1.0]), group=group).item() == 3.0
    assert dist.all_gather_object(rank) == list(range(size))


@ranks(3)
def test_a_rank_outside_a_rank_list_gets_what_get_group_gives_or_a_clear_error():
    """Rank 2 got torch's raw 'Invalid process group specified' from both."""
    rank = dist.get_rank()
    group = get_group([0, 1])
    assert get_cpu_group([0, 1]) is group  # gloo: the group itself, or the marker
    if rank < 2:
        assert get_comm_device([0, 1]) == torch.device("cpu")
    else:
        with pytest.raises(
            ValueError,
            match=r"get_comm_device: this rank \(global rank 2\) "
            r"is not a member of group \[0, 1\]",
        ):
            get_comm_device([1, 0])


def _new_world(path: str, rank: int, size: int) -> None:
    td.init_process_group("gloo", store=td.FileStore(path, size), rank=rank, world_size=size)


@ranks(2, timeout=20)
def test_cache_never_hands_out_a_group_from_a_destroyed_world():
    rank, size = dist.get_rank(), dist.get_world_size()
    path = dist.broadcast_object(tempfile.mktemp(prefix="distkit-world-") if rank == 0 else None)
    old = get_group([1])
    # a user bypasses distkit: torch's own destroy and init
    td.destroy_process_group()
    _new_world(path, rank, size)
    try:
        new = get_group([1])
        if rank == 1:  # rank 0 is no member: it holds torch's non-member marker both times
            assert new is not old and new.rank() == 0
        assert dist.all_gather_object(rank) == [0, 1]
        if rank == 1:
            with pytest.raises(ValueError, match="destroyed"):
                dist.all_gather(torch.ones(1), group=old)
        # destroy_dist forgets the cache and the world
        dist.destroy_dist()
        assert not dist.is_distributed() and dist.get_world_size() == 1
        assert dist.all_gather_object(rank) == [rank]  # single-process again
    finally:
        if td.is_initialized():
            td.destroy_process_group()
        # FileStore deletes its file when its last user goes; another rank may race us
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    # the pool notices its world is gone and starts a fresh one for the next test


@ranks(2)
def test_a_timeout_of_its_own_gets_a_group_of_its_own():
    world = dist.get_default_group()
    assert get_group([0, 1]) is world
    short = get_group([0, 1], timeout=5)
    assert short is not world and get_group([0, 1], timeout=5.0) is short
    assert get_group([0, 1], timeout=6) is not short
    assert dist.all_reduce(torch.ones(1), group=short).item() == 2
