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
  through its own checked constructors (:mod:`distkit.dist.codec.builders`).
- **Corrupts no memory.** NumPy data is of fixed-size bool, integer, float, complex,
  datetime, timedelta, bytes or unicode dtypes only, never object, structured or void
  ones (an object dtype reads received bytes as pointers). The shape of an array or a
  tensor must cover exactly the bytes received for it (never uninitialised memory), a
  tensor's blob is handed out once, and bool data holds only 0 and 1. What the decoder
  builds cannot be changed by the pickle afterwards: no ``BUILD`` (``__setstate__``),
  ``SETITEM``, ``APPEND`` or ``ADDITEMS`` on tensors, arrays, classes or other built
  values (a tensor's ``__setstate__`` can resize the receive buffer under the other
  views of it). A payload that may nest tuples deeper than
  :data:`~distkit.dist.codec.opcodes.SHALLOW` (CPython hashes a tuple recursively in C) is
  unpickled on a thread whose stack holds it.
- **Allocates in proportion to what it received**: at most
  :data:`~distkit.dist.codec.safe.EXPANSION` (256) bytes per byte received (CPU and device
  parts together), or ``max_bytes`` in all when set (:func:`set_serializer`), checked
  before allocating. No constructor takes a size from the sender (``bytearray(n)``,
  ``bytes(n)``, ``list(range(n))``, ``int('9' * n)``, ``Decimal('1e999999999')``,
  ``deque(range(n))`` are refused); tensor and array data stay in the receive buffer or
  are copied out of it once (a copy to another device is charged first); and the opcodes
  with which a few bytes make CPython's unpickler allocate gigabytes (``LONG_BINPUT
  2**31`` grows its memo to 32 GiB; a byte count past the end of the payload is
  allocated before it is read) are refused by a scan before the unpickler runs. The
  pickle machine itself makes at most :data:`~distkit.dist.codec.safe.VM_BYTES_PER_BYTE`
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
described in :mod:`distkit.dist.codec.safe`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

from distkit import _settings
from distkit.dist.codec.policy import SERIALIZERS, qualified


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
    extra = frozenset(qualified(item) for item in allow)
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
