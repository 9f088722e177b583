"""What the object codec's decoders may load: the serializers, and the safe allow-list.

The promises of ``serializer="safe"`` are written down once, in
:mod:`distkit.dist.serializer`; the checks keeping them are in
:mod:`distkit.dist.codec.safe` and :mod:`distkit.dist.codec.builders`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from distkit import _settings
from distkit.dist.core.args import fail

if TYPE_CHECKING:
    from distkit.dist.core.args import Where

SERIALIZERS = ("pickle", "safe")
#: False when ``DISTKIT_SERIALIZER`` holds a bad value: then the single-process
#: shortcuts step aside, and the checked path raises the error many ranks would.
ENV_OK = _settings.default("serializer") in SERIALIZERS

#: Globals the safe serializer loads, by name. None of them reaches the unpickler as
#: itself: :mod:`distkit.dist.codec.safe` checks every call's arguments first (see
#: :mod:`distkit.dist.codec.builders`), and NumPy's own
#: globals are not here at all (distkit's encoder sends arrays through its own checked
#: constructors). ``torch.<dtype>`` names are allowed as well (see :func:`allowed`).
_BUILTINS = "bool bytearray bytes complex dict float frozenset int list range set slice str tuple"
SAFE_GLOBALS = frozenset(
    [("builtins", n) for n in _BUILTINS.split()]
    + [("collections", n) for n in ("Counter", "OrderedDict", "defaultdict", "deque")]
    + [("datetime", n) for n in ("date", "datetime", "time", "timedelta", "timezone")]
    + [("decimal", "Decimal"), ("fractions", "Fraction")]
    + [("torch", "Size"), ("torch", "device")]
    + [("distkit.dist.codec.wire", "_tensor_ref")]
    + [
        ("distkit.dist.codec.builders", n)
        for n in ("numpy_array", "numpy_scalar", "numpy_dtype", "tensor_attributes")
    ]
)


class Refused(Exception):
    """Raised inside the decoder for a payload it will not decode; never reaches users.

    :func:`distkit.dist.codec.wire.decode` turns it into :class:`UnsafeObjectError` (the
    ``safe`` serializer) or ``pickle.UnpicklingError`` (``pickle``), naming the sender.
    ``global_name`` is set when a global was refused.
    """

    def __init__(self, reason: str, global_name: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.global_name = global_name


def qualified(item: Any) -> tuple[str, str]:
    if isinstance(item, str):
        module, _, name = item.rpartition(".")
        if not module:
            raise ValueError(f"allow: give 'module.Name' strings or classes, got {item!r}")
        return module, name
    if isinstance(item, type) or callable(item):
        return item.__module__, item.__qualname__
    raise TypeError(f"allow: give classes or 'module.Name' strings, got {type(item).__name__}")


def serializer_of(serializer: Optional[str], fn: str, comm: Where) -> str:
    """The serializer a call uses: its own argument, else the process-wide setting."""
    chosen = _settings.get("serializer") if serializer is None else serializer
    if chosen not in SERIALIZERS:
        fail(
            ValueError,
            fn,
            comm,
            f"serializer must be 'pickle' or 'safe', got {chosen!r}",
            "Set DISTKIT_SERIALIZER to pickle or safe, or pass serializer=",
        )
    return str(chosen)


def allowed(module: str, name: str) -> bool:
    """Whether the safe serializer may load the global ``module.name``.

    Decided by the name alone: nothing is imported or looked up to refuse a global
    (``getattr(torch, "_dynamo")`` alone imports hundreds of modules).
    """
    return (
        (module, name) in SAFE_GLOBALS
        or (module, name) in _settings.get("safe_allow")
        or (module == "torch" and name in torch_dtypes())
    )


def user_classes() -> frozenset[tuple[str, str]]:
    """The ``(module, qualname)`` pairs this process allowed with :func:`set_serializer`."""
    return frozenset(_settings.get("safe_allow"))


_DTYPES: dict[str, Any] = {}


def torch_dtypes() -> dict[str, Any]:
    """``torch.<name>`` dtypes by name (``float32``, ``bfloat16``, ...), read once.

    Read from ``vars(torch)``, which never runs torch's lazy ``__getattr__``.
    """
    if not _DTYPES:
        import torch

        _DTYPES.update((n, v) for n, v in vars(torch).items() if isinstance(v, torch.dtype))
    return _DTYPES
