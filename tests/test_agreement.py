"""One process and many ranks agree: every bad argument fails the same way everywhere.

The table below holds bad (and borderline) arguments for every public function. Each
runs in four ways: with no process group through the function as users call it (its
compiled shortcut, where it has one), with no process group through the checked path
alone (``fn.__wrapped__``), and on every rank of 1, 2 and 3 gloo ranks. The exception
type and message must be the same in all of them; with no group and on one rank they
must match exactly, on more ranks up to the numbers (a list of ``size + 1`` tensors says
"got 3" on 2 ranks and "got 4" on 3).
"""

from __future__ import annotations

import re
import threading
from typing import Any, Callable, NamedTuple

import numpy as np
import pytest
import torch

import distkit.dist as dist
from distkit.utils import cast_data_device, get_comm_device, get_data_device, get_group


class Case(NamedTuple):
    name: str
    fn: str  # a name in distkit.dist, or "utils.<name>"
    call: Callable[[int, int], tuple[tuple, dict]]  # (rank, size) -> (args, kwargs)
    error: type[Exception] | None  # None: the call must succeed


def _t() -> torch.Tensor:
    return torch.ones(2)


def _i0() -> torch.Tensor:
    return torch.tensor(0)


def case(name: str, fn: str, error: type[Exception] | None, *args: Any, **kwargs: Any) -> Case:
    """A case whose arguments do not depend on the world."""
    return Case(name, fn, lambda rank, size: (args, kwargs), error)


def ranked(name: str, fn: str, error: type[Exception] | None, build: Callable) -> Case:
    """A case whose arguments depend on this rank: ``build(rank, size) -> (args, kwargs)``."""
    return Case(name, fn, build, error)


def sized(name: str, fn: str, error: type[Exception] | None, build: Callable) -> Case:
    """A case whose arguments depend on the world size: ``build(size) -> (args, kwargs)``."""
    return Case(name, fn, lambda rank, size: build(size), error)


LOCK = threading.Lock()
C64 = torch.complex64

