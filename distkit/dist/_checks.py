"""Argument checks shared by the single-process and the torch backends.

Every check runs before any communication and raises the same exception, with the same
message, whatever the world size: the message says what was wrong, on which rank, and
what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn, Optional

import torch
from torch import Tensor

from distkit._compat import ReduceOp


def where(comm: Any) -> str:
    return f"rank {comm.rank} of {comm.size}"


def fail(exc: type[Exception], fn: str, comm: Any, what: str, fix: str = "") -> NoReturn:
    """Raise ``exc`` with distkit's message layout: ``fn: what (on rank r of n). fix``."""
    message = f"{fn}: {what} (on {where(comm)})"
    if fix:
        message += f". {fix}"
    raise exc(message)


def describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"{type(value).__name__} {value!r}"[:120]


def tensor(value: Any, name: str, fn: str, comm: Any) -> Tensor:
    if not isinstance(value, Tensor):
        fail(TypeError, fn, comm, f"{name} must be a torch.Tensor, got {describe(value)}")
    return value


def rank(value: Any, name: str, fn: str, comm: Any) -> int:
    """Check that ``value`` is a group rank of ``comm`` (src/dst arguments)."""
    if isinstance(value, bool) or not isinstance(value, int):
        fail(TypeError, fn, comm, f"{name} must be an int rank, got {describe(value)}")
    if not 0 <= value < comm.size:
        plural = "s" if comm.size != 1 else ""
        fix = f"{name} is a rank within group, from 0 to {comm.size - 1}"
        members = comm.global_ranks() if comm.pg is not None else [0]
        if value in members:
            fix += f"; global rank {value} is group rank {members.index(value)}"
        fail(
            ValueError,
            fn,
            comm,
            f"{name}={value} is out of range for a group of {comm.size} rank{plural}",
            fix,
        )
    return value


def tensor_list(
    value: Any, name: str, fn: str, comm: Any, *, same_shape: bool = False
) -> list[Tensor]:
    """Check a list holding one tensor per rank of ``comm``, all of one dtype."""
    if not isinstance(value, (list, tuple)):
        fail(
            TypeError,
            fn,
            comm,
            f"{name} must be a list of {comm.size} tensors (one per rank), "
            f"got {describe(value)}",
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
            fail(TypeError, fn, comm, f"{name}[{i}] must be a torch.Tensor, got {describe(t)}")
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
                "Every chunk of a reduce_scatter must have the same shape",
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


def splits(value: Any, name: str, total: Optional[int], fn: str, comm: Any) -> list[int]:
    """Check split sizes: one non-negative int per rank, summing to ``total`` if given."""
    if isinstance(value, Tensor):
        value = value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        fail(TypeError, fn, comm, f"{name} must be a list of ints, got {describe(value)}")
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
            fail(TypeError, fn, comm, f"{name}[{i}] must be an int, got {describe(s)}")
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


class Op(NamedTuple):
    """A reduction: its distkit name and the torch op it runs as."""

    name: str
    torch_op: Any
    divide: bool = False  # mean: sum, then divide by the group size


def _build_ops() -> dict[str, Op]:
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
    table["avg"] = table["mean"]
    table["prod"] = table["product"]
    return table


OPS = _build_ops()
OP_NAMES = ("sum", "mean", "max", "min", "product", "band", "bor", "bxor")
_BY_TORCH = {
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


def op(value: Any, fn: str, comm: Any) -> Op:
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
            f"Use one of {', '.join(OP_NAMES)} (any case) or a torch ReduceOp",
        )
    try:
        name = _BY_TORCH.get(value)
    except TypeError:  # unhashable
        name = None
    if name is None:
        fail(
            ValueError if isinstance(value, ReduceOp) else TypeError,
            fn,
            comm,
            f"op must be an op name or a torch ReduceOp, got {describe(value)}",
            f"Use one of {', '.join(OP_NAMES)}",
        )
    return OPS[name]


_VALID: set[tuple[str, torch.dtype]] = set()  # (op, dtype) pairs already accepted


def op_dtype(o: Op, t: Tensor, name: str, fn: str, comm: Any) -> None:
    """Reject the dtype/op pairs that torch's backends reject (gloo's rules)."""
    dtype = t.dtype
    if (o.name, dtype) in _VALID:
        return
    if o.name == "mean" and not (dtype.is_floating_point or dtype.is_complex):
        fail(
            TypeError,
            fn,
            comm,
            f"op='mean' needs a floating-point or complex {name}, got {dtype}",
            f"Cast first, e.g. {name}.float(), or use op='sum'",
        )
    if o.name in ("band", "bor", "bxor") and (dtype.is_floating_point or dtype.is_complex):
        fail(
            TypeError,
            fn,
            comm,
            f"op='{o.name}' needs an integer or bool {name}, got {dtype}",
            "Bitwise reductions only apply to integer and bool tensors",
        )
    if dtype.is_complex and o.name not in ("sum", "mean"):
        fail(
            TypeError,
            fn,
            comm,
            f"op='{o.name}' is not defined for complex {name} ({dtype})",
            "Complex tensors support op='sum' and op='mean'",
        )
    _VALID.add((o.name, dtype))


def flat_bytes(t: Tensor) -> Tensor:
    """A contiguous 1-D uint8 view of ``t``'s data (a copy only if ``t`` is strided)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8)
