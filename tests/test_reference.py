"""The reference documents' examples, with their own numbers and degraded to one process."""

from __future__ import annotations

import collectives_tour as tour
import torch

import distkit.dist as dist
from distkit.testing import ranks


@ranks(0, 1, 3, 4)
def test_broadcast_object_list_example():
    # torch's example assumes 3 ranks; it holds for any number
    assert tour.broadcast_object_list_example() == ["foo", 12, {1: 2}]


@ranks(3)
def test_all_gather_object_example_three_ranks():
    assert tour.all_gather_object_example() == ["foo", 12, {1: 2}]


@ranks(0, 1)
def test_all_gather_object_example_degraded():
    # mmengine's non-distributed example: a list of this rank's item only
    assert tour.all_gather_object_example() == ["foo"]


@ranks(0, 1, 4)
def test_reduce_scatter_example():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = tour.reduce_scatter_example()
    assert out.shape == () and out.item() == world * rank  # 4 ranks: 0, 4, 8, 12


@ranks(4)
def test_all_to_all_examples_four_ranks():
    rank = dist.get_rank()
    even = [t.tolist() for t in tour.all_to_all_example()]
    assert even == [[rank], [rank + 4], [rank + 8], [rank + 12]]
    uneven = [t.tolist() for t in tour.all_to_all_uneven_example()]
    assert (
        uneven
        == [
            [[0, 1], [10, 11, 12], [20, 21], [30, 31]],
            [[2, 3], [13, 14], [22], [32, 33]],
            [[4], [15, 16], [23], [34, 35]],
            [[5], [17, 18], [24], [36]],
        ][rank]
    )
    complex_out = tour.all_to_all_complex_example()
    assert all(t.dtype == torch.cfloat for t in complex_out)
    k = rank + 1
    assert [t.item() for t in complex_out] == [(k + 4 * s) * (1 + 1j) for s in range(4)]


@ranks(0, 1)
def test_all_to_all_examples_degraded():
    assert [t.tolist() for t in tour.all_to_all_example()] == [[0]]
    assert [t.tolist() for t in tour.all_to_all_uneven_example()] == [[0, 1, 2, 3, 4, 5]]
    assert [t.item() for t in tour.all_to_all_complex_example()] == [1 + 1j]


@ranks(2, 3)
def test_all_to_all_uneven_example_other_worlds():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = tour.all_to_all_uneven_example()
    sent = [tour.UNEVEN_INPUTS[s] for s in range(world)]
    for s, t in enumerate(out):
        splits = tour._uneven_splits(len(sent[s]), world)
        start = sum(splits[:rank])
        assert t.tolist() == sent[s][start : start + splits[rank]]
