"""The backend that runs while ``torch.compile`` traces: torch's functional collectives.

:func:`distkit.dist._route.resolve` hands out this backend (with a
:class:`~distkit.dist.core.comm.TracedComm`) when ``torch.compiler.is_compiling()``. It does
only what traces: no thread guard, no call counting, no debug check, no size history
(the eager backend's :func:`~distkit.dist.guard.watch.watched` bookkeeping), and no staging
through ``is_conj()`` and friends. Results and aliasing are the eager backend's:
``all_reduce`` and ``broadcast`` write into the caller's tensor (``copy_``, which the
compiler turns into an in-place update) and return it; a list result holds the caller's
own tensor at this rank's index; new tensors carry no autograd history.

``src`` and ``dst`` are group ranks here, as the functional collectives take them
(they index ``pg``'s own ranks), never global ranks.

Every dtype travels as the eager backend sends it: complex tensors as their real pairs
(``torch.view_as_real``, as ``torch.distributed`` sends them); on gloo groups, the
dtypes gloo refuses (int16, the unsigned types wider than uint8, float8, float4) take
the conversions of :mod:`distkit.dist.backends.gloo`, traced: reductions run in the wider dtype
of :data:`~distkit.dist.backends.gloo.WIDER` and are narrowed back once (so sums wrap and float8
rounds exactly as eagerly), everything else moves their bytes.

What needs a value only known at run time (the shapes of an uneven ``all_gather``, the
sizes of ``all_to_all_single`` without ``output_split_sizes``), pickles objects, blocks
(``barrier``) or returns a handle (``async_op=True``) runs eagerly instead, through
:meth:`~distkit.dist.core.comm.TracedComm.eager`: a ``torch.compiler.disable``d call, i.e. a
clean graph break whose reason names distkit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import Tensor

from distkit._compat import functional_collectives as _fc
from distkit.dist.backends.base import Backend, ObjectCall, Result
from distkit.dist.backends.gloo import (
    AS_BYTES,
    WIDER,
    _as_bytes,
    _from_bytes,
    _narrow,
    _packed,
    _wide,
)

if TYPE_CHECKING:
    from distkit.dist.core.args import Op
    from distkit.dist.core.comm import Comm, TracedComm

# distkit's op names as the functional collectives spell them (mean: sum, then divide)
# (while tracing, each functional collective's result already comes waited on)
_FUNCTIONAL_OPS = {
    "sum": "sum",
    "mean": "sum",
    "max": "max",
    "min": "min",
    "product": "product",
    "band": "band",
    "bor": "bor",
    "bxor": "bxor",
}


def _input(t: Tensor) -> Tensor:
    """``t`` as a collective's input: untracked and contiguous."""
    t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


def _carried(comm: Comm, dtype: torch.dtype) -> bool:
    """Whether ``dtype`` travels in another dtype on ``comm``'s group, as the eager
    backend decides it (:class:`~distkit.dist.backends.gloo.GlooBackend` runs on gloo groups)."""
    return dtype in AS_BYTES and _eager(comm).gloo


def _same(t: Tensor) -> Tensor:
    return t


def _moved(comm: Comm, x: Tensor) -> Tensor:
    """``x`` (an input) as it travels when nothing reduces it: a complex tensor as its
    real pairs (as ``torch.distributed`` sends it), a dtype gloo refuses as its bytes."""
    if x.is_complex():
        return torch.view_as_real(x.resolve_conj())
    return _as_bytes(x) if _carried(comm, x.dtype) else x


def _arrived(t: Tensor, dtype: torch.dtype) -> Tensor:
    """A tensor :func:`_moved` sent, read back as ``dtype``."""
    if t.dtype == dtype:
        return t
    return torch.view_as_complex(t) if dtype.is_complex else _from_bytes(t, dtype)


