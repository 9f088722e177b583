"""The torch backend on gloo groups: dtypes gloo cannot carry, carried in ones it can.

gloo (torch 2.4 to 2.14) fails with "Invalid scalar type" on ``int16``, the unsigned
types wider than ``uint8`` and the ``float8`` types, which a single process (and NCCL,
for some of them) accepts. On a gloo group distkit moves such tensors as their bytes, and
reduces them in a type that holds every value exactly:

========================  =====================================================
dtype                     reduced as
========================  =====================================================
int16, uint16             int32
uint32                    int64
uint64                    its own bits as int64 (max/min on an order-keeping flip)
float8 (every variant)    float32, rounded to float8 once at the end
float4_e2m1fn_x2          not at all: torch has no arithmetic for it (TypeError)
========================  =====================================================

Results come back in the caller's dtype, with the caller's aliasing (in-place results
fill the caller's tensor; list results hold the caller's own tensor at its index). Sums
and products wrap as that dtype's own arithmetic would; ``mean`` truncates as for every
integer type (of ``uint64``, only values below 2**63 are exact). Every other dtype takes
:class:`~distkit.dist.backends.tensors.TorchBackend`'s path untouched, after one dict lookup.

Some calls need nothing here, whatever the dtype: ``gather``, ``scatter``, and the
uneven ``all_gather``, ``all_to_all`` and ``all_to_all_single`` (output sizes inferred)
already move bytes, with each rank's real dtype in the header they exchange, so ranks
passing different dtypes fail there alike (int16 on one rank, uint16 on another, say:
as bytes, both would be uint8).
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn, Optional, TypeVar, Union

import torch
from torch import Tensor

from distkit.dist.backends.tensors import TorchBackend, _infers_splits
from distkit.dist.core.args import Op, fail
from distkit.dist.guard.watch import watched
from distkit.dist.handle import Handle

T = TypeVar("T")
U = TypeVar("U")

_FLOAT8 = [
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    )
    if hasattr(torch, name)
]
#: dtypes with no arithmetic in torch (two float4 values per byte): they move as bytes,
#: and a reduction of them raises a TypeError that says so
_PACKED = [getattr(torch, name) for name in ("float4_e2m1fn_x2",) if hasattr(torch, name)]

#: dtype -> the dtype it is reduced in (uint64 is special-cased: same bits as int64)
WIDER: dict[torch.dtype, torch.dtype] = {
    torch.int16: torch.int32,
    torch.uint16: torch.int32,
    torch.uint32: torch.int64,
    torch.uint64: torch.int64,
    **{dtype: torch.float32 for dtype in _FLOAT8},
}

#: dtypes gloo refuses, which the calls that only move data move as their bytes
AS_BYTES = frozenset([*WIDER, *_PACKED])

_SIGN = torch.iinfo(torch.int64).min  # xor with it maps unsigned order onto signed order


def _then(result: Union[T, Handle[T]], convert: Callable[[T], U]) -> Union[U, Handle[U]]:
    if isinstance(result, Handle):
        inner = result
        return Handle([inner], lambda: convert(inner.wait()))
    return convert(result)


def _as_bytes(t: Tensor) -> Tensor:
    """``t`` (contiguous) as ``uint8``: one more dimension, of ``t``'s element size."""
    return t.contiguous().unsqueeze(-1).view(torch.uint8)


def _from_bytes(b: Tensor, dtype: torch.dtype) -> Tensor:
    return b.view(dtype).squeeze(-1)


def _packed(fn: str, comm: Any, dtype: torch.dtype) -> NoReturn:
    fail(
        TypeError,
        fn,
        comm,
        f"{dtype} tensors cannot be reduced: torch has no arithmetic for them",
        "Reduce them in a dtype torch computes with, or move them with a collective that "
        "does not reduce (broadcast, all_gather, all_to_all)",
    )


def _wide(data: Tensor, op: Op) -> tuple[Tensor, bool]:
    """``data`` in its reduction dtype, and whether min/max order needs the flip."""
    if data.dtype == torch.uint64:
        bits = data.contiguous().view(torch.int64)
        if op.name in ("max", "min"):
            return bits ^ _SIGN, True
        return bits.clone(), False
    return data.to(WIDER[data.dtype]), False


def _narrow(wide: Tensor, dtype: torch.dtype, flipped: bool) -> Tensor:
    if dtype == torch.uint64:
        return (wide ^ _SIGN if flipped else wide).view(torch.uint64)
    return wide.to(dtype)


