"""Code written for mmengine.dist keeps working: distkit against mmengine 0.10.7 itself.

Each check runs the same call through ``mmengine.dist`` and ``distkit.dist`` in the same
world (no process group, and 2 or 3 gloo ranks) and compares what comes back. Where
distkit deliberately differs, docs/mmengine.md says so and why.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from conftest import world

import distkit.dist as dist
from distkit.testing import ranks

mm = pytest.importorskip("mmengine.dist")


def outcome(call):
    """What a call gives: its result, or the type of the exception it raises."""
    try:
        return "ok", call()
    except Exception as exc:
        return "raises", type(exc).__name__


def same_tensor(a, b) -> bool:
    return a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


@ranks(0, 2, 3)
def test_integer_mean_keeps_the_dtype_and_truncates_like_mmengine():
    rank, _ = world()
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.bool):
        if dtype is torch.bool:
            start = torch.tensor([rank == 0, False, True])
        else:
            values = [5, 7, 1] if dtype is torch.uint8 else [5, -5, 7, -7, 1, -1]
            start = torch.tensor([v * (rank + 1) for v in values]).to(dtype)
        theirs, ours = start.clone(), start.clone()
        mm.all_reduce(theirs, op="mean")
        assert dist.all_reduce(ours, op="mean") is ours
        assert same_tensor(ours, theirs), (dtype, ours, theirs)
    for op in ("SUM", "Mean", "max", "MIN"):
        theirs, ours = torch.tensor([1.0 + rank, -rank]), torch.tensor([1.0 + rank, -rank])
        mm.all_reduce(theirs, op=op)
        dist.all_reduce(ours, op=op)
        assert same_tensor(ours, theirs), op


@ranks(0, 2)
def test_all_reduce_dict_and_params_with_integer_means():
    rank, _ = world()
    theirs = {"a": torch.tensor([rank * 2, rank * 2 + 1]), "b": torch.tensor([5 - 10 * rank])}
    ours = {k: v.clone() for k, v in theirs.items()}
    theirs = mm.all_reduce_dict(theirs, op="mean") or theirs
    dist.all_reduce_dict(ours, op="mean")
    for key in ours:
        assert same_tensor(ours[key], theirs[key]), key
    params_theirs = [torch.tensor([3 * rank + 1]), torch.tensor([-5 * rank])]
    params_ours = [p.clone() for p in params_theirs]
    mm.all_reduce_params(params_theirs, op="mean")
    dist.all_reduce_params(params_ours, op="mean")
    assert all(same_tensor(a, b) for a, b in zip(params_ours, params_theirs))


@ranks(2)
def test_all_reduce_params_in_another_order_raises_where_mmengine_mixes_them():
    rank, _ = world()
    # 2 + 2 numbers on every rank; rank 1 holds its tensors in the other order
    order = [torch.full((2,), 1.0), torch.full((1, 2), 10.0)]
    theirs = order[::-1] if rank else order
    mixed = [t.clone() for t in theirs]
    mm.all_reduce_params(mixed)  # one bucket: rank 0's first tensor + rank 1's first
    assert mixed[0].flatten().tolist() == [11.0, 11.0]  # not 2.0: another tensor's values
    with pytest.raises(ValueError, match=r"params\[0\] has shape \(2,\) on rank 0"):
        dist.all_reduce_params([t.clone() for t in theirs])


def test_the_documented_single_process_differences_hold():
    """docs/mmengine.md's rows for a single process, against mmengine itself."""
    results = (1, 2, 3)
    assert mm.collect_results(results, 2) == (1, 2) and dist.collect_results(results, 2) == [1, 2]
    assert mm.collect_results([1, 2, 3], -1) == [1, 2]
    with pytest.raises(TypeError, match="size must be a non-negative int"):
        dist.collect_results([1, 2, 3], -1)
    data, out = {"a": torch.ones(1)}, {"b": torch.ones(1)}
    assert outcome(lambda: mm.cast_data_device(data, torch.device("cpu"), out=out)) == (
        "raises",
        "KeyError",
    )
    with pytest.raises(ValueError, match=r"out lacks 'a'; data has no 'b'"):
        dist.cast_data_device(data, torch.device("cpu"), out=out)
    assert outcome(lambda: mm.init_local_group(0, 1)) == ("raises", "ValueError")
    assert dist.init_local_group(0, 1) is None


