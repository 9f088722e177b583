"""How object collectives decode what other ranks send: ``pickle`` or ``safe``.

``pickle`` (the default, as in torch and mmengine) loads anything, including objects
whose unpickling runs code. ``safe`` loads plain data only: builtin containers and
scalars, tensors, NumPy arrays of plain numbers, ``datetime``, ``Decimal``, ``Fraction``,
``torch.Size``/``device``/``dtype``, and the classes a process allows.

Threat model
------------
Another rank (or anything able to write into the job's collectives) may send any bytes.
Whatever the bytes, decoding them with the safe serializer:

- **Runs no code of the sender's choosing.** A payload can name only the globals in
  :data:`SAFE_GLOBALS`, ``torch.<dtype>`` and the classes the process allowed, checked by
  name: nothing is imported or looked up to refuse one. Every call a payload makes is
  first made against a stand-in that checks its arguments (plain ints, strings and bytes
  of bounded size). NumPy's own globals (``_reconstruct``, ``dtype`` and its state,
  ``scalar``) are never loaded: distkit's encoder sends arrays, scalars and dtypes
  through its own checked constructors (:mod:`distkit.dist._plain`).
- **Corrupts no memory.** NumPy data is of fixed-size bool, integer, float, complex,
  datetime, timedelta, bytes or unicode dtypes only, never object, structured or void
  ones (an object dtype reads received bytes as pointers). The shape of an array or a
  tensor must cover exactly the bytes received for it (never uninitialised memory), a
  tensor's blob is handed out once, and bool data holds only 0 and 1. What the decoder
  builds cannot be changed by the pickle afterwards: no ``BUILD`` (``__setstate__``),
  ``SETITEM``, ``APPEND`` or ``ADDITEMS`` on tensors, arrays, classes or other built
  values (a tensor's ``__setstate__`` can resize the receive buffer under the other
  views of it). A payload that may nest tuples deeper than
  :data:`~distkit.dist._opcodes.SHALLOW` (CPython hashes a tuple recursively in C) is
  unpickled on a thread whose stack holds it.
- **Allocates in proportion to what it received**: at most
  :data:`~distkit.dist._safe.EXPANSION` (256) bytes per byte received (CPU and device
  parts together), or ``max_bytes`` in all when set (:func:`set_serializer`), checked
  before allocating. No constructor takes a size from the sender (``bytearray(n)``,
  ``bytes(n)``, ``list(range(n))``, ``int('9' * n)``, ``Decimal('1e999999999')``,
  ``deque(range(n))`` are refused); tensor and array data stay in the receive buffer or
  are copied out of it once (a copy to another device is charged first); and the opcodes
  with which a few bytes make CPython's unpickler allocate gigabytes (``LONG_BINPUT
  2**31`` grows its memo to 32 GiB; a byte count past the end of the payload is
  allocated before it is read) are refused by a scan before the unpickler runs. The
  pickle machine itself makes at most :data:`~distkit.dist._safe.VM_BYTES_PER_BYTE`
  bytes of objects per byte of pickle; that is charged up front.
- **Builds only listed types**: builtin scalars and containers, tensors and
  ``nn.Parameter``, NumPy arrays, scalars and dtypes of the dtypes above, ``datetime``,
  ``date``, ``time``, ``timedelta``, ``timezone``, ``Decimal``, ``Fraction``,
  ``OrderedDict``, ``defaultdict``, ``Counter``, ``deque``, ``range``, ``slice``,
  ``torch.Size``/``device``/``dtype``, ``memoryview`` (an out-of-band buffer: received
  bytes), and the allowed classes.

It does not:

- **authenticate ranks**: whoever joins the process group or writes to its store is a
  rank; the safe serializer only limits what a rank's bytes can do once received;
- **check values**: a rank can send wrong numbers, tensors of shapes your code does not
  expect, or not take part at all (the collective then times out);
- **bound what is proportionate**: a rank can send a large payload (taking up to
  ``EXPANSION`` times its size) or one that is slow to decode (CPU time is not bounded;
  integer dict keys crafted to collide in their hashes take quadratic time);
  and a received tuple may nest as deep as its payload allows (hashing one nested more
  than about 100k deep crashes CPython on a default stack, in any code);
- **protect the ``pickle`` serializer**, which trusts peers completely: a ``pickle``
  payload can run any code on the receiving rank.

Allowed classes. ``set_serializer("safe", allow=[...])`` lets a payload name a class, and
the safe serializer then does with it what pickle does: ``cls.__new__(cls, *args)``
(``**kwargs`` too with ``NEWOBJ_EX``) or ``cls(*args)``, then ``__setstate__(state)`` or an
update of the instance ``__dict__`` (``setattr`` for slots), and ``append``/``extend``,
``add`` or ``__setitem__`` for items, all with arguments that are checked plain data (or
other allowed objects). That is the code you vouch for by allowing a class: those
methods, and ``__hash__``/``__eq__`` if its instances are dict keys, run with values of
the sender's choosing, and what they allocate is not bounded. A dataclass or namedtuple of
plain fields is safe; a class whose constructor opens files, imports modules or evaluates
strings is not. The class itself cannot be changed (no ``BUILD`` on it), and it may be
built on another thread (see the deep tuples above).

How ``safe`` does it (an opcode scan, then checked stand-ins before the real objects) is
described in :mod:`distkit.dist._safe`.
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


def set_serializer(
    serializer: str = "pickle", allow: Iterable[Any] = (), max_bytes: Optional[int] = None
) -> None:
    """Choose, for this process, how object collectives decode what other ranks send.

    ``pickle`` (the default, as in torch and mmengine) loads anything, including objects
    whose unpickling runs code: only use it between ranks you trust, which in one
    training job they normally are. ``safe`` loads plain data only (builtin containers
    and scalars, tensors, NumPy arrays, ``datetime``, ``Decimal``, and the classes you
    ``allow``, e.g. your dataclasses and namedtuples); any other global in a received
    object raises :class:`UnsafeObjectError` naming the sending rank and the global,
    before anything runs. Set it once per process with this function or the
    ``DISTKIT_SERIALIZER`` environment variable, or per call with ``serializer=``.
    What ``safe`` guarantees, and what it does not, is in this module's docstring.

    Args:
        serializer: ``pickle`` or ``safe``.
        allow: Classes (or ``"module.Name"`` strings) the safe serializer may load, in
            addition to plain data. Extends the allow-list; pass them on every rank.
        max_bytes: The most memory, in bytes, one object decoded by the safe serializer
            may take, checked before it is allocated. ``None`` (the default): 256 bytes
            per byte received, which no plain data reaches.

    Raises:
        ValueError: ``serializer`` is not ``pickle`` or ``safe``, or ``max_bytes`` is not
            a positive int.

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
    if max_bytes is not None and (type(max_bytes) is not int or max_bytes <= 0):
        raise ValueError(
            f"set_serializer: max_bytes must be a positive int or None, got {max_bytes!r}"
        )
    extra = frozenset(_qualified(item) for item in allow)
    _settings.set("serializer", serializer)
    _settings.set("safe_max_bytes", max_bytes)
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
