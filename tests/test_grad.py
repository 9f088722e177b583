"""``grad=True``: gradients through collectives equal one process's on the full batch.

Convention (as ``torch.distributed.nn``): the loss differentiated is the sum of every
rank's loss. Each check computes, on every rank, its part of a loss from collective
results, runs backward, and compares each rank's input gradient with a single process
computing the sum of all ranks' losses on the full data.
"""

from __future__ import annotations

import pytest
import torch
from conftest import world

import distkit.dist as dist
from distkit.testing import ranks

GRAD_WORLDS = (0, 2, 3)


def _data(size: int, rows: int = 2, dim: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(size * rows, dim, generator=gen, dtype=torch.float64)
    w = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    return x, w


def _contrastive(mine: torch.Tensor, everyone: torch.Tensor, offset: int) -> torch.Tensor:
    """InfoNCE-like: each row of ``mine`` against every row, its own row the positive."""
    logits = mine @ everyone.T
    targets = torch.arange(offset, offset + mine.shape[0])
    return torch.nn.functional.cross_entropy(logits, targets, reduction="sum")


@ranks(*GRAD_WORLDS)
def test_all_gather_grad_matches_one_process_on_the_full_batch():
    rank, size = world()
    x_full, w_full = _data(size)
    # reference: one process, the sum of every rank's loss on the full batch
    x_ref, w_ref = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
    feats = x_ref @ w_ref
    total = sum(_contrastive(feats[2 * r : 2 * r + 2], feats, 2 * r) for r in range(size))
    total.backward()
    # distributed: each rank holds its slice, gathers every rank's features
    x = x_full[2 * rank : 2 * rank + 2].clone().requires_grad_()
    w = w_full.clone().requires_grad_()
    mine = x @ w
    gathered = dist.all_gather(mine, grad=True)
    assert len(gathered) == size and all(g.requires_grad for g in gathered)
    torch.testing.assert_close(torch.cat(gathered), feats.detach())
    _contrastive(mine, torch.cat(gathered), 2 * rank).backward()
    torch.testing.assert_close(x.grad, x_ref.grad[2 * rank : 2 * rank + 2])
    # a parameter every rank shares collects its gradient in parts: their sum is the whole
    torch.testing.assert_close(dist.all_reduce(w.grad.clone()), w_ref.grad)
    # same_shape=True and uneven shapes take the same route back
    x.grad = None
    gathered = dist.all_gather(x * 2, grad=True, same_shape=True)
    sum((r + 1) * g.sum() for r, g in enumerate(gathered)).backward()
    assert x.grad.tolist() == [[2.0 * size * (rank + 1)] * 3] * 2
    ragged = torch.ones(rank + 1, requires_grad=True)
    parts = dist.all_gather(ragged, grad=True)
    assert [p.shape[0] for p in parts] == [r + 1 for r in range(size)]
    sum(p.pow(2).sum() * (r + 1) for r, p in enumerate(parts)).backward()
    # every rank's loss weighs entry r by r + 1: rank r's input gets size * (r + 1) * 2x
    assert ragged.grad.tolist() == [2.0 * size * (rank + 1)] * (rank + 1)


@ranks(*GRAD_WORLDS)
def test_all_reduce_grad_sum_and_mean_match_one_process():
    rank, size = world()
    x_full, w_full = _data(size)
    for op in ("sum", "mean"):
        xs = [x_full[2 * r : 2 * r + 2].clone().requires_grad_() for r in range(size)]
        reduced = sum(xs) if op == "sum" else sum(xs) / size
        total = sum(((reduced * (r + 1)) @ w_full).tanh().sum() for r in range(size))
        total.backward()
        x = x_full[2 * rank : 2 * rank + 2].clone().requires_grad_()
        before = x.detach().clone()
        out = dist.all_reduce(x, op=op, grad=True)
        assert out is not x and torch.equal(x.detach(), before), "grad=True leaves data alone"
        torch.testing.assert_close(out.detach(), reduced.detach())
        ((out * (rank + 1)) @ w_full).tanh().sum().backward()
        torch.testing.assert_close(x.grad, xs[rank].grad)


@ranks(*GRAD_WORLDS)
def test_reduce_scatter_grad_matches_one_process():
    rank, size = world()
    x_full, _ = _data(size, rows=2 * size)  # every rank's input: (2 * size * size, 3)
    for op in ("sum", "mean"):
        xs = [x_full[r::size].clone().requires_grad_() for r in range(size)]
        reduced = sum(xs) if op == "sum" else sum(xs) / size
        chunks = reduced.chunk(size)
        sum((chunks[r].sin() * (r + 2)).sum() for r in range(size)).backward()
        x = x_full[rank::size].clone().requires_grad_()
        out = dist.reduce_scatter(x, op=op, grad=True)
        torch.testing.assert_close(out.detach(), chunks[rank].detach())
        (out.sin() * (rank + 2)).sum().backward()
        torch.testing.assert_close(x.grad, xs[rank].grad)
        # the list form: one chunk per rank
        pieces = [p.clone().requires_grad_() for p in x.detach().chunk(size)]
        out = dist.reduce_scatter(pieces, op=op, grad=True)
        (out.sin() * (rank + 2)).sum().backward()
        torch.testing.assert_close(torch.cat([p.grad for p in pieces]), xs[rank].grad)


def _inputs(size: int, ragged: bool = False) -> list[torch.Tensor]:
    """Every rank's input (rank r's has r + 1 rows when ``ragged``)."""
    gen = torch.Generator().manual_seed(11)
    rows = [r + 1 if ragged else 2 * size for r in range(size)]
    return [torch.randn(n, dtype=torch.float64, generator=gen) for n in rows]


#: Each case: what a rank computes from its input with distkit (``mine(x, rank)``), and
#: the same from every rank's inputs in one process (``alone(xs, rank)``).
_SECOND_ORDER = {
    "all_reduce sum": (
        lambda x, r: dist.all_reduce(x, grad=True) ** 3 * (r + 1),
        lambda xs, r: sum(xs) ** 3 * (r + 1),
    ),
    "all_reduce mean": (
        lambda x, r: dist.all_reduce(x, "mean", grad=True) ** 3 * (r + 1),
        lambda xs, r: (sum(xs) / len(xs)) ** 3 * (r + 1),
    ),
    "all_gather same_shape": (
        lambda x, r: torch.cat(
            [
                g**3 * (k + r + 1)
                for k, g in enumerate(dist.all_gather(x, grad=True, same_shape=True))
            ]
        ),
        lambda xs, r: torch.cat([g**3 * (k + r + 1) for k, g in enumerate(xs)]),
    ),
    "all_gather uneven": (
        lambda x, r: torch.cat(
            [g**3 * (k + r + 1) for k, g in enumerate(dist.all_gather(x, grad=True))]
        ),
        lambda xs, r: torch.cat([g**3 * (k + r + 1) for k, g in enumerate(xs)]),
    ),
    "reduce_scatter sum": (
        lambda x, r: dist.reduce_scatter(x, grad=True) ** 3 * (r + 1),
        lambda xs, r: sum(x.chunk(len(xs))[r] for x in xs) ** 3 * (r + 1),
    ),
    "reduce_scatter list mean": (
        lambda x, r: (
            dist.reduce_scatter(list(x.chunk(dist.get_world_size())), "mean", grad=True) ** 3
            * (r + 1)
        ),
        lambda xs, r: (sum(x.chunk(len(xs))[r] for x in xs) / len(xs)) ** 3 * (r + 1),
    ),
}


@ranks(*GRAD_WORLDS)
def test_second_derivatives_through_the_collectives_match_one_process():
    """A gradient penalty: torch.autograd.grad(create_graph=True), then backward through
    that gradient. The backward passes were not differentiable: the second derivative
    came out divided by the world size (all_reduce), or wrong (all_gather)."""
    rank, size = world()
    for name, (mine, alone) in _SECOND_ORDER.items():
        xs = _inputs(size, ragged=name.endswith("uneven"))
        # one process: every rank's loss and penalty, summed
        leaves = [x.clone().requires_grad_() for x in xs]
        total = sum(alone(leaves, r).sum() + (leaves[r] ** 2).sum() for r in range(size))
        firsts = torch.autograd.grad(total, leaves, create_graph=True)
        sum((g * (r + 2)).sum() for r, g in enumerate(firsts)).backward()
        # distributed: each rank its own loss (with a local term) and penalty
        x = xs[rank].clone().requires_grad_()
        (first,) = torch.autograd.grad(mine(x, rank).sum() + (x**2).sum(), x, create_graph=True)
        torch.testing.assert_close(first, firsts[rank].detach(), msg=name)
        (first * (rank + 2)).sum().backward()
        torch.testing.assert_close(x.grad, leaves[rank].grad, msg=name)


@ranks(0, 2)
def test_without_grad_results_carry_no_history_and_bad_grad_arguments_fail():
    rank, size = world()
    x = torch.ones(2 * size, requires_grad=True)
    assert dist.all_reduce(x.detach().clone()).grad_fn is None
    gathered = dist.all_gather(x * 1)
    assert all(g.grad_fn is None for r, g in enumerate(gathered) if r != rank)
    assert not dist.reduce_scatter(x * 1).requires_grad
    assert not dist.all_to_all_single(x * 1).requires_grad
    with pytest.raises(ValueError, match=r"all_reduce: grad=True supports op='sum' and"):
        dist.all_reduce(x, op="max", grad=True)
    with pytest.raises(ValueError, match="reduce_scatter: grad=True supports"):
        dist.reduce_scatter(x, op="product", grad=True)
    with pytest.raises(ValueError, match="grad=True cannot be combined with async_op"):
        dist.all_gather(x, async_op=True, grad=True)
    with pytest.raises(TypeError, match="grad must be True or False"):
        dist.all_gather(x, grad=1)
    with pytest.raises(TypeError, match="grad must be True or False"):
        dist.all_reduce(x, grad=None)