def _reduced_in(
    fn: str, comm: Comm, x: Tensor, op: Op
) -> tuple[Tensor, Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """How ``x`` (an input) travels to be reduced, as the eager backend sends it.

    Returns the tensor to send; how a received one reads as ``x``'s values, before it is
    reduced or averaged (complex: from its real pairs); and how the result returns to
    ``x``'s dtype (a dtype gloo refuses is reduced wider, see
    :func:`distkit.dist.backends.gloo._wide`, and narrowed once at the end).
    """
    if x.is_complex():
        return torch.view_as_real(x.resolve_conj()), torch.view_as_complex, _same
    if not _carried(comm, x.dtype):
        return x, _same, _same
    if x.dtype not in WIDER:
        _packed(fn, comm, x.dtype)
    wide, flipped = _wide(x, op)
    return wide, _same, lambda out: _narrow(out, x.dtype, flipped)


def _mean(total: Tensor, size: int) -> Tensor:
    """:func:`distkit.dist.core.args.mean_of`, out of place (integers truncate, bools stay)."""
    if total.dtype.is_floating_point or total.dtype.is_complex:
        return total / size
    if total.dtype is torch.bool:
        return total
    return torch.div(total, size, rounding_mode="trunc")


def _reduce_locally(chunks: Tensor, name: str) -> Tensor:
    """Reduce ``chunks`` (one per rank, stacked on dim 0) as the eager backend does."""
    if name in ("sum", "mean"):
        return chunks.any(0) if chunks.dtype is torch.bool else chunks.sum(0, dtype=chunks.dtype)
    if name == "max":
        return chunks.amax(0)
    if name == "min":
        return chunks.amin(0)
    if name == "product":
        return chunks.all(0) if chunks.dtype is torch.bool else chunks.prod(0, dtype=chunks.dtype)
    combine = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[name]
    out = chunks[0]
    for i in range(1, chunks.shape[0]):
        out = combine(out, chunks[i])
    return out


class TracedBackend(Backend):
    # -- traced ---------------------------------------------------------------------------

    def all_reduce(self, comm: Comm, data: Tensor, op: Op, async_op: bool) -> Result[Tensor]:
        if async_op or not comm.traceable:
            return _eager(comm).eager("all_reduce", data, op, async_op)
        fc = _fc()

        sent, read, narrow = _reduced_in("all_reduce", comm, _input(data), op)
        out = read(fc.all_reduce(sent, _FUNCTIONAL_OPS[op.name], comm.pg))
        if op.divide:
            out = _mean(out, comm.size)
        data.detach().copy_(narrow(out))
        return data

    def all_gather(
        self, comm: Comm, data: Tensor, async_op: bool, same_shape: bool
    ) -> Result[list[Tensor]]:
        if async_op or not same_shape or not comm.traceable:
            return _eager(comm).eager("all_gather", data, async_op, same_shape)
        fc = _fc()

        sent = _moved(comm, _input(data))
        out = fc.all_gather_tensor(sent.reshape(1, -1), 0, comm.pg)
        rows = out.view(comm.size, *sent.shape).unbind(0)
        return [data if r == comm.rank else _arrived(rows[r], data.dtype) for r in range(comm.size)]

    def broadcast(self, comm: Comm, data: Tensor, src: int, async_op: bool) -> Result[Tensor]:
        if async_op or not comm.traceable:
            return _eager(comm).eager("broadcast", data, src, async_op)
        fc = _fc()

        # src is a group rank, as every functional collective takes it (it indexes pg)
        out = fc.broadcast(_moved(comm, _input(data)), src, comm.pg)
        if comm.rank != src:
            data.detach().copy_(_arrived(out, data.dtype))
        return data

    def reduce_scatter(
        self, comm: Comm, data: Union[Tensor, list[Tensor]], op: Op, async_op: bool
    ) -> Result[Tensor]:
        if async_op or not comm.traceable:
            return _eager(comm).eager("reduce_scatter", data, op, async_op)
        fc = _fc()

        size = comm.size
        # as the eager backend on the CPU: chunk r goes to rank r, which reduces locally
        parts = data if isinstance(data, list) else [data]
        sent = [_reduced_in("reduce_scatter", comm, _input(t), op) for t in parts]
        _, read, narrow = sent[0]
        buf = torch.stack([s for s, _, _ in sent]) if isinstance(data, list) else sent[0][0]
        chunk_shape = (buf.shape[0] // size, *buf.shape[1:])
        if isinstance(data, list):
            chunk_shape = tuple(buf.shape[1:])
        received = fc.all_to_all_single(buf.reshape(size, -1), None, None, comm.pg)
        out = _reduce_locally(read(received.view(size, *chunk_shape)), op.name)
        if op.divide:
            out = _mean(out, size)
        return narrow(out)

    def all_to_all_single(
        self,
        comm: Comm,
        data: Tensor,
        output_split_sizes: Optional[list[int]],
        input_split_sizes: Optional[list[int]],
        async_op: bool,
    ) -> Result[Tensor]:
        if async_op or not comm.traceable or (output_split_sizes is None and input_split_sizes):
            return _eager(comm).eager(
                "all_to_all_single", data, output_split_sizes, input_split_sizes, async_op
            )
        fc = _fc()

        sent = _moved(comm, _input(data))
        out = fc.all_to_all_single(sent, output_split_sizes, input_split_sizes, comm.pg)
        return _arrived(out, data.dtype)

    # -- eager, between graphs ------------------------------------------------------------

    def gather(
        self, comm: Comm, data: Tensor, dst: int, async_op: bool, same_shape: bool
    ) -> Result[list[Tensor]]:
        return _eager(comm).eager("gather", data, dst, async_op, same_shape)

    def reduce(self, comm: Comm, data: Tensor, dst: int, op: Op, async_op: bool) -> Result[Tensor]:
        return _eager(comm).eager("reduce", data, dst, op, async_op)

    def all_to_all(
        self, comm: Comm, data: list[Tensor], async_op: bool, same_shape: bool
    ) -> Result[list[Tensor]]:
        return _eager(comm).eager("all_to_all", data, async_op, same_shape)

    def scatter(
        self,
        comm: Comm,
        data: Optional[list[Tensor]],
        src: int,
        async_op: bool,
        error: Optional[Exception] = None,
    ) -> Result[Tensor]:
        return _eager(comm).eager("scatter", data, src, async_op, error)

    def barrier(self, comm: Comm) -> None:
        return _eager(comm).eager("barrier")

    def all_gather_object(self, comm: Comm, data: Any, call: ObjectCall) -> list[Any]:
        return _eager(comm).eager("all_gather_object", data, call)

    def gather_object(
        self, comm: Comm, data: Any, dst: int, call: ObjectCall
    ) -> Optional[list[Any]]:
        return _eager(comm).eager("gather_object", data, dst, call)

    def broadcast_object(self, comm: Comm, obj: Any, src: int, name: str, call: ObjectCall) -> Any:
        return _eager(comm).eager("broadcast_object", obj, src, name, call)

    def scatter_object(
        self,
        comm: Comm,
        data: Optional[list[Any]],
        src: int,
        call: ObjectCall,
        error: Optional[Exception] = None,
    ) -> Any:
        return _eager(comm).eager("scatter_object", data, src, call, error)

    def all_to_all_object(self, comm: Comm, data: list[Any], call: ObjectCall) -> list[Any]:
        return _eager(comm).eager("all_to_all_object", data, call)

    def send(
        self, comm: Comm, data: Any, dst: int, tag: int, async_op: bool, call: ObjectCall
    ) -> Result[None]:
        return _eager(comm).eager("send", data, dst, tag, async_op, call)

    def recv(self, comm: Comm, src: int, tag: int, async_op: bool, call: ObjectCall) -> Result[Any]:
        return _eager(comm).eager("recv", src, tag, async_op, call)

    def exchange(
        self, comm: Comm, sends: dict[int, Any], recv_from: list[int], tag: int, call: ObjectCall
    ) -> dict[int, Any]:
        return _eager(comm).eager("exchange", sends, recv_from, tag, call)


def _eager(comm: Comm) -> TracedComm:
    return comm  # type: ignore[return-value]  # this backend only ever gets a TracedComm


TRACED = TracedBackend()