CASES = [
    # all_reduce
    case("data is a list", "all_reduce", TypeError, [1, 2]),
    case("data is None", "all_reduce", TypeError, None),
    case("unknown op", "all_reduce", ValueError, _t(), "median"),
    case("op is an int", "all_reduce", TypeError, _t(), 3),
    case("op is None", "all_reduce", TypeError, _t(), None),
    case("bxor on floats", "all_reduce", TypeError, _t(), "bxor"),
    case("max on complex", "all_reduce", TypeError, torch.ones(1, dtype=C64), "max"),
    case("group is a string", "all_reduce", TypeError, _t(), group="world"),
    sized("group out of range", "all_reduce", ValueError, lambda n: ((_t(),), {"group": [0, n]})),
    case("group is empty", "all_reduce", ValueError, _t(), group=[]),
    case("async_op is a string", "all_reduce", TypeError, _t(), async_op="yes"),
    case("async_op is None", "all_reduce", TypeError, _t(), async_op=None),
    case("async_op is 1", "all_reduce", TypeError, _t(), async_op=1),
    case("op='avg' is mean", "all_reduce", None, _t(), "avg"),
    case("op in capitals", "all_reduce", None, _t(), "SUM"),
    case("int16 (gloo has no int16)", "all_reduce", None, torch.ones(2, dtype=torch.int16)),
    case("uint64 max", "all_reduce", None, torch.ones(2, dtype=torch.uint64), "max"),
    case("float8 mean", "all_reduce", None, torch.ones(2).to(torch.float8_e5m2), "mean"),
    # tensors without one dense block of memory (a single process's shortcut only tests
    # the class, so these go through calls it does not take: see _args.dense)
    case("sparse data", "all_reduce", TypeError, torch.eye(2).to_sparse(), "max"),
    case("meta data", "all_reduce", TypeError, torch.ones(2, device="meta"), "min"),
    case("sparse data", "reduce_scatter", TypeError, torch.eye(2).to_sparse()),
    sized(
        "a sparse tensor in the list",
        "all_to_all",
        TypeError,
        lambda n: (([_t()] * (n - 1) + [torch.eye(2).to_sparse()],), {}),
    ),
    # all_gather, gather
    case("data is None", "all_gather", TypeError, None),
    case("data is a string", "all_gather", TypeError, "tensor"),
    case("same_shape is a string", "all_gather", TypeError, _t(), same_shape="no"),
    case("group is a float", "all_gather", TypeError, _t(), group=1.5),
    case("26 dims", "all_gather", None, torch.zeros([1] * 26)),
    case("dst is -1", "gather", ValueError, _t(), dst=-1),
    sized("dst is the size", "gather", ValueError, lambda n: ((_t(),), {"dst": n})),
    case("dst is a string", "gather", TypeError, _t(), dst="0"),
    case("dst is 0.0", "gather", TypeError, _t(), dst=0.0),
    case("dst is True", "gather", TypeError, _t(), dst=True),
    case("dst is numpy's 0", "gather", None, _t(), dst=np.int64(0)),
    # broadcast, reduce
    case("src is 0.0", "broadcast", TypeError, _t(), src=0.0),
    case("src is None", "broadcast", TypeError, _t(), src=None),
    case("src is numpy's 0", "broadcast", None, _t(), src=np.int64(0)),
    sized("src is the size", "broadcast", ValueError, lambda n: ((_t(),), {"src": n})),
    case("data is a list", "broadcast", TypeError, [1.0]),
    case("async_op is a string", "broadcast", TypeError, _t(), async_op="yes"),
    case("dst is 0.0", "reduce", TypeError, _t(), dst=0.0),
    case("unknown op", "reduce", ValueError, _t(), op="median"),
    case("bor on floats", "reduce", TypeError, _t(), op="bor"),
    # reduce_scatter
    case("scalar", "reduce_scatter", ValueError, torch.tensor(1.0)),
    sized("list too long", "reduce_scatter", ValueError, lambda n: (([_t()] * (n + 1),), {})),
    case("a string", "reduce_scatter", TypeError, "chunks"),
    # all_to_all, all_to_all_single
    case("data is a tensor", "all_to_all", TypeError, _t()),
    sized("list too long", "all_to_all", ValueError, lambda n: (([_t()] * (n + 1),), {})),
    sized("same_shape is 1", "all_to_all", TypeError, lambda n: (([_t()] * n,), {"same_shape": 1})),
    case("0-dim data", "all_to_all_single", ValueError, torch.tensor(1.0)),
    sized(
        "splits do not sum",
        "all_to_all_single",
        ValueError,
        lambda n: ((torch.arange(n * 2),), {"input_split_sizes": [3] * n}),
    ),
    sized(
        "negative split",
        "all_to_all_single",
        ValueError,
        lambda n: ((torch.arange(n * 2),), {"input_split_sizes": [-1] + [0] * (n - 1)}),
    ),
    sized(
        "float splits",
        "all_to_all_single",
        TypeError,
        lambda n: ((torch.arange(n * 2),), {"output_split_sizes": [1.5] * n}),
    ),
    sized(
        "own rows differ",
        "all_to_all_single",
        ValueError,
        lambda n: ((torch.arange(n * 2),), {"output_split_sizes": [1] * n}),
    ),
    sized(
        "own rows differ from input_split_sizes",
        "all_to_all_single",
        ValueError,
        lambda n: (
            (torch.arange(n * 3),),
            {"input_split_sizes": [3] * n, "output_split_sizes": [2] * n},
        ),
    ),
    sized(
        "too many splits",
        "all_to_all_single",
        ValueError,
        lambda n: ((torch.arange(n * 2),), {"input_split_sizes": [2] * (n + 1)}),
    ),
    # scatter: bad data on src reaches every rank
    case("data is None", "scatter", TypeError, None),
    sized("list too long", "scatter", ValueError, lambda n: (([_t()] * (n + 1),), {})),
    case("src is 0.0", "scatter", TypeError, None, src=0.0),
    case("a tensor, not a list", "scatter", TypeError, torch.arange(6.0).reshape(2, 3)),
    sized("a list of lists", "scatter", TypeError, lambda n: (([[1.0, 2.0]] * n,), {})),
    case("group is a dict", "barrier", TypeError, group={}),
    # object collectives
    case("a lock", "all_gather_object", TypeError, {"lock": LOCK}),
    case("a lambda", "all_gather_object", TypeError, [1, lambda: 0]),
    case("map_location is bogus", "all_gather_object", ValueError, 1, map_location="bogus"),
    case("serializer is json", "all_gather_object", ValueError, 1, serializer="json"),
    case("dst is 0.0", "gather_object", TypeError, 1, dst=0.0),
    case("a generator", "gather_object", TypeError, (x for x in ())),
    case("data is a string", "broadcast_object_list", TypeError, "not a list"),
    case("src is -1", "broadcast_object_list", ValueError, [1], src=-1),
    case("a lock", "broadcast_object", TypeError, LOCK),
    case("map_location is 3j", "broadcast_object", ValueError, 1, map_location=3j),
    case(  # refused before any communication, not by the receivers once tensors arrive
        "map_location has no device",
        "all_gather_object",
        None if torch.cuda.is_available() else ValueError,
        torch.ones(1),
        map_location="cuda",
    ),
    case(
        "map_location past the devices", "broadcast_object", ValueError, 1, map_location="cuda:64"
    ),
    case("map_location of a plugin", "all_gather_object", ValueError, 1, map_location="xla"),
    case("data is None", "scatter_object_list", TypeError, None),
    sized(
        "list too long", "scatter_object_list", ValueError, lambda n: ((list(range(n + 1)),), {})
    ),
    sized("list too long", "all_to_all_object", ValueError, lambda n: ((list(range(n + 1)),), {})),
    case("data is a dict", "all_to_all_object", TypeError, {"a": 1}),
    # point to point: a peer is another rank of the group; tags and options are checked
    # first, since in a world of one rank every dst and src is refused
    ranked("dst is this rank", "send", ValueError, lambda rank, size: ((_t(), rank), {})),
    sized("dst is the size", "send", ValueError, lambda n: ((_t(), n), {})),
    case("dst is -1", "send", ValueError, _t(), -1),
    case("dst is 1.0", "send", TypeError, _t(), 1.0),
    case("dst is None", "send", TypeError, _t(), None),
    case("a sparse tensor", "send", TypeError, torch.eye(2).to_sparse(), 0),
    case("tag is -1", "send", ValueError, _t(), 0, tag=-1),
    case("tag is 2**30", "send", ValueError, _t(), 0, tag=2**30),
    case("tag is a string", "send", TypeError, _t(), 0, tag="a"),
    case("async_op is 1", "send", TypeError, _t(), 0, async_op=1),
    ranked("src is this rank", "recv", ValueError, lambda rank, size: ((rank,), {})),
    sized("src is the size", "recv", ValueError, lambda n: ((n,), {})),
    case("src is a string", "recv", TypeError, "0"),
    case("tag is True", "recv", TypeError, 0, tag=True),
    case("async_op is None", "recv", TypeError, 0, async_op=None),
    ranked("dst is this rank", "isend", ValueError, lambda rank, size: ((_t(), rank), {})),
    ranked("src is this rank", "irecv", ValueError, lambda rank, size: ((rank,), {})),
    sized("src is the size", "irecv", ValueError, lambda n: ((n,), {})),
    case("sends is a list", "exchange", TypeError, [_t()], [0]),
    case("recv_from is a string", "exchange", TypeError, {}, "0"),
    case("recv_from is an int", "exchange", TypeError, {}, 0),
    sized("a key out of range", "exchange", ValueError, lambda n: (({n: _t()}, []), {})),
    sized("a source out of range", "exchange", ValueError, lambda n: (({}, [n]), {})),
    case("a float key", "exchange", TypeError, {0.0: _t()}, []),
    ranked(
        "two keys for one rank",
        "exchange",
        ValueError,
        lambda rank, size: (({rank: _t(), torch.tensor(rank): _t()}, [rank]), {}),
    ),
    ranked(
        "a source twice",
        "exchange",
        ValueError,
        lambda rank, size: (({rank: _t()}, [rank, rank]), {}),
    ),
    ranked("this rank received, not sent", "exchange", ValueError, lambda r, n: (({}, [r]), {})),
    ranked("this rank sent, not received", "exchange", ValueError, lambda r, n: (({r: 1}, []), {})),
    ranked("this rank's own entry", "exchange", None, lambda r, n: (({r: _t()}, [r]), {})),
    case("nothing at all", "exchange", None, {}, []),
    case("tag is -1", "exchange", ValueError, {}, [], tag=-1),
    ranked(
        "a sparse tensor to itself",
        "exchange",
        TypeError,
        lambda r, n: (({r: torch.eye(2).to_sparse()}, [r]), {}),
    ),
    # helpers
    case("data is a list", "all_reduce_dict", TypeError, [1]),
    case("a value is an int", "all_reduce_dict", TypeError, {"n": 3}),
    case("unknown op", "all_reduce_dict", ValueError, {"n": _t()}, op="median"),
    case("bucket_size_mb is a string", "all_reduce_params", TypeError, [_t()], bucket_size_mb="x"),
    case("coalesce is a string", "all_reduce_params", TypeError, [_t()], coalesce="yes"),
    case("a parameter is a list", "all_reduce_params", TypeError, [[1.0]]),
    case("group is a string", "sync_random_seed", TypeError, group="x"),
    case("results is a string", "collect_results", TypeError, "abc", 3),
    case("size is negative", "collect_results", TypeError, [1], -1),
    case("unknown order", "collect_results", ValueError, [1], 1, order="zigzag"),
    case("dst is 9", "collect_results", ValueError, [1], 1, dst=9),
    case("sampler is a range", "collect_results", TypeError, [1], 1, sampler=range(1)),
    case("sampler and indices", "collect_results", ValueError, [1], 1, indices=[0], sampler=[0]),
    case("a float index", "collect_results", TypeError, [1], 1, indices=[0.5]),
    case("a bool index", "iter_results", TypeError, [1], 1, indices=[True]),
    case("NumPy, tensor indices", "collect_results", None, [1, 2], 2, indices=[np.int64(1), _i0()]),
    case("results is a string", "iter_results", TypeError, "abc", 3),
    case("size is negative", "iter_results", TypeError, [1], -1),
    case("unknown order", "iter_results", ValueError, [1], 1, order="zigzag"),
    case("dst is 9", "iter_results", ValueError, [1], 1, dst=9),
    case("dst is None", "iter_results", TypeError, [1], 1, dst=None),
    case("chunk_bytes is 0", "iter_results", TypeError, [1], 1, chunk_bytes=0),
    case("indices too short", "iter_results", ValueError, [1, 2], 2, indices=[0]),
    case("sampler is a range", "iter_results", TypeError, [1], 1, sampler=range(1)),
    case("unknown serializer", "iter_results", ValueError, [1], 1, serializer="json"),
    # world information and set-up
    case("group is a string", "get_rank", TypeError, group="x"),
    case("group out of range", "get_world_size", ValueError, group=[9]),
    case("group is a float", "get_backend", TypeError, group=3.0),
    case("group is a dict", "get_dist_info", TypeError, group={}),
    case("group is a string", "is_main_process", TypeError, group="x"),
    case("unknown launcher", "init_dist", ValueError, "kubernetes"),
    case("unknown init_backend", "init_dist", ValueError, "none", init_backend="deepspeed"),
    # utilities
    case("ranks repeat", "utils.get_group", ValueError, [0, 0]),
    case("ranks hold a string", "utils.get_group", TypeError, ["0"]),
    case("group is a string", "utils.get_comm_device", TypeError, "x"),
    case("device is bogus", "utils.cast_data_device", RuntimeError, _t(), "bogus"),
    case("no tensor", "utils.get_data_device", TypeError, {"a": 1}),
    case("an empty list", "utils.get_data_device", ValueError, [torch.ones(1), []]),
    case("a string", "utils.get_data_device", TypeError, "123"),
]
IDS = [f"{c.fn}: {c.name}" for c in CASES]