class GlooBackend(TorchBackend):
    """:class:`TorchBackend` with the dtypes of :data:`WIDER` carried as above."""

    # -- reductions ---------------------------------------------------------------------

    @watched
    def all_reduce(self, comm: Any, data: Tensor, op: Op, async_op: bool) -> Any:
        if data.dtype not in WIDER:
            if data.dtype in _PACKED:
                _packed("all_reduce", comm, data.dtype)
            return super().all_reduce(comm, data, op, async_op)
        wide, flipped = _wide(data, op)

        def back(reduced: Tensor) -> Tensor:
            data.copy_(_narrow(reduced, data.dtype, flipped))
            return data

        return _then(super().all_reduce(comm, wide, op, async_op), back)

    @watched
    def reduce(self, comm: Any, data: Tensor, dst: int, op: Op, async_op: bool) -> Any:
        if data.dtype not in WIDER:
            if data.dtype in _PACKED:
                _packed("reduce", comm, data.dtype)
            return super().reduce(comm, data, dst, op, async_op)
        wide, flipped = _wide(data, op)

        def back(reduced: Tensor) -> Tensor:
            if comm.rank == dst:
                data.copy_(_narrow(reduced, data.dtype, flipped))
            return data

        return _then(super().reduce(comm, wide, dst, op, async_op), back)

    @watched
    def reduce_scatter(self, comm: Any, data: Any, op: Op, async_op: bool) -> Any:
        first = data if isinstance(data, Tensor) else data[0]
        if first.dtype not in WIDER:
            if first.dtype in _PACKED:
                _packed("reduce_scatter", comm, first.dtype)
            return super().reduce_scatter(comm, data, op, async_op)
        dtype = first.dtype
        wide: Union[Tensor, list[Tensor]]
        if isinstance(data, Tensor):
            wide, flipped = _wide(data, op)
        else:
            pairs = [_wide(t, op) for t in data]
            wide, flipped = [w for w, _ in pairs], pairs[0][1]
        return _then(
            super().reduce_scatter(comm, wide, op, async_op),
            lambda out: _narrow(out, dtype, flipped),
        )

    # -- data movement ------------------------------------------------------------------

    @watched
    def broadcast(self, comm: Any, data: Tensor, src: int, async_op: bool) -> Any:
        if data.dtype not in AS_BYTES:
            return super().broadcast(comm, data, src, async_op)
        carrier = _as_bytes(data)

        def back(received: Tensor) -> Tensor:
            if not data.is_contiguous():  # the carrier was a copy
                data.copy_(_from_bytes(received, data.dtype))
            return data

        return _then(super().broadcast(comm, carrier, src, async_op), back)

    @watched
    def all_gather(self, comm: Any, data: Tensor, async_op: bool, same_shape: bool) -> Any:
        if not same_shape or data.dtype not in AS_BYTES:  # uneven: bytes and real dtypes
            return super().all_gather(comm, data, async_op, same_shape)
        return _then(
            super().all_gather(comm, _as_bytes(data), async_op, same_shape),
            lambda parts: self._own(parts, data, comm.rank),
        )

    @watched
    def all_to_all(self, comm: Any, data: list[Tensor], async_op: bool, same_shape: bool) -> Any:
        if not same_shape or data[0].dtype not in AS_BYTES:  # uneven: bytes, real dtypes
            return super().all_to_all(comm, data, async_op, same_shape)
        mine = data[comm.rank]
        return _then(
            super().all_to_all(comm, [_as_bytes(t) for t in data], async_op, same_shape),
            lambda parts: self._own(parts, mine, comm.rank),
        )

    @watched
    def all_to_all_single(
        self,
        comm: Any,
        data: Tensor,
        output_split_sizes: Optional[list[int]],
        input_split_sizes: Optional[list[int]],
        async_op: bool,
    ) -> Any:
        if data.dtype not in AS_BYTES or _infers_splits(output_split_sizes, input_split_sizes):
            return super().all_to_all_single(
                comm, data, output_split_sizes, input_split_sizes, async_op
            )
        dtype = data.dtype
        return _then(
            super().all_to_all_single(
                comm, _as_bytes(data), output_split_sizes, input_split_sizes, async_op
            ),
            lambda out: _from_bytes(out, dtype),
        )

    @staticmethod
    def _own(parts: list[Tensor], mine: Tensor, rank: int) -> list[Tensor]:
        return [mine if r == rank else _from_bytes(p, mine.dtype) for r, p in enumerate(parts)]


GLOO = GlooBackend()
