"""Argument checks shared by every backend, and distkit's error message layout.

Every check runs before any communication and raises the same exception, with the same
message, whatever the world size: the message says what was wrong, on which rank, and
what to do (``fn: what (on rank r of n). Fix``).
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Optional

import torch
from torch import Tensor

if TYPE_CHECKING:
    from distkit.dist._comm import Comm


_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")  # 2.5+, 2.4


def dtensor_type() -> Any:
    """torch's DTensor class, or ``None`` while no module defining it is loaded (then no
    DTensor can exist, and nothing is imported for nothing)."""
    for name in _DTENSOR_MODULES:
        module = sys.modules.get(name)
        found = getattr(module, "DTensor", None)
        if found is not None:
            return found
    return None


def is_dtensor(obj: Any) -> bool:
    kind = dtensor_type()
    return kind is not None and isinstance(obj, kind)


def where(comm: Comm) -> str:
    return f"rank {comm.rank} of {comm.size}"


def fail(exc: type[Exception], fn: str, comm: Comm, what: str, fix: str = "") -> NoReturn:
    """Raise ``exc`` with distkit's message layout: ``fn: what (on rank r of n). fix``."""
    message = f"{fn}: {what} (on {where(comm)})"
    if fix:
        message += f". {fix}"
    raise exc(message)


#: Exception types a rank can pass on to the others of a collective it cannot complete
#: (by their index); anything else arrives as the last, RuntimeError.
REMOTE_ERRORS: tuple[type[Exception], ...] = (TypeError, ValueError, RuntimeError)


def error_code(exc: BaseException) -> int:
    """The index in :data:`REMOTE_ERRORS` of the type ``exc`` is passed on as."""
    for i, kind in enumerate(REMOTE_ERRORS):
        if isinstance(exc, kind):
            return i
    return len(REMOTE_ERRORS) - 1


def remote_failure(code: int, fn: str, comm: Comm, what: str) -> NoReturn:
    """Raise, on a rank left waiting, the error another rank passed on (see error_code)."""
    kind = REMOTE_ERRORS[code] if 0 <= code < len(REMOTE_ERRORS) else RuntimeError
    fail(kind, fn, comm, what)