@ranks(2)
def test_an_integer_mean_past_float32_is_exact_where_mmengine_rounds():
    rank, _ = world()
    start = torch.tensor([2**40 + 3 + 2 * rank])
    theirs, ours = start.clone(), start.clone()
    mm.all_reduce(theirs, op="mean")
    dist.all_reduce(ours, op="mean")
    assert theirs.item() == 2**40 and ours.item() == 2**40 + 4


GET_DATA_DEVICE_CASES = {
    "a tensor": lambda: torch.ones(2),
    "nested dict": lambda: {"a": torch.ones(1), "b": {"c": [torch.ones(2)]}},
    "set of tensors": lambda: {torch.ones(1), torch.zeros(1)},
    "generator": lambda: (t for t in [torch.ones(1), torch.zeros(2)]),
    "list with an int": lambda: [torch.ones(1), 123],
    "list with a dict of str": lambda: [torch.ones(1), {"key": "123"}],
    "set with an int": lambda: {torch.ones(1), 123},
    "dict with a list of str": lambda: {"key1": torch.ones(1), "key2": ["123"]},
    "a bare string": lambda: "123",
    "an int": lambda: 123,
    "None": lambda: None,
    "a NumPy array": lambda: np.zeros(2),
    "an empty list": lambda: [],
    "an empty list inside": lambda: [torch.ones(1), []],
}


@pytest.mark.parametrize("name", list(GET_DATA_DEVICE_CASES))
def test_get_data_device_accepts_and_refuses_what_mmengine_does(name):
    make = GET_DATA_DEVICE_CASES[name]
    assert outcome(lambda: dist.get_data_device(make())) == outcome(
        lambda: mm.get_data_device(make())
    )


CAST_CASES = {
    "a tensor": lambda: torch.ones(2),
    "dict of lists": lambda: {"a": [torch.ones(1), torch.zeros(2)], "b": torch.ones(3)},
    "tuple": lambda: (torch.ones(1), torch.zeros(1)),
}


@pytest.mark.parametrize("name", list(CAST_CASES))
def test_cast_data_device_moves_what_mmengine_moves(name):
    ours = dist.cast_data_device(CAST_CASES[name](), "cpu")
    theirs = mm.cast_data_device(CAST_CASES[name](), "cpu")
    flat_ours = ours if isinstance(ours, torch.Tensor) else torch.cat(_leaves(ours))
    flat_theirs = theirs if isinstance(theirs, torch.Tensor) else torch.cat(_leaves(theirs))
    assert type(ours) is type(theirs) and same_tensor(flat_ours, flat_theirs)
    # out= is filled in place, in both
    target, mine = torch.zeros(2), torch.zeros(2)
    mm.cast_data_device(torch.ones(2), "cpu", out=target)
    dist.cast_data_device(torch.ones(2), "cpu", out=mine)
    assert same_tensor(mine, target)


def _tensors(n: int = 2) -> dict:
    return {f"key{i}": torch.tensor([i, i + 1]) for i in range(1, n + 1)}


#: Every error message mmengine's own tests match (tests/test_dist/test_utils.py of
#: open-mmlab/mmengine; its test_dist.py matches none): name -> (function, arguments,
#: exception, mmengine's pattern).
MMENGINE_MESSAGES = {
    "get_data_device of a string": (
        "get_data_device",
        lambda: ("123",),
        TypeError,
        "data should be a Tensor, sequence of tensor or dict",
    ),
    "cast_data_device of an empty list": (
        "cast_data_device",
        lambda: ([], "cpu"),
        ValueError,
        "data should not be empty",
    ),
    "cast_data_device of an empty dict": (
        "cast_data_device",
        lambda: ({}, "cpu"),
        ValueError,
        "data should not be empty",
    ),
    "cast_data_device with a shorter out": (
        "cast_data_device",
        lambda: (_tensors(2), "cpu", _tensors(1)),
        ValueError,
        "length of data and out should be same",
    ),
    "cast_data_device of an int": (
        "cast_data_device",
        lambda: (123, "cpu"),
        TypeError,
        "data should be a Tensor, list of tensor or dict",
    ),
    "cast_data_device of a string": (
        "cast_data_device",
        lambda: ("123", "cpu"),
        TypeError,
        "data should be a Tensor, list of tensor or dict",
    ),
    "cast_data_device of a NumPy array": (
        "cast_data_device",
        lambda: (np.array([0, 1]), "cpu"),
        TypeError,
        "data should be a Tensor, list of tensor or dict",
    ),
    "cast_data_device with out of another type": (
        "cast_data_device",
        lambda: (torch.tensor([0, 1]), "cpu", "123"),
        TypeError,
        "out should be the same type with data",
    ),
    "cast_data_device with out a set": (
        "cast_data_device",
        lambda: ({0, 1}, "cpu", {2, 3}),
        TypeError,
        "out should not be a set",
    ),
}


