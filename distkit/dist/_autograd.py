"""Differentiable collectives: what ``grad=True`` runs.

Convention, the one of ``torch.distributed.nn``: the loss being differentiated is the
**sum of every rank's loss**. Each rank's backward pass then delivers, to each rank's
input, the gradient of that total. So if every rank holds a slice of a batch, gathers
everyone's features and computes a loss on them, the gradients equal those of one process
computing the sum of those losses over the full batch (divide by the world size for the
mean: e.g. ``loss / world_size``, as DDP does).

- ``all_gather``: forward gathers; backward sends each rank the gradients every rank
  computed for its entry, and sums them (a reduce-scatter of the gradients).
- ``all_reduce`` (``sum``, ``mean``): forward reduces; backward all-reduces the
  gradients the same way (for ``mean`` each rank's input counts ``1 / size``).
- ``reduce_scatter`` (``sum``, ``mean``): forward reduce-scatters; backward all-gathers
  the gradients of the chunks.

Every rank must run the backward pass (it is collective too). The functions resolve
``group`` again in backward, so a group given as a rank list or mesh dimension works.
Each backward is made of these functions again, so it is differentiable in turn: a
second derivative (``torch.autograd.grad(..., create_graph=True)``, a gradient penalty)
goes through the collectives as the first does.
Results are new tensors (``all_reduce`` with ``grad=True`` does not write into its input)
whose ``grad_fn`` leads back to the inputs; in a single process they equal the inputs.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import Tensor

from distkit.dist._route import resolve
from distkit.dist.core.args import OPS, Op, fail
from distkit.dist.core.comm import Comm

_DIFFERENTIABLE = ("sum", "mean")


def check_op(op: Op, fn: str, comm: Comm) -> None:
    if op.name not in _DIFFERENTIABLE:
        fail(
            ValueError,
            fn,
            comm,
            f"grad=True supports op='sum' and op='mean', got op='{op.name}'",
            "Reduce without grad=True, or express the loss through a sum",
        )


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, data: Tensor, op: Op, group: Any) -> Tensor:
        ctx.op, ctx.group = op, group
        comm = resolve(group, "all_reduce")
        out = data.detach().clone()
        comm.backend.all_reduce(comm, out, op, False)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        # the same reduction (mean: the sum / size), itself differentiable
        return _AllReduce.apply(grad.contiguous(), ctx.op, ctx.group), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, data: Tensor, group: Any, same_shape: bool) -> tuple[Tensor, ...]:
        ctx.group, ctx.same_shape = group, same_shape
        comm = resolve(group, "all_gather")
        plain = data.detach()
        parts = comm.backend.all_gather(comm, plain, False, same_shape)
        assert isinstance(parts, list)
        # this rank's entry too is a new tensor: an output aliasing the input would make
        # later in-place edits of one silently change the other
        return tuple(p.clone() if p is plain else p for p in parts)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        sends = [g.contiguous() for g in grads]  # autograd fills unused ones with zeros
        # rank k computed sends[r] for rank r's input: send it there, and add up
        if ctx.same_shape:  # a reduce-scatter (which torch.compile can trace)
            return (
                _ReduceScatter.apply(sends[0], OPS["sum"], ctx.group, True, *sends[1:]),
                None,
                None,
            )
        received = _AllToAll.apply(ctx.group, *sends)
        total = received[0]
        for part in received[1:]:
            total = total + part
        return total, None, None


class _AllToAll(torch.autograd.Function):
    """All-to-all of tensors of any shapes (what the uneven all_gather's backward sends);
    its backward sends each gradient back where its tensor came from."""

    @staticmethod
    def forward(ctx: Any, group: Any, *sends: Tensor) -> tuple[Tensor, ...]:
        ctx.group = group
        comm = resolve(group, "all_gather")
        received = comm.backend.all_to_all(comm, [t.detach() for t in sends], False, False)
        assert isinstance(received, list)
        return tuple(received)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        return (None, *_AllToAll.apply(ctx.group, *(g.contiguous() for g in grads)))


class _ReduceScatter(torch.autograd.Function):
    # a tensor first (the whole input, or the first chunk of a list): dynamo, tracing the
    # all_gather backward that applies this function, took an Op passed first for ctx
    @staticmethod
    def forward(
        ctx: Any, first: Tensor, op: Op, group: Any, as_list: bool, *rest: Tensor
    ) -> Tensor:
        ctx.op, ctx.group, ctx.as_list = op, group, as_list
        comm = resolve(group, "reduce_scatter")
        data: Union[Tensor, list[Tensor]] = (
            [c.detach() for c in (first, *rest)] if as_list else first.detach()
        )
        out = comm.backend.reduce_scatter(comm, data, op, False)
        assert isinstance(out, Tensor)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        parts = list(_AllGather.apply(grad.contiguous(), ctx.group, True))
        if ctx.op.divide:
            parts = [p / len(parts) for p in parts]
        if ctx.as_list:
            return (parts[0], None, None, None, *parts[1:])
        return torch.cat(parts), None, None, None


def all_reduce(data: Tensor, op: Op, group: Any) -> Tensor:
    out = _AllReduce.apply(data, op, group)
    assert isinstance(out, Tensor)
    return out


def all_gather(data: Tensor, group: Any, same_shape: bool) -> list[Tensor]:
    return list(_AllGather.apply(data, group, same_shape))


def reduce_scatter(data: Union[Tensor, list[Tensor]], op: Op, group: Any) -> Tensor:
    if isinstance(data, list):
        out = _ReduceScatter.apply(data[0], op, group, True, *data[1:])
    else:
        out = _ReduceScatter.apply(data, op, group, False)
    assert isinstance(out, Tensor)
    return out
