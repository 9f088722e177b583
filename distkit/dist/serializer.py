"""How object collectives decode what other ranks send: ``pickle`` or ``safe``.

``pickle`` (the default, as in torch and mmengine) loads anything, including objects
whose unpickling runs code. ``safe`` loads plain data only: builtin containers and
scalars, tensors, NumPy arrays of plain numbers, ``datetime``, ``Decimal``, ``Fraction``,
``torch.Size``/``device``/``dtype``, and the classes a process allows. What ``safe``
guarantees, and what it does not, is written down in :mod:`distkit.dist._safe`.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Optional

from distkit import _settings
from distkit.dist._args import fail

if TYPE_CHECKING:
    from distkit.dist._comm import Comm

SERIALIZERS = ("pickle", "safe")
#: False when ``DISTKIT_SERIALIZER`` holds a bad value: then the single-process
#: shortcuts step aside, and the checked path raises the error many ranks would.
ENV_OK = _settings.default("serializer") in SERIALIZERS

#: Globals the safe serializer loads, by name. None of them reaches the unpickler as
#: itself: :mod:`distkit.dist._safe` checks every call's arguments first (see
#: :mod:`distkit.dist._plain`), and NumPy's own
#: globals are not here at all (distkit's encoder sends arrays through its own checked
#: constructors). ``torch.<dtype>`` names are allowed as well (see :func:`allowed`).
_BUILTINS = "bool bytearray bytes complex dict float frozenset int list range set slice str tuple"
SAFE_GLOBALS = frozenset(
    [("builtins", n) for n in _BUILTINS.split()]
    + [("collections", n) for n in ("Counter", "OrderedDict", "defaultdict", "deque")]
    + [("datetime", n) for n in ("date", "datetime", "time", "timedelta", "timezone")]
    + [("decimal", "Decimal"), ("fractions", "Fraction")]
    + [("torch", "Size"), ("torch", "device")]
    + [("distkit.dist._wire", "_tensor_ref")]
    + [("distkit.dist._plain", n) for n in ("numpy_array", "numpy_scalar", "numpy_dtype")]
)


class UnsafeObjectError(pickle.UnpicklingError):
    """The safe serializer refused an object another rank sent; none of it ran.

    Attributes:
        rank: The rank that sent the object.
        global_name: ``module.name`` of the refused global, if a global was refused.
    """

    def __init__(self, message: str, rank: int = -1, global_name: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.global_name = global_name


class Refused(Exception):
    """Raised inside the decoder for a payload it will not decode; never reaches users.

    :func:`distkit.dist._wire.decode` turns it into :class:`UnsafeObjectError` (the
    ``safe`` serializer) or ``pickle.UnpicklingError`` (``pickle``), naming the sender.
    ``global_name`` is set when a global was refused.
    """

    def __init__(self, reason: str, global_name: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.global_name = global_name


def _qualified(item: Any) -> tuple[str, str]:
    if isinstance(item, str):
        module, _, name = item.rpartition(".")
        if not module:
            raise ValueError(f"allow: give 'module.Name' strings or classes, got {item!r}")
        return module, name
    if isinstance(item, type) or callable(item):
        return item.__module__, item.__qualname__
    raise TypeError(f"allow: give classes or 'module.Name' strings, got {type(item).__name__}")


def set_serializer(serializer: str = "pickle", allow: Iterable[Any] = ()) -> None:
    """Choose, for this process, how object collectives decode what other ranks send.

    ``pickle`` (the default, as in torch and mmengine) loads anything, including objects
    whose unpickling runs code: only use it between ranks you trust, which in one
    training job they normally are. ``safe`` loads plain data only (builtin containers
    and scalars, tensors, NumPy arrays, ``datetime``, ``Decimal``, and the classes you
    ``allow``, e.g. your dataclasses and namedtuples); any other global in a received
    object raises :class:`UnsafeObjectError` naming the sending rank and the global,
    before anything runs. Set it once per process with this function or the
    ``DISTKIT_SERIALIZER`` environment variable, or per call with ``serializer=``.

    Args:
        serializer: ``pickle`` or ``safe``.
        allow: Classes (or ``"module.Name"`` strings) the safe serializer may load, in
            addition to plain data. Extends the allow-list; pass them on every rank.

    Raises:
        ValueError: ``serializer`` is not ``pickle`` or ``safe``.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.set_serializer("safe", allow=["collections.ChainMap"])
        >>> dist.get_serializer()
        'safe'
        >>> dist.set_serializer("pickle")
    """
    if serializer not in SERIALIZERS:
        raise ValueError(
            f"set_serializer: serializer must be 'pickle' or 'safe', got {serializer!r}"
        )
    extra = frozenset(_qualified(item) for item in allow)
    _settings.set("serializer", serializer)
    if extra:
        _settings.set("safe_allow", _settings.get("safe_allow") | extra)


def get_serializer() -> str:
    """The process-wide serializer: ``pickle`` or ``safe`` (see :func:`set_serializer`).

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_serializer()
        'pickle'
    """
    return str(_settings.get("serializer"))


def resolve(serializer: Optional[str], fn: str, comm: Comm) -> str:
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