UTILS = {
    "get_group": get_group,
    "get_comm_device": get_comm_device,
    "cast_data_device": cast_data_device,
    "get_data_device": get_data_device,
}


def function(name: str) -> Callable:
    return UTILS[name[6:]] if name.startswith("utils.") else getattr(dist, name)


def outcome(fn: Callable, c: Case, rank: int, size: int) -> tuple[str, str]:
    """``(exception type, message)`` of a call, or ``("ok", "")``."""
    args, kwargs = c.call(rank, size)
    try:
        result = fn(*args, **kwargs)
        if isinstance(result, dist.Handle):
            result.wait()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def run_cases() -> list[tuple[str, str]]:
    """Every case on this rank; afterwards the group must still work."""
    rank, size = dist.get_rank(), dist.get_world_size()
    out = [outcome(function(c.fn), c, rank, size) for c in CASES]
    assert dist.all_reduce(torch.ones(1)).item() == size, "a case left the group broken"
    return out


#: Collectives in which only the source holds data: its bad argument reaches the other
#: ranks inside their own error, which names the source.
ROOTED = {"scatter", "scatter_object_list", "broadcast_object"}


def _numbers(message: str) -> str:
    """``message`` without what depends on the world size or the process."""
    message = re.sub(r"0x[0-9a-f]+", "0x#", message)  # object addresses
    message = re.sub(r"\[[\d, ]*\]", "[#]", message)  # lists of sizes or ranks
    return re.sub(r"\d+", "#", message)