@pytest.mark.parametrize("name", list(MMENGINE_MESSAGES))
def test_errors_start_with_the_words_mmengines_tests_match(name):
    """The same exception and the same ``match`` pass for both; distkit's message starts
    with mmengine's words and goes on to name the function and what was wrong."""
    fn, make, error, pattern = MMENGINE_MESSAGES[name]
    with pytest.raises(error, match=pattern):
        getattr(mm, fn)(*make())
    with pytest.raises(error, match=pattern) as ours:
        getattr(dist, fn)(*make())
    message = str(ours.value)
    assert message.startswith(pattern) and f"({fn}: " in message, message


def _leaves(data):
    if isinstance(data, torch.Tensor):
        return [data.reshape(-1)]
    items = data.values() if isinstance(data, dict) else data
    return [leaf for item in items for leaf in _leaves(item)]


@ranks(0, 2, 3)
def test_sync_random_seed_draws_from_numpy_like_mmengine():
    np.random.seed(0)
    theirs = mm.sync_random_seed()
    after_theirs = np.random.random()
    np.random.seed(0)
    ours = dist.sync_random_seed()
    after_ours = np.random.random()
    assert ours == theirs and after_ours == after_theirs  # one draw, the same draw
    assert dist.all_gather_object(ours) == [ours] * dist.get_world_size()


@ranks(0, 2, 3)
def test_object_collectives_and_collect_results_return_mmengine_values():
    rank, size = world()
    obj = {"rank": rank, "t": torch.arange(rank + 1), "text": "x" * rank}
    for ours, theirs in (
        (dist.all_gather_object(obj), mm.all_gather_object(obj)),
        (dist.gather_object(obj), mm.gather_object(obj)),
    ):
        assert (ours is None) == (theirs is None)
        for a, b in zip(ours or [], theirs or []):
            assert a["rank"] == b["rank"] and a["text"] == b["text"] and torch.equal(a["t"], b["t"])
    theirs = ["foo", 12, {1: 2}] if rank == 0 else [None, None, None]
    ours = list(theirs)
    mm.broadcast_object_list(theirs)
    assert dist.broadcast_object_list(ours) == theirs
    results = [f"sample {i}" for i in range(rank, 11, size)]  # a DistributedSampler's shard
    assert dist.collect_results(results, 11) == mm.collect_results(results, 11, "gpu")
    assert dist.get_dist_info() == mm.get_dist_info() and dist.is_main_process() == (rank == 0)


def test_mmengine_import_paths_have_counterparts():
    for path in ("dist", "utils"):
        theirs = importlib.import_module(f"mmengine.dist.{path}")
        ours = importlib.import_module(f"distkit.dist.{path}")
        public = [
            name
            for name, value in vars(theirs).items()
            if not name.startswith("_")
            and callable(value)
            and getattr(value, "__module__", "") == theirs.__name__
        ]
        assert public, path
        missing = [name for name in public if not hasattr(ours, name)]
        assert not missing, f"distkit.dist.{path} lacks {missing}"
        for name in public:
            assert getattr(ours, name) is getattr(dist, name)
    from distkit.dist.dist import sync_random_seed  # mmengine's own tests import this

    assert sync_random_seed is dist.sync_random_seed
