"""Tensor collectives that return their result.

Aliasing, the same in every world: a collective that torch runs in place (``all_reduce``,
``broadcast``, ``reduce`` on ``dst``) fills the caller's tensor and returns that tensor;
every list result holds the caller's own tensor at this rank's index (not a copy) and new
tensors elsewhere; reductions that produce a new shape (``reduce_scatter``,
``all_to_all_single``) return new tensors and leave the input alone.

Autograd, the same in every world: collectives are not recorded. New tensors they return
do not require grad; an in-place result is the caller's tensor, with whatever autograd
history it had before the call. (For gradients through a collective, see ``grad=``.)

``src`` and ``dst`` are ranks within ``group``. The hottest calls carry a compiled
shortcut (:mod:`distkit.dist.core.shortcut`) that returns at once in a single process when
their arguments are the defaults.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional, TypeVar, Union, overload

from torch import Tensor

from distkit.dist import _autograd
from distkit.dist._route import refused, resolve, told
from distkit.dist.backends.tensors import TORCH
from distkit.dist.core import args as _args
from distkit.dist.core import spec
from distkit.dist.core.args import OpLike
from distkit.dist.core.comm import Comm, GroupLike
from distkit.dist.core.shortcut import shortcut
from distkit.dist.handle import Handle

_F = TypeVar("_F", bound=Callable[..., Any])


def _fast(method: str, **lane: Any) -> Callable[[_F], _F]:
    """The single-process shortcut the spec of ``method`` declares (see
    :mod:`distkit.dist.core.spec`), compiled in front of the public function, which
    tells the other ranks when it refuses its arguments
    (:func:`distkit.dist._route.refused`)."""
    returns, when = spec.shortcut_of(method, {"Tensor": Tensor})
    return shortcut(returns, **lane, refused=refused, **when)


@overload
def all_reduce(
    data: Tensor,
    op: OpLike = ...,
    group: GroupLike = ...,
    async_op: Literal[False] = ...,
    *,
    grad: bool = ...,
) -> Tensor: ...
@overload
def all_reduce(
    data: Tensor,
    op: OpLike = ...,
    group: GroupLike = ...,
    *,
    async_op: Literal[True],
    grad: bool = ...,
) -> Handle[Tensor]: ...
@overload
def all_reduce(
    data: Tensor,
    op: OpLike = ...,
    group: GroupLike = ...,
    async_op: bool = ...,
    *,
    grad: bool = ...,
) -> Union[Tensor, Handle[Tensor]]: ...
@_fast("all_reduce", lane=("op", "sum", TORCH.lane))  # the commonest many-rank call
def all_reduce(
    data: Tensor,
    op: OpLike = "sum",
    group: GroupLike = None,
    async_op: bool = False,
    *,
    grad: bool = False,
) -> Union[Tensor, Handle[Tensor]]:
    """Reduce ``data`` across ranks, in place, and return it.

    Collective: every rank in ``group`` must call this.
    Single process: returns ``data`` unchanged.

    ``data`` is modified in place (as in torch and mmengine) and returned, so code written
    for ``mmengine.dist.all_reduce`` keeps working. ``mean`` sums, then divides by the
    group size, on every backend (gloo has no native average), and keeps ``data``'s dtype
    as mmengine does: integers are divided with truncation toward zero (``[1]`` and
    ``[2]`` give ``[1]``, ``[-1]`` and ``[-2]`` give ``[-1]``), and bools take the
    logical or.

    Args:
        data: Tensor to reduce; its device may differ from the backend's (it is staged
            on the communication device and copied back).
        op: ``sum``, ``mean``, ``max``, ``min``, ``product``, ``band``, ``bor`` or ``bxor``
            (any case; ``avg`` and ``prod``, torch's names, are the same as ``mean`` and
            ``product``), or a ``torch.distributed.ReduceOp``.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        async_op: Return a :class:`~distkit.dist.Handle` whose ``wait()`` returns ``data``.
        grad: Differentiable: return a new tensor (``data`` is left alone) through which
            gradients flow back to every rank's ``data``. The loss differentiated is the
            sum of every rank's loss (as in ``torch.distributed.nn``): the gradient each
            rank's ``data`` receives is the all-reduced (``sum`` or ``mean``) upstream
            gradient. Only ``sum`` and ``mean``; every rank must run backward.
            Single process: the identity, with autograd intact.

    Returns:
        ``data``, now holding the reduction over all ranks (a new tensor with
        ``grad=True``).

    Raises:
        TypeError: ``data`` is not a tensor (a DTensor included: pass ``.to_local()`` or
            ``.full_tensor()``), or ``op`` does not apply to its dtype (bitwise ops on
            floats, ``max`` on complex).
        ValueError: ``op`` is not a known name, or ``grad=True`` with another op than
            ``sum``/``mean`` or with ``async_op=True``.

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> dist.all_reduce(torch.tensor([1.0, 2.0]), op="mean")
        tensor([1., 2.])

        With 2 ranks::

            dist.all_reduce(torch.tensor([dist.get_rank() + 1]))
            # every rank: tensor([3])
    """
    fn = "all_reduce"
    comm = resolve(group, fn)
    _args.tensor(data, "data", fn, comm)
    rop = _args.op_of(op, fn, comm)
    _args.check_dtype(rop, data, "data", fn, comm)
    _args.flag(async_op, "async_op", fn, comm)
    if _args.flag(grad, "grad", fn, comm):
        _grad_checks(rop, async_op, fn, comm)
        return _autograd.all_reduce(data, rop, group)
    return comm.backend.all_reduce(comm, data, rop, async_op)


@overload
def all_gather(
    data: Tensor,
    group: GroupLike = ...,
    async_op: Literal[False] = ...,
    same_shape: bool = ...,
    *,
    grad: bool = ...,
) -> list[Tensor]: ...
@overload
def all_gather(
    data: Tensor,
    group: GroupLike = ...,
    *,
    async_op: Literal[True],
    same_shape: bool = ...,
    grad: bool = ...,
) -> Handle[list[Tensor]]: ...
@overload
def all_gather(
    data: Tensor,
    group: GroupLike = ...,
    async_op: bool = ...,
    same_shape: bool = ...,
    *,
    grad: bool = ...,
) -> Union[list[Tensor], Handle[list[Tensor]]]: ...
@_fast("all_gather")
def all_gather(
    data: Tensor,
    group: GroupLike = None,
    async_op: bool = False,
    same_shape: bool = False,
    *,
    grad: bool = False,
) -> Union[list[Tensor], Handle[list[Tensor]]]:
    """Gather ``data`` from every rank; shapes may differ between ranks.

    Collective: every rank in ``group`` must call this.
    Single process: returns ``[data]``.

    gloo rejects uneven shapes natively: each rank's shape and dtype travel in a small
    header in front of its data, in the same collective, at sizes predicted from the
    group's last calls (the first call on a group, or data larger than predicted, takes a
    second round: see :mod:`distkit.dist.backends.uneven`). On CPU backends tensors of 256 KiB or
    more go by one exact-size broadcast per rank (3-4x faster than gloo's all_gather, and
    never padded); smaller ones go in one all_gather. Every rank must pass the same dtype;
    a mismatch raises on every rank. When every rank is known to pass the same shape,
    ``same_shape=True`` skips the headers (what raw torch requires).

    Args:
        data: This rank's tensor, of any shape.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        async_op: Return a :class:`~distkit.dist.Handle` whose ``wait()`` returns the list.
            Without ``same_shape=True`` the call completes before it returns (its size
            round and size history must not depend on when each rank waits).
        same_shape: Promise that every rank passes the same shape and dtype; saves the
            headers. Breaking the promise is an error of the backend (gloo: "invalid
            tensor size"), or silent corruption on some backends.
        grad: Differentiable (e.g. for contrastive losses): gradients flow back from
            every entry to the rank that sent it. The loss differentiated is the sum of
            every rank's loss (as in ``torch.distributed.nn``): each rank's ``data``
            receives the sum, over ranks, of the gradients computed for its entry. Every
            entry is then a new tensor. Every rank must run backward.
            Single process: ``[copy of data]``, with autograd intact.

    Returns:
        One tensor per rank, in rank order, on ``data``'s device. The entry at this rank's
        index is ``data`` itself (a copy with ``grad=True``); the others are new tensors.

    Raises:
        TypeError: ``data`` is not a tensor, or ranks passed different dtypes.

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> dist.all_gather(torch.tensor([0, 1]))
        [tensor([0, 1])]

        With 2 ranks::

            dist.all_gather(torch.arange(dist.get_rank() + 1))
            # every rank: [tensor([0]), tensor([0, 1])]
    """
    fn = "all_gather"
    comm = resolve(group, fn)
    _args.tensor(data, "data", fn, comm)
    _args.flag(async_op, "async_op", fn, comm)
    _args.flag(same_shape, "same_shape", fn, comm)
    if _args.flag(grad, "grad", fn, comm):
        _grad_checks(None, async_op, fn, comm)
        return _autograd.all_gather(data, group, same_shape)
    return comm.backend.all_gather(comm, data, async_op, same_shape)


@overload
def gather(
    data: Tensor,
    dst: int = ...,
    group: GroupLike = ...,
    async_op: Literal[False] = ...,
    same_shape: bool = ...,
) -> list[Tensor]: ...
@overload
def gather(
    data: Tensor,
    dst: int = ...,
    group: GroupLike = ...,
    *,
    async_op: Literal[True],
    same_shape: bool = ...,
) -> Handle[list[Tensor]]: ...
@overload
def gather(
    data: Tensor,
    dst: int = ...,
    group: GroupLike = ...,
    async_op: bool = ...,
    same_shape: bool = ...,
) -> Union[list[Tensor], Handle[list[Tensor]]]: ...
@_fast("gather")
def gather(
    data: Tensor,
    dst: int = 0,
    group: GroupLike = None,
    async_op: bool = False,
    same_shape: bool = False,
) -> Union[list[Tensor], Handle[list[Tensor]]]:
    """Gather ``data`` from every rank onto ``dst``; shapes may differ between ranks.

    Collective: every rank in ``group`` must call this.
    Single process: returns ``[data]`` (``dst`` must be 0).

    Args:
        data: This rank's tensor, of any shape.
        dst: Rank (within ``group``) that receives the tensors.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        async_op: Return a :class:`~distkit.dist.Handle` whose ``wait()`` returns the list.
        same_shape: Promise that every rank passes the same shape and dtype; saves the
            shape round (see :func:`all_gather`).

    Returns:
        On ``dst``, one tensor per rank in rank order, ``data`` itself at ``dst``'s index;
        ``[]`` on the other ranks.

    Raises:
        TypeError: ``data`` is not a tensor, or ranks passed different dtypes.
        ValueError: ``dst`` is out of range.

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> dist.gather(torch.tensor([7]))
        [tensor([7])]

        With 2 ranks::

            dist.gather(torch.tensor([dist.get_rank()]), dst=1)
            # rank 0: []
            # rank 1: [tensor([0]), tensor([1])]
    """
    fn = "gather"
    comm = resolve(group, fn)
    _args.tensor(data, "data", fn, comm)
    dst = _args.rank(dst, "dst", fn, comm)
    _args.flag(async_op, "async_op", fn, comm)
    _args.flag(same_shape, "same_shape", fn, comm)
    return comm.backend.gather(comm, data, dst, async_op, same_shape)


@overload
def broadcast(
    data: Tensor, src: int = ..., group: GroupLike = ..., async_op: Literal[False] = ...
) -> Tensor: ...
@overload
def broadcast(
    data: Tensor, src: int = ..., group: GroupLike = ..., *, async_op: Literal[True]
) -> Handle[Tensor]: ...
@overload
def broadcast(
    data: Tensor, src: int = ..., group: GroupLike = ..., async_op: bool = ...
) -> Union[Tensor, Handle[Tensor]]: ...
@_fast("broadcast")
def broadcast(
    data: Tensor, src: int = 0, group: GroupLike = None, async_op: bool = False
) -> Union[Tensor, Handle[Tensor]]:
    """Copy ``src``'s ``data`` into every rank's ``data``, in place, and return it.

    Collective: every rank in ``group`` must call this, with tensors of one shape and dtype.
    Single process: returns ``data`` unchanged (``src`` must be 0).

    ``data`` is filled in place (as in torch and mmengine) and returned. To send a tensor
    whose shape the other ranks do not know, use :func:`broadcast_object`.

    Args:
        data: The tensor to send (on ``src``) or to overwrite (elsewhere).
        src: Rank (within ``group``) whose tensor is sent.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        async_op: Return a :class:`~distkit.dist.Handle` whose ``wait()`` returns ``data``.

    Returns:
        ``data``, now equal to ``src``'s tensor.

    Raises:
        TypeError: ``data`` is not a tensor.
        ValueError: ``src`` is out of range.

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> dist.broadcast(torch.tensor([5]))
        tensor([5])

        With 2 ranks::

            dist.broadcast(torch.tensor([dist.get_rank() + 10]), src=1)
            # every rank: tensor([11])
    """
    fn = "broadcast"
    comm = resolve(group, fn)
    _args.tensor(data, "data", fn, comm)
    src = _args.rank(src, "src", fn, comm)
    _args.flag(async_op, "async_op", fn, comm)
    return comm.backend.broadcast(comm, data, src, async_op)


@overload
def reduce(
    data: Tensor,
    dst: int = ...,
    op: OpLike = ...,
    group: GroupLike = ...,
    async_op: Literal[False] = ...,
) -> Tensor: ...
@overload
def reduce(
    data: Tensor,
    dst: int = ...,
    op: OpLike = ...,
    group: GroupLike = ...,
    *,
    async_op: Literal[True],
) -> Handle[Tensor]: ...
@overload
def reduce(
    data: Tensor, dst: int = ..., op: OpLike = ..., group: GroupLike = ..., async_op: bool = ...
) -> Union[Tensor, Handle[Tensor]]: ...
@_fast("reduce")
def reduce(
    data: Tensor,
    dst: int = 0,
    op: OpLike = "sum",
    group: GroupLike = None,
    async_op: bool = False,
) -> Union[Tensor, Handle[Tensor]]:
    """Reduce ``data`` across ranks onto ``dst``.

    Collective: every rank in ``group`` must call this.
    Single process: returns ``data`` unchanged (``dst`` must be 0).

    On ``dst``, ``data`` is overwritten with the result in place and returned. On the
    other ranks ``data`` is returned unchanged (torch's gloo backend uses those inputs as
    scratch space; distkit reduces from a copy there so your tensor survives).

    Args:
        data: This rank's tensor.
        dst: Rank (within ``group``) that receives the reduction.
        op: ``sum``, ``mean``, ``max``, ``min``, ``product``, ``band``, ``bor`` or ``bxor``
            (any case; ``avg`` and ``prod``, torch's names, are the same as ``mean`` and
            ``product``), or a ``torch.distributed.ReduceOp``.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        async_op: Return a :class:`~distkit.dist.Handle` whose ``wait()`` returns ``data``.

    Returns:
        ``data``: the reduction on ``dst``, this rank's unchanged input elsewhere.

    Raises:
        TypeError: ``data`` is not a tensor, or ``op`` does not apply to its dtype.
        ValueError: ``dst`` is out of range, or ``op`` is not a known name.

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> dist.reduce(torch.tensor([2, 3]), op="max")
        tensor([2, 3])

        With 2 ranks::

            dist.reduce(torch.tensor([dist.get_rank() + 1]), dst=0)
            # rank 0: tensor([3])
            # rank 1: tensor([2])
    """
    fn = "reduce"
    comm = resolve(group, fn)
    _args.tensor(data, "data", fn, comm)
    dst = _args.rank(dst, "dst", fn, comm)
    rop = _args.op_of(op, fn, comm)
    _args.check_dtype(rop, data, "data", fn, comm)
    _args.flag(async_op, "async_op", fn, comm)
    return comm.backend.reduce(comm, data, dst, rop, async_op)


@overload
def reduce_scatter(
    data: Union[Tensor, list[Tensor]],
    op: OpLike = ...,
    group: GroupLike = ...,
    async_op: Literal[False] = ...,
    *,
    grad: bool = ...,
) -> Tensor: ...
@overload
def reduce_scatter(
    data: Union[Tensor, list[Tensor]],
    op: OpLike = ...,
    group: GroupLike = ...,
    *,
    async_op: Literal[True],
    grad: bool = ...,
) -> Handle[Tensor]: ...
@overload
def reduce_scatter(
    data: Union[Tensor, list[Tensor]],
    op: OpLike = ...,
    group: GroupLike = ...,
    async_op: bool = ...,
    *,
    grad: bool = ...,
) -> Union[Tensor, Handle[Tensor]]: ...
@told
def reduce_scatter(
    data: Union[Tensor, list[Tensor]],
    op: OpLike = "sum",
    group: GroupLike = None,
    async_op: bool = False,
    *,
    grad: bool = False,
) -> Union[Tensor, Handle[Tensor]]:
    """Reduce across ranks, then give rank ``r`` the ``r``-th chunk of the result.

    Collective: every rank in ``group`` must call this, with chunks of one shape.
    Single process: returns a copy of the only chunk.

    Args:
        data: Either a list of one tensor per rank (all of one shape and dtype), or one
            tensor whose first dimension divides evenly by the group size.
        op: ``sum``, ``mean``, ``max``, ``min``, ``product``, ``band``, ``bor`` or ``bxor``
            (any case; ``avg`` and ``prod``, torch's names, are the same as ``mean`` and
            ``product``), or a ``torch.distributed.ReduceOp``.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        async_op: Return a :class:`~distkit.dist.Handle` whose ``wait()`` returns the chunk.
        grad: Differentiable: the loss differentiated is the sum of every rank's loss
            (as in ``torch.distributed.nn``); the gradient of chunk ``r`` of each rank's
            input is rank ``r``'s upstream gradient (divided by the group size for
            ``mean``). Only ``sum`` and ``mean``; every rank must run backward.

    Returns:
        A new tensor: this rank's chunk of the reduction, on the input's device. The input
        is not modified.

    Raises:
        TypeError: ``data`` is neither a tensor nor a list of tensors, chunks mix dtypes,
            or ``op`` does not apply to the dtype.
        ValueError: The list does not hold one chunk per rank, chunks differ in shape,
            the first dimension does not divide by the group size, or ``op`` is unknown.

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> dist.reduce_scatter([torch.tensor(3)])
        tensor(3)

        With 4 ranks, each holding ``[0, 1, 2, 3]`` (the torch documentation's example)::

            dist.reduce_scatter([torch.tensor(v) for v in range(4)])
            # rank r: tensor(4 * r)
    """
    fn = "reduce_scatter"
    comm = resolve(group, fn)
    if isinstance(data, Tensor):
        _args.tensor(data, "data", fn, comm)
        if data.dim() == 0 or data.shape[0] % comm.size:
            _args.fail(
                ValueError,
                fn,
                comm,
                f"data has shape {tuple(data.shape)}, whose first dimension does not "
                f"divide evenly by the group size {comm.size}",
                "Pass a tensor of shape (group size * n, ...) or a list of one chunk per rank",
            )
        first = data
    else:
        data = _args.tensor_list(data, "data", fn, comm, same_shape=True)
        first = data[0]
    rop = _args.op_of(op, fn, comm)
    _args.check_dtype(rop, first, "data", fn, comm)
    _args.flag(async_op, "async_op", fn, comm)
    if _args.flag(grad, "grad", fn, comm):
        _grad_checks(rop, async_op, fn, comm)
        return _autograd.reduce_scatter(data, rop, group)
    return comm.backend.reduce_scatter(comm, data, rop, async_op)


def _grad_checks(op: Optional[_args.Op], async_op: bool, fn: str, comm: Comm) -> None:
    if async_op:
        _args.fail(
            ValueError,
            fn,
            comm,
            "grad=True cannot be combined with async_op=True",
            "Call it synchronously; the backward pass communicates synchronously too",
        )
    if op is not None:
        _autograd.check_op(op, fn, comm)


@overload
def all_to_all(
    data: list[Tensor],
    group: GroupLike = ...,
    async_op: Literal[False] = ...,
    same_shape: bool = ...,
) -> list[Tensor]: ...
@overload
def all_to_all(
    data: list[Tensor], group: GroupLike = ..., *, async_op: Literal[True], same_shape: bool = ...
) -> Handle[list[Tensor]]: ...
@overload
def all_to_all(
    data: list[Tensor], group: GroupLike = ..., async_op: bool = ..., same_shape: bool = ...
) -> Union[list[Tensor], Handle[list[Tensor]]]: ...
@told
def all_to_all(
    data: list[Tensor], group: GroupLike = None, async_op: bool = False, same_shape: bool = False
) -> Union[list[Tensor], Handle[list[Tensor]]]:
    """Send ``data[r]`` to rank ``r``; return what each rank sent to this one.

    Collective: every rank in ``group`` must call this.
    Single process: returns ``[data[0]]``.

    Tensors may have any shapes, different per destination and per rank (the uneven
    case): each one's shape and dtype travel in a small header in front of its data, in
    one ``all_to_all_single``, at sizes predicted from the group's last calls (the first
    call on a group, or data larger than predicted, takes a second round: see
    :mod:`distkit.dist.backends.uneven`). This rank's own tensor never travels: it is returned as
    passed. When every tensor on every rank has one shape, pass ``same_shape=True`` to
    skip the headers (torch's own all_to_all requires it); when the sizes differ but each
    rank knows what it will receive, use :func:`all_to_all_single` with
    ``output_split_sizes``.

    Args:
        data: One tensor per rank of ``group``, all of one dtype; ``data[r]`` goes to rank r.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        async_op: Return a :class:`~distkit.dist.Handle` whose ``wait()`` returns the list.
            Without ``same_shape=True`` the call completes before it returns (its size
            round and size history must not depend on when each rank waits).
        same_shape: Promise that every tensor of every rank has one shape and dtype; saves
            the headers. The shapes of this rank's own list are checked; other ranks'
            are not: breaking the promise across ranks is an error of the backend (gloo
            aborts on a size mismatch), or silent corruption (another dtype of the same
            element size, or another shape of as many elements, is read as this rank's).

    Returns:
        One tensor per rank: element ``r`` came from rank ``r``. The entry at this rank's
        index is ``data[rank]`` itself; the others are new tensors on ``data[0]``'s device.

    Raises:
        TypeError: ``data`` is not a list of tensors, mixes dtypes, or ranks disagree on
            the dtype.
        ValueError: ``data`` does not hold one tensor per rank.

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> dist.all_to_all([torch.tensor([1, 2])])
        [tensor([1, 2])]

        With 4 ranks (the torch documentation's example)::

            rank = dist.get_rank()
            dist.all_to_all(list((torch.arange(4) + rank * 4).chunk(4)))
            # rank 0: [tensor([0]), tensor([4]), tensor([8]), tensor([12])]
            # rank 1: [tensor([1]), tensor([5]), tensor([9]), tensor([13])]
            # rank 2: [tensor([2]), tensor([6]), tensor([10]), tensor([14])]
            # rank 3: [tensor([3]), tensor([7]), tensor([11]), tensor([15])]
    """
    fn = "all_to_all"
    comm = resolve(group, fn)
    _args.flag(same_shape, "same_shape", fn, comm)
    data = _args.tensor_list(data, "data", fn, comm, same_shape=same_shape)
    _args.flag(async_op, "async_op", fn, comm)
    return comm.backend.all_to_all(comm, data, async_op, same_shape)


@overload
def all_to_all_single(
    data: Tensor,
    output_split_sizes: Optional[list[int]] = ...,
    input_split_sizes: Optional[list[int]] = ...,
    group: GroupLike = ...,
    async_op: Literal[False] = ...,
) -> Tensor: ...
@overload
def all_to_all_single(
    data: Tensor,
    output_split_sizes: Optional[list[int]] = ...,
    input_split_sizes: Optional[list[int]] = ...,
    group: GroupLike = ...,
    *,
    async_op: Literal[True],
) -> Handle[Tensor]: ...
@overload
def all_to_all_single(
    data: Tensor,
    output_split_sizes: Optional[list[int]] = ...,
    input_split_sizes: Optional[list[int]] = ...,
    group: GroupLike = ...,
    async_op: bool = ...,
) -> Union[Tensor, Handle[Tensor]]: ...
@told
def all_to_all_single(
    data: Tensor,
    output_split_sizes: Optional[list[int]] = None,
    input_split_sizes: Optional[list[int]] = None,
    group: GroupLike = None,
    async_op: bool = False,
) -> Union[Tensor, Handle[Tensor]]:
    """Split ``data`` along dim 0, send piece ``r`` to rank ``r``, concatenate what arrives.

    Collective: every rank in ``group`` must call this.
    Single process: returns a copy of ``data``.

    Args:
        data: Tensor to split along its first dimension.
        output_split_sizes: Rows to receive from each rank. ``None`` infers them: from
            the other ranks' ``input_split_sizes`` when ``input_split_sizes`` is given
            (they travel beside the data, with each rank's dtype and row shape, which
            every rank checks), else an even split. With neither given, equal pieces
            move with no header, as in ``all_reduce``: the ranks' dtypes and shapes
            must match, and the default check (debug mode: every call) compares them.
        input_split_sizes: Rows to send to each rank; ``None`` splits ``data`` evenly.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        async_op: Return a :class:`~distkit.dist.Handle` whose ``wait()`` returns the tensor.

    Returns:
        A new tensor holding the pieces received, in rank order. ``data`` is not modified.

    Raises:
        TypeError: ``data`` is not a tensor, or split sizes are not lists of ints; or,
            with the output sizes inferred from ``input_split_sizes``, ranks passed
            different dtypes (on every rank).
        ValueError: Split sizes have the wrong length, are negative, or do not sum to the
            rows of ``data``; or ``data`` does not split evenly when no sizes are given;
            or, with the output sizes inferred from ``input_split_sizes``, ranks' rows
            (``data.shape[1:]``) differ (on every rank).

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> dist.all_to_all_single(torch.arange(3), input_split_sizes=[3])
        tensor([0, 1, 2])

        With 4 ranks, the torch documentation's uneven example::

            # rank 0 data: tensor([0, 1, 2, 3, 4, 5]), input_split_sizes=[2, 2, 1, 1]
            dist.all_to_all_single(data, input_split_sizes=splits)
            # rank 0: tensor([ 0,  1, 10, 11, 12, 20, 21, 30, 31])
    """
    fn = "all_to_all_single"
    comm = resolve(group, fn)
    _args.tensor(data, "data", fn, comm)
    if data.dim() == 0:
        _args.fail(ValueError, fn, comm, "data must have at least one dimension")
    rows = data.shape[0]
    if input_split_sizes is not None:
        input_split_sizes = _args.splits(input_split_sizes, "input_split_sizes", rows, fn, comm)
    elif rows % comm.size:
        _args.fail(
            ValueError,
            fn,
            comm,
            f"data has {rows} rows, which does not split evenly over {comm.size} ranks",
            "Pass input_split_sizes",
        )
    if output_split_sizes is not None:
        output_split_sizes = _args.splits(output_split_sizes, "output_split_sizes", None, fn, comm)
        # the rows a rank sends itself are the rows it receives from itself, in any world
        me = comm.rank
        sent = rows // comm.size if input_split_sizes is None else input_split_sizes[me]
        if output_split_sizes[me] != sent:
            sends = (
                f"input_split_sizes[{me}]={sent}"
                if input_split_sizes is not None
                else f"this rank sends itself {sent} rows (its even share of data)"
            )
            _args.fail(
                ValueError,
                fn,
                comm,
                f"output_split_sizes[{me}]={output_split_sizes[me]}, but {sends}",
                "The rows a rank sends itself are the rows it receives from itself: "
                f"make output_split_sizes[{me}] {sent} on rank {me}",
            )
    _args.flag(async_op, "async_op", fn, comm)
    return comm.backend.all_to_all_single(
        comm, data, output_split_sizes, input_split_sizes, async_op
    )


@overload
def scatter(
    data: Optional[list[Tensor]] = ...,
    src: int = ...,
    group: GroupLike = ...,
    async_op: Literal[False] = ...,
) -> Tensor: ...
@overload
def scatter(
    data: Optional[list[Tensor]] = ...,
    src: int = ...,
    group: GroupLike = ...,
    *,
    async_op: Literal[True],
) -> Handle[Tensor]: ...
@overload
def scatter(
    data: Optional[list[Tensor]] = ...,
    src: int = ...,
    group: GroupLike = ...,
    async_op: bool = ...,
) -> Union[Tensor, Handle[Tensor]]: ...
@told
def scatter(
    data: Optional[list[Tensor]] = None,
    src: int = 0,
    group: GroupLike = None,
    async_op: bool = False,
) -> Union[Tensor, Handle[Tensor]]:
    """Send ``data[r]`` from ``src`` to rank ``r``; shapes may differ per rank.

    Collective: every rank in ``group`` must call this.
    Single process: returns ``data[0]`` (``src`` must be 0).

    The other ranks do not need to know the shapes: ``src`` sends them first, in one small
    round.

    Args:
        data: On ``src``, one tensor per rank, all of one dtype; ignored elsewhere (pass
            ``None``).
        src: Rank (within ``group``) that holds the tensors.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        async_op: Return a :class:`~distkit.dist.Handle` whose ``wait()`` returns the tensor.

    Returns:
        This rank's tensor: ``data[src]`` itself on ``src``, a new tensor elsewhere (on the
        backend's communication device: CPU for gloo, the current GPU for nccl).

    Raises:
        TypeError: On ``src``, ``data`` is not a list of tensors or mixes dtypes.
        ValueError: ``src`` is out of range, or ``data`` does not hold one tensor per rank.

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> dist.scatter([torch.tensor([4, 2])])
        tensor([4, 2])

        With 2 ranks::

            dist.scatter([torch.zeros(1), torch.ones(2)] if dist.get_rank() == 0 else None)
            # rank 0: tensor([0.])
            # rank 1: tensor([1., 1.])
    """
    fn = "scatter"
    comm = resolve(group, fn)
    src = _args.rank(src, "src", fn, comm)
    _args.flag(async_op, "async_op", fn, comm)
    error = None
    if comm.rank == src:  # only src has data: its mistakes must reach the other ranks
        try:
            data = _args.tensor_list(data, "data", fn, comm)
        except (TypeError, ValueError) as exc:
            error = exc
    return comm.backend.scatter(comm, data, src, async_op, error)


@_fast("barrier")
def barrier(group: GroupLike = None) -> None:
    """Block until every rank of ``group`` reaches this call.

    Collective: every rank in ``group`` must call this.
    Single process: returns at once.

    Args:
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).

    Examples:
        >>> import distkit.dist as dist
        >>> dist.barrier()
    """
    comm = resolve(group, "barrier")
    return comm.backend.barrier(comm)
