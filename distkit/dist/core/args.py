"""Argument checks shared by every layer, reduction ops, and distkit's error layout.

Every check runs before any communication and raises the same exception, with the same
message, whatever the world size: the message says what was wrong, on which rank, and
what to do (``fn: what (on rank r of n). Fix``). Reduction ops: the names distkit
accepts, and which dtypes each op applies to.

The checks need only where the caller stands (``comm.rank``, ``comm.size``): any
:class:`Where`, which :class:`~distkit.dist.core.comm.Comm` is, so this module imports no
other layer.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn, Optional, Protocol, Union

import torch
from torch import Tensor

from distkit._compat import ReduceOp


class Where(Protocol):
    """Where a call stands: this rank's place in its group (a Comm is one)."""

    rank: int
    size: int

    def global_ranks(self) -> list[int]: ...


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


def where(comm: Where) -> str:
    return f"rank {comm.rank} of {comm.size}"


def fail(exc: type[Exception], fn: str, comm: Where, what: str, fix: str = "") -> NoReturn:
    """Raise ``exc`` with distkit's message layout: ``fn: what (on rank r of n). fix``."""
    message = f"{fn}: {what} (on {where(comm)})"
    if fix:
        message += f". {fix}"
    raise exc(message)


#: Exception types a rank can pass on to the others of a collective it cannot complete
#: (by their index); anything else arrives as the last, RuntimeError.
REMOTE_ERRORS: tuple[type[Exception], ...] = (TypeError, ValueError, RuntimeError)


#: How the other ranks hear of one rank's argument error: ``rank <r> passed bad arguments:``.
REFUSED = "passed bad arguments: "


def bare(exc: BaseException, fn: str, comm: Where) -> str:
    """``exc``'s message without the call's name and this rank's place (as another rank
    says it, ``rank <r> ...``)."""
    return str(exc).removeprefix(f"{fn}: ").replace(f" (on {where(comm)})", "", 1)


def refused(exc: BaseException, fn: str, comm: Where) -> str:
    """This rank's argument error as the other ranks hear it, after ``rank <r> ``."""
    return REFUSED + bare(exc, fn, comm)


def error_code(exc: BaseException) -> int:
    """The index in :data:`REMOTE_ERRORS` of the type ``exc`` is passed on as."""
    for i, kind in enumerate(REMOTE_ERRORS):
        if isinstance(exc, kind):
            return i
    return len(REMOTE_ERRORS) - 1


def remote_failure(code: int, fn: str, comm: Where, what: str) -> NoReturn:
    """Raise, on a rank left waiting, the error another rank passed on (see error_code)."""
    kind = REMOTE_ERRORS[code] if 0 <= code < len(REMOTE_ERRORS) else RuntimeError
    fail(kind, fn, comm, what)