def show(value: Any) -> str:
    """A short description of a bad argument for an error message."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"{type(value).__name__} {value!r}"[:120]


def tensor(value: Any, name: str, fn: str, comm: Comm) -> Tensor:
    if not isinstance(value, Tensor):
        fail(TypeError, fn, comm, f"{name} must be a torch.Tensor, got {show(value)}")
    if value.__class__ is not Tensor:
        not_dtensor(value, name, fn, comm)
    dense(value, name, fn, comm)
    return value


def dense(value: Tensor, name: str, fn: str, comm: Comm) -> None:
    """Reject tensors whose memory is not one strided block of numbers: sparse, MKL-DNN,
    quantized, nested and meta tensors (tensor collectives send a tensor's raw memory).

    A single process's shortcut only tests the tensor's class (reading its layout would
    double the cost of the call), so there such a tensor passes through unchanged; every
    call that reaches a backend raises this instead of torch's own error from deep inside
    the collective.
    """
    if value.is_nested:  # strided or jagged layout
        kind = "nested"
    elif value.layout is not torch.strided:
        kind = str(value.layout).replace("torch.", "").lstrip("_")
    elif value.is_quantized or value.is_meta:
        kind = "quantized" if value.is_quantized else "meta"
    else:
        return
    fixes = {
        "quantized": f"Send {name}.dequantize(), or its int_repr() and its scales",
        "nested": f"Send its components ({name}.unbind()), or use an object collective",
        "meta": "A meta tensor has no data to send: create it on a real device",
    }
    fail(
        TypeError,
        fn,
        comm,
        f"{name} is a {kind} tensor; tensor collectives send the memory of dense tensors",
        fixes.get(kind, f"Send {name}.to_dense()"),
    )


def not_dtensor(value: Tensor, name: str, fn: str, comm: Comm) -> None:
    """Reject a DTensor: a tensor collective moves plain tensors, and which tensor of a
    DTensor to move (this rank's shard, or the whole) is the caller's choice."""
    if is_dtensor(value):
        fail(
            TypeError,
            fn,
            comm,
            f"{name} is a DTensor; distkit's tensor collectives take plain tensors",
            f"Pass {name}.to_local() (this rank's shard) or {name}.full_tensor() (the "
            "whole tensor, gathered)",
        )


def writable(value: Tensor, name: str, fn: str, comm: Comm) -> None:
    """Reject tensors a collective cannot write its result into (``expand()`` views)."""
    if not value.is_contiguous() and torch._debug_has_internal_overlap(value) == 1:
        fail(
            ValueError,
            fn,
            comm,
            f"{name} is a view whose elements share memory (e.g. from expand()), so the "
            "result cannot be written into it in place",
            f"Pass {name}.clone() (or {name}.contiguous())",
        )


def flag(value: Any, name: str, fn: str, comm: Comm) -> bool:
    if value is not True and value is not False:
        fail(TypeError, fn, comm, f"{name} must be True or False, got {show(value)}")
    return value


def rank(value: Any, name: str, fn: str, comm: Comm) -> int:
    """Check that ``value`` is a group rank of ``comm`` (src/dst arguments).

    Any integer is accepted (NumPy's too), never a bool or a float.
    """
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None:
        fail(TypeError, fn, comm, f"{name} must be an int rank, got {show(value)}")
    if not 0 <= number < comm.size:
        fix = f"{name} is a rank within group, from 0 to {comm.size - 1}"
        members = comm.global_ranks()
        if number in members:
            fix += f"; global rank {number} is group rank {members.index(number)}"
        fail(
            ValueError,
            fn,
            comm,
            f"{name}={number} is out of range for a group of size {comm.size}",
            fix,
        )
    return number


def tensor_list(
    value: Any, name: str, fn: str, comm: Comm, *, same_shape: bool = False
) -> list[Tensor]:
    """Check a list holding one tensor per rank of ``comm``, all of one dtype and device."""
    if not isinstance(value, (list, tuple)):
        fail(
            TypeError,
            fn,
            comm,
            f"{name} must be a list of {comm.size} tensors (one per rank), got {show(value)}",
        )
    if len(value) != comm.size:
        fail(
            ValueError,
            fn,
            comm,
            f"{name} must hold {comm.size} tensors (one per rank), got {len(value)}",
            "Pass exactly one tensor for each rank of the group",
        )
    for i, t in enumerate(value):
        if not isinstance(t, Tensor):
            fail(TypeError, fn, comm, f"{name}[{i}] must be a torch.Tensor, got {show(t)}")
        if t.__class__ is not Tensor:
            not_dtensor(t, f"{name}[{i}]", fn, comm)
        dense(t, f"{name}[{i}]", fn, comm)
    first = value[0]
    for i, t in enumerate(value):
        if t.dtype != first.dtype:
            fail(
                TypeError,
                fn,
                comm,
                f"{name} mixes dtypes: {name}[0] is {first.dtype}, {name}[{i}] is {t.dtype}",
                "Cast the tensors to one dtype",
            )
        if same_shape and t.shape != first.shape:
            fail(
                ValueError,
                fn,
                comm,
                f"{name} mixes shapes: {name}[0] is {tuple(first.shape)}, "
                f"{name}[{i}] is {tuple(t.shape)}",
                "Every tensor must have the same shape here",
            )
        if t.device != first.device:
            fail(
                ValueError,
                fn,
                comm,
                f"{name} mixes devices: {name}[0] is on {first.device}, "
                f"{name}[{i}] is on {t.device}",
                "Move the tensors to one device",
            )
    return list(value)


def splits(value: Any, name: str, total: Optional[int], fn: str, comm: Comm) -> list[int]:
    """Check split sizes: one non-negative int per rank, summing to ``total`` if given."""
    if isinstance(value, Tensor):
        value = value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        fail(TypeError, fn, comm, f"{name} must be a list of ints, got {show(value)}")
    out = list(value)
    if len(out) != comm.size:
        fail(
            ValueError,
            fn,
            comm,
            f"{name} must hold {comm.size} sizes (one per rank), got {len(out)}",
        )
    for i, s in enumerate(out):
        if isinstance(s, bool) or not isinstance(s, int):
            fail(TypeError, fn, comm, f"{name}[{i}] must be an int, got {show(s)}")
        if s < 0:
            fail(ValueError, fn, comm, f"{name}[{i}]={s} is negative", "Split sizes count rows")
    if total is not None and sum(out) != total:
        fail(
            ValueError,
            fn,
            comm,
            f"{name} {out} sums to {sum(out)}, but the tensor has {total} rows in dim 0",
            "Split sizes must add up to the length of dim 0",
        )
    return out


def object_list(value: Any, fn: str, comm: Comm) -> list:
    """Check a list holding one object per rank of ``comm``."""
    if not isinstance(value, (list, tuple)):
        fail(
            TypeError,
            fn,
            comm,
            f"data must be a list of {comm.size} objects (one per rank), got {show(value)}",
        )
    if len(value) != comm.size:
        fail(
            ValueError,
            fn,
            comm,
            f"data must hold {comm.size} objects (one per rank), got {len(value)}",
            "Pass exactly one object for each rank of the group",
        )
    return list(value)


def map_location(value: Any, fn: str, comm: Comm) -> Optional[torch.device]:
    """Check a ``map_location`` argument: ``None`` or anything ``torch.device`` accepts."""
    if value is None:
        return None
    try:
        return torch.device(value)
    except (RuntimeError, TypeError, ValueError) as exc:
        fail(
            ValueError,
            fn,
            comm,
            f"map_location must be None or a device, got {show(value)} ({exc})",
            "Pass e.g. 'cpu', 'cuda' or a torch.device",
        )
