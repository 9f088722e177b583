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
        comm = resolve(ctx.group, "all_reduce")
        total = grad.contiguous().clone()
        comm.backend.all_reduce(comm, total, ctx.op, False)  # mean: the sum / size
        return total, None, None


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
        comm = resolve(ctx.group, "all_gather")
        sends = [g.contiguous() for g in grads]  # autograd fills unused ones with zeros
        # rank k computed sends[r] for rank r's input: send it there, and add up
        if ctx.same_shape:  # a reduce-scatter (which torch.compile can trace)
            return comm.backend.reduce_scatter(comm, sends, OPS["sum"], False), None, None
        received = comm.backend.all_to_all(comm, sends, False, False)
        assert isinstance(received, list)
        total = received[0].clone()
        for part in received[1:]:
            total += part
        return total, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: Op, group: Any, as_list: bool, *chunks: Tensor) -> Tensor:
        ctx.op, ctx.group, ctx.as_list = op, group, as_list
        comm = resolve(group, "reduce_scatter")
        data: Union[Tensor, list[Tensor]] = (
            [c.detach() for c in chunks] if as_list else chunks[0].detach()
        )
        out = comm.backend.reduce_scatter(comm, data, op, False)
        assert isinstance(out, Tensor)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        comm = resolve(ctx.group, "reduce_scatter")
        parts = comm.backend.all_gather(comm, grad.contiguous(), False, True)
        assert isinstance(parts, list)
        if ctx.op.divide:
            parts = [p / comm.size for p in parts]
        if ctx.as_list:
            return (None, None, None, *parts)
        return None, None, None, torch.cat(parts)


def all_reduce(data: Tensor, op: Op, group: Any) -> Tensor:
    out = _AllReduce.apply(data, op, group)
    assert isinstance(out, Tensor)
    return out


def all_gather(data: Tensor, group: Any, same_shape: bool) -> list[Tensor]:
    return list(_AllGather.apply(data, group, same_shape))


def reduce_scatter(data: Union[Tensor, list[Tensor]], op: Op, group: Any) -> Tensor:
    if isinstance(data, list):
        out = _ReduceScatter.apply(op, group, True, *data)
    else:
        out = _ReduceScatter.apply(op, group, False, data)
    assert isinstance(out, Tensor)
    return out