def ranks_said(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 0, 2``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def by_value(values: dict[int, Any]) -> str:
    """``{rank: value}`` as ``a on ranks 0, 2 and b on rank 1`` (first seen first)."""
    groups: dict[str, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(str(value), []).append(rank)
    parts = [f"{value} on {ranks_said(ranks)}" for value, ranks in groups.items()]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def show(value: Any) -> str:
    """A short description of a bad argument for an error message."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"{type(value).__name__} {value!r}"[:120]


def tensor(value: Any, name: str, fn: str, comm: Where) -> Tensor:
    if not isinstance(value, Tensor):
        fail(TypeError, fn, comm, f"{name} must be a torch.Tensor, got {show(value)}")
    if value.__class__ is not Tensor:
        not_dtensor(value, name, fn, comm)
    dense(value, name, fn, comm)
    return value


def dense(value: Tensor, name: str, fn: str, comm: Where) -> None:
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


def not_dtensor(value: Tensor, name: str, fn: str, comm: Where) -> None:
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


def flag(value: Any, name: str, fn: str, comm: Where) -> bool:
    if value is not True and value is not False:
        fail(TypeError, fn, comm, f"{name} must be True or False, got {show(value)}")
    return value


def rank(value: Any, name: str, fn: str, comm: Where) -> int:
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


def peer(value: Any, name: str, fn: str, comm: Where) -> int:
    """Check that ``value`` is a group rank of ``comm`` other than this one (the ``dst`` or
    ``src`` of a point-to-point call: torch refuses a rank's message to itself too)."""
    number = rank(value, name, fn, comm)
    if number == comm.rank:
        fail(
            ValueError,
            fn,
            comm,
            f"{name}={number} is this rank: a rank cannot send to or receive from itself",
            "Name another rank of the group (dist.exchange returns this rank's own entry as "
            "passed)",
        )
    return number


def tag(value: Any, fn: str, comm: Where, limit: int) -> int:
    """Check a point-to-point ``tag``: an int from 0 to ``limit - 1``."""
    try:
        number = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        number = None
    if number is None:
        fail(TypeError, fn, comm, f"tag must be an int, got {show(value)}")
    if not 0 <= number < limit:
        fail(
            ValueError,
            fn,
            comm,
            f"tag={number} is out of range",
            f"Tags are ints from 0 to {limit - 1}",
        )
    return number


def tensor_list(
    value: Any, name: str, fn: str, comm: Where, *, same_shape: bool = False
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


def splits(value: Any, name: str, total: Optional[int], fn: str, comm: Where) -> list[int]:
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


def object_list(value: Any, fn: str, comm: Where) -> list:
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


def map_location(value: Any, fn: str, comm: Where) -> Optional[torch.device]:
    """Check a ``map_location`` argument: ``None`` or anything ``torch.device`` accepts,
    on a device this process has (refused here, before any communication, as in a single
    process: else only the ranks that receive tensors would fail, once they arrive)."""
    if value is None:
        return None
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError) as exc:
        fail(
            ValueError,
            fn,
            comm,
            f"map_location must be None or a device, got {show(value)} ({exc})",
            "Pass e.g. 'cpu', 'cuda' or a torch.device",
        )
    missing = _missing(device)
    if missing:
        fail(
            ValueError,
            fn,
            comm,
            f"map_location={value!r}, but {missing}",
            "Pass a device this process has (e.g. 'cpu'), or None to keep the senders' devices",
        )
    return device


def _missing(device: torch.device) -> str:
    """Why this process has no ``device`` (``""``: it has it, or torch cannot tell)."""
    if device.type in ("cpu", "meta"):
        return ""
    # torch.cuda, torch.xpu, torch.mps, and the modules device plugins add (torch.npu)
    module = getattr(torch, device.type, None)
    available = getattr(module, "is_available", None)
    if not callable(available):  # torch.xla, torch.hpu, ... without their plugin
        return f"this process has no {device.type} device (no torch.{device.type} module)"
    if not available():
        return f"this process has no {device.type} device ({device.type} is not available)"
    count = getattr(module, "device_count", None)
    if device.index is not None and callable(count) and device.index >= count():
        return f"this process has {count()} {device.type} device(s)"
    return ""


# -- reduction ops ---------------------------------------------------------------------

#: What every ``op`` argument accepts: a name (any case) or a torch ``ReduceOp``.
OpLike = Union[str, ReduceOp, "ReduceOp.RedOpType"]


class Op(NamedTuple):
    """A reduction: its distkit name and the torch op it runs as."""

    name: str
    torch_op: Any
    divide: bool = False  # mean: sum, then divide by the group size (see mean_of)


def mean_of(total: Tensor, size: int) -> None:
    """Turn ``total``, a sum over ``size`` ranks, into their mean, in place.

    The result keeps ``total``'s dtype, as mmengine's does: integers are divided with
    truncation toward zero (exactly: mmengine goes through float32), and for bools the
    sum is already their logical or, which is what the mean of bools stored as a bool is.
    """
    if total.dtype.is_floating_point or total.dtype.is_complex:
        total.div_(size)
    elif total.dtype is not torch.bool:
        total.div_(size, rounding_mode="trunc")


NAMES = ("sum", "mean", "max", "min", "product", "band", "bor", "bxor")


def _build() -> dict[str, Op]:
    table = {
        "sum": Op("sum", ReduceOp.SUM),
        "mean": Op("mean", ReduceOp.SUM, divide=True),
        "max": Op("max", ReduceOp.MAX),
        "min": Op("min", ReduceOp.MIN),
        "product": Op("product", ReduceOp.PRODUCT),
        "band": Op("band", ReduceOp.BAND),
        "bor": Op("bor", ReduceOp.BOR),
        "bxor": Op("bxor", ReduceOp.BXOR),
    }
    # other spellings: torch's AVG and PRODUCT names
    table["avg"] = table["mean"]
    table["prod"] = table["product"]
    return table


OPS = _build()
_BY_TORCH: dict[Any, str] = {
    ReduceOp.SUM: "sum",
    ReduceOp.MAX: "max",
    ReduceOp.MIN: "min",
    ReduceOp.PRODUCT: "product",
    ReduceOp.BAND: "band",
    ReduceOp.BOR: "bor",
    ReduceOp.BXOR: "bxor",
}
if getattr(ReduceOp, "AVG", None) is not None:
    _BY_TORCH[ReduceOp.AVG] = "mean"
_TORCH_OPS = (ReduceOp, type(ReduceOp.SUM))


def op_of(value: Any, fn: str, comm: Where) -> Op:
    """Resolve an op name (any case) or a torch ``ReduceOp`` to an :class:`Op`."""
    if isinstance(value, str):
        found = OPS.get(value) or OPS.get(value.lower())
        if found is not None:
            return found
        fail(
            ValueError,
            fn,
            comm,
            f"unknown op {value!r}",
            f"Use one of {', '.join(NAMES)} (any case) or a torch ReduceOp",
        )
    name = None
    if isinstance(value, _TORCH_OPS):  # not plain ints: torch's ops compare equal to them
        try:
            name = _BY_TORCH.get(value)
        except TypeError:  # a ReduceOp object (PREMUL_SUM) is unhashable
            name = None
    if name is None:
        fail(
            ValueError if isinstance(value, ReduceOp) else TypeError,
            fn,
            comm,
            f"op must be an op name or a torch ReduceOp, got {show(value)}",
            f"Use one of {', '.join(NAMES)}",
        )
    return OPS[name]


_VALID: set[tuple[str, torch.dtype]] = set()  # (op, dtype) pairs already accepted


def check_dtype(op: Op, t: Tensor, name: str, fn: str, comm: Where) -> None:
    """Reject the dtype/op pairs that torch's backends reject (gloo's rules)."""
    dtype = t.dtype
    if (op.name, dtype) in _VALID:
        return
    if op.name in ("band", "bor", "bxor") and (dtype.is_floating_point or dtype.is_complex):
        fail(
            TypeError,
            fn,
            comm,
            f"op='{op.name}' needs an integer or bool {name}, got {dtype}",
            "Bitwise reductions only apply to integer and bool tensors",
        )
    if dtype.is_complex and op.name not in ("sum", "mean"):
        fail(
            TypeError,
            fn,
            comm,
            f"op='{op.name}' is not defined for complex {name} ({dtype})",
            "Complex tensors support op='sum' and op='mean'",
        )
    _VALID.add((op.name, dtype))
