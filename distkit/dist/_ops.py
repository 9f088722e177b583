"""Reduction ops: the names distkit accepts, and which dtypes each op applies to."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Union

import torch
from torch import Tensor

from distkit._compat import ReduceOp
from distkit.dist._args import fail, show

if TYPE_CHECKING:
    from distkit.dist._comm import Comm

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


def resolve(value: Any, fn: str, comm: Comm) -> Op:
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


def check_dtype(op: Op, t: Tensor, name: str, fn: str, comm: Comm) -> None:
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
