"""The lean lane of ``all_reduce(t)``: taken for the plain call, stepped aside from otherwise.

Whichever way a call goes, its result is the same; ``collective_calls`` tells the ways
apart (the lane calls the process group itself, the checked path ``td.all_reduce``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as td
from conftest import collective_calls, debug_mode, world
from torch.overrides import TorchFunctionMode

import distkit.dist as dist
from distkit import _settings
from distkit.dist import CollectiveTimeoutError
from distkit.local.pool import RankPool
from distkit.testing import ranks


def _summed(make, **kwargs):
    """All-reduce ``make(rank)``; return the result and the torch collectives it made.

    The default check is off: the calls it checks (the first ones at a call site) take
    the checked path on purpose (tests/test_safe_default.py counts them)."""
    _settings.set("check", False)
    rank, size = world()
    t = make(rank)
    with collective_calls() as calls:
        out = dist.all_reduce(t, **kwargs)
    assert out is t
    expected = sum(make(r).double() for r in range(size))
    assert torch.equal(out.double(), expected), (out, expected)
    return list(calls)


@ranks(2, 3)
def test_the_plain_call_takes_the_lane():
    dist.all_reduce(torch.ones(1), op="max")  # the group's facts, learned once
    assert _summed(lambda r: torch.arange(6.0).view(2, 3) * (r + 1)) == []
    assert _summed(lambda r: torch.tensor([r, 7], dtype=torch.int64), op="sum") == []


@ranks(2, 3)
def test_other_calls_take_the_checked_path():
    dist.all_reduce(torch.ones(1), op="max")
    checked = ["all_reduce"]
    assert _summed(lambda r: torch.arange(6.0).view(2, 3).t() + r) == checked  # strided
    assert _summed(lambda r: torch.tensor([r + 1.0]), op=td.ReduceOp.SUM) == checked
    assert _summed(lambda r: torch.tensor([r + 1.0]), group=list(range(world()[1]))) == checked
    # a lazily negated view (the imaginary part of a conjugate): torch's own call would
    # reduce the raw memory and leave each rank its own value
    negated = _summed(lambda r: torch.tensor([complex(1, r + 1)]).conj().imag)
    assert negated == checked
    # dtypes gloo does not sum natively are converted by the checked path
    assert _summed(lambda r: torch.tensor([r], dtype=torch.int8)) != []
    with debug_mode():  # debug mode compares the ranks' calls first: the checked path
        assert "all_reduce" in _summed(lambda r: torch.tensor([r + 1.0]))


@ranks(2, 3)
def test_tensors_without_dense_memory_step_aside_and_get_a_clear_error():
    dist.all_reduce(torch.ones(1), op="max")
    rank, size = world()
    kinds = {
        "sparse_coo": torch.eye(2).to_sparse(),
        "sparse_csr": torch.eye(2).to_sparse_csr(),
        "mkldnn": torch.ones(2).to_mkldnn(),
        "meta": torch.ones(2, device="meta"),
    }
    for kind, t in kinds.items():
        with pytest.raises(TypeError) as caught:
            dist.all_reduce(t)
        assert str(caught.value).startswith(f"all_reduce: data is a {kind} tensor;"), kind
        assert f"(on rank {rank} of {size})" in str(caught.value)
    # the ranks are still in step: nothing was sent
    assert dist.all_reduce(torch.ones(1)).item() == size


@ranks(2)
def test_a_tensor_that_requires_grad_is_reduced_outside_autograd():
    import warnings

    dist.all_reduce(torch.ones(1), op="max")
    w = torch.ones(3, requires_grad=True)
    with collective_calls() as calls:
        assert dist.all_reduce(w) is w
    assert calls == ["all_reduce"] and w.tolist() == [2.0] * 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns of an op with no autograd kernel
        (w * 2).sum().backward()
    assert w.grad.tolist() == [2.0] * 3


class _Counting(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


@ranks(2)
def test_a_torch_function_mode_sees_the_call_as_with_torch():
    dist.all_reduce(torch.ones(1), op="max")
    with _Counting() as mode:
        td.all_reduce(torch.ones(1))
    torch_shows_it = "all_reduce" in mode.seen  # torch 2.4 does not, newer ones do
    t = torch.ones(2)
    with _Counting() as mode:
        dist.all_reduce(t)
    assert ("all_reduce" in mode.seen) == torch_shows_it and t.tolist() == [2.0, 2.0]


@ranks(2)
def test_inside_torch_coalescing_manager():
    from torch.distributed.distributed_c10d import _coalescing_manager

    dist.all_reduce(torch.ones(1), op="max")
    a, b = torch.ones(2), torch.full((3,), 2.0)
    with _coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
        assert a.tolist() == [1.0] * 2, "torch runs the calls together when the block ends"
    cm.wait()
    assert a.tolist() == [2.0] * 2 and b.tolist() == [4.0] * 3


def _lone_all_reduce():
    import time

    rank, _ = world()
    dist.all_reduce(torch.ones(1), op="max")
    if rank == 1:
        time.sleep(6)  # never joins rank 0's call
        return None
    try:
        dist.all_reduce(torch.ones(4))
    except CollectiveTimeoutError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(90)
def test_a_timeout_in_the_lane_names_the_missing_rank():
    with RankPool(2, pg_timeout=2, timeout=60) as pool:
        message = pool.run(_lone_all_reduce)[0]
    assert "all_reduce" in message and "rank 1" in message, message