def _agrees(c: Case, rank: int, mine: tuple[str, str], alone: tuple[str, str]) -> bool:
    if mine[0] != alone[0]:
        return False
    if c.fn in ROOTED and rank != 0 and alone[0] != "ok":
        # the source's own message (without the call's name and place), inside this rank's
        source = re.sub(r" \(on rank # of #\)", "", _numbers(alone[1]))
        told = source.removeprefix(f"{c.fn}: ").split(". ")[0]
        return told in _numbers(mine[1])
    return _numbers(mine[1]) == _numbers(alone[1])


@pytest.fixture(scope="module")
def single_process() -> list[tuple[str, str]]:
    return [outcome(function(c.fn), c, 0, 1) for c in CASES]


@pytest.mark.parametrize("index", range(len(CASES)), ids=IDS)
def test_single_process_raises_what_the_case_says(single_process, index):
    c = CASES[index]
    kind, message = single_process[index]
    assert kind == (c.error.__name__ if c.error else "ok"), message
    if c.error is not None and not c.fn.startswith("utils.") and c.fn != "init_dist":
        assert "(on rank 0 of 1)" in message, "the message must say where it happened"


SHORTCUTS = [i for i, c in enumerate(CASES) if hasattr(function(c.fn), "__wrapped__")]


@pytest.mark.parametrize("index", SHORTCUTS, ids=[IDS[i] for i in SHORTCUTS])
def test_shortcut_and_checked_path_agree(single_process, index):
    c = CASES[index]
    checked = outcome(function(c.fn).__wrapped__, c, 0, 1)
    assert checked[0] == single_process[index][0]
    assert _numbers(checked[1]) == _numbers(single_process[index][1])


@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_world_agrees_with_a_single_process(single_process, rank_pool, size):
    per_rank = rank_pool(size).run(run_cases, timeout=120)
    problems = []
    for rank, results in enumerate(per_rank):
        for c, mine, alone in zip(CASES, results, single_process):
            if not _agrees(c, rank, mine, alone):
                problems.append(f"{c.fn}: {c.name} on rank {rank} of {size}: {mine} != {alone}")
    assert not problems, "\n".join(problems)
