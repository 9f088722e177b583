"""How object collectives decode what other ranks send: ``pickle`` or ``safe``.

``pickle`` (the default, as in torch and mmengine) loads anything, including objects
whose unpickling runs code. ``safe`` loads plain data only: builtin containers and
scalars, tensors, NumPy arrays, ``datetime``, ``Decimal``, ``Fraction``,
``torch.Size``/``device``/``dtype``, and the classes a process allows.
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

#: Globals the safe serializer loads: plain data only. Nothing here runs code of the
#: sender's choosing when called with the arguments a pickle can give it.
_BUILTINS = "bool bytearray bytes complex dict float frozenset int list range set slice str tuple"
_NUMPY_MODULES = (
    "numpy",
    "numpy.core.multiarray",
    "numpy._core.multiarray",
    "numpy.core.numeric",
    "numpy._core.numeric",
)
SAFE_GLOBALS = frozenset(
    [("builtins", n) for n in _BUILTINS.split()]
    + [("collections", n) for n in ("Counter", "OrderedDict", "defaultdict", "deque")]
    + [("datetime", n) for n in ("date", "datetime", "time", "timedelta", "timezone")]
    + [("decimal", "Decimal"), ("fractions", "Fraction")]
    + [("torch", "Size"), ("torch", "device")]
    + [
        (m, n)
        for m in _NUMPY_MODULES
        for n in ("dtype", "ndarray", "scalar", "_reconstruct", "_frombuffer")
    ]
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
    """Whether the safe serializer may load the global ``module.name``."""
    if (module, name) in SAFE_GLOBALS or (module, name) in _settings.get("safe_allow"):
        return True
    if module == "torch":  # torch.float32 and friends
        import torch

        return isinstance(getattr(torch, name, None), torch.dtype)
    return False
