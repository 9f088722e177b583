"""Tensor-aware pickling for the object collectives.

An object is split in two. Its *skeleton* (everything but tensor data) is pickled with
protocol 5; each dense tensor in it is replaced by a small reference, and its bytes travel
as a raw blob, never through pickle. Large NumPy arrays and bytearrays leave the pickle
stream the same way (protocol-5 out-of-band buffers).

Wire format of one encoded object (``Encoded.cpu``, a uint8 CPU tensor)::

    int64[4]        MAGIC, skeleton length, number of blobs, bytes of the device part
    int64[n][2]     per blob: byte length, place (0 CPU tensor, 1 device tensor,
                    2 out-of-band pickle buffer)
    skeleton        the pickle stream
    blobs           CPU blobs, each at a 64-byte aligned offset

Device blobs (tensors on the group's accelerator, e.g. CUDA under nccl) are packed the
same way into ``Encoded.dev``, a uint8 tensor on that device, so they move through the
accelerator's own collectives. Decoding makes no copy of tensor data: received tensors
are views of the receive buffer (call ``.clone()`` to detach one from it).
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import struct
import threading
from typing import Any, NamedTuple, NoReturn, Optional

import torch
from torch import Tensor

from distkit import _settings
from distkit._compat import accelerator_current_index
from distkit.dist._checks import fail, flat_bytes

MAGIC = 0x31544B44  # "DKT1"
ALIGN = 64
HEADER_BYTES = 32
# Out-of-band buffers smaller than this stay in the pickle stream: a blob costs a table
# entry and up to 63 bytes of alignment, which is not worth it for tiny arrays.
MIN_OOB_BYTES = 1024

CPU_BLOB, DEV_BLOB, OOB_BLOB = 0, 1, 2

#: Types that pickle by construction: the single-process check skips them.
ATOMS = frozenset([int, float, bool, complex, str, bytes, type(None)])

_PARAMETER = torch.nn.Parameter


def _tensor_ref(*args: Any) -> NoReturn:
    """Placeholder global named by encoded tensors; only distkit's decoder resolves it."""
    raise pickle.UnpicklingError(
        "this payload was encoded by distkit with its tensors sent out of band; "
        "decode it with distkit.dist, not plain pickle"
    )


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _sendable(t: Tensor) -> bool:
    """Dense tensors travel as raw bytes; others (sparse, quantized, meta) pickle."""
    return t.layout is torch.strided and not t.is_quantized and t.device.type != "meta"


class _Encoder(pickle.Pickler):
    def __init__(self, file: Any, dev_type: Optional[str]) -> None:
        super().__init__(file, protocol=5, buffer_callback=self._buffer)
        self.dev_type = dev_type  # a device type string: "cuda", or None
        self.blobs: list[Any] = []  # Tensor or PickleBuffer
        self.places: list[int] = []

    def _buffer(self, buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < MIN_OOB_BYTES:
            return True  # keep it in band
        self.blobs.append(raw)
        self.places.append(OOB_BLOB)
        return False

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if (cls is Tensor or cls is _PARAMETER) and _sendable(obj):
            index = len(self.blobs)
            self.blobs.append(obj)
            place = DEV_BLOB if obj.device.type == self.dev_type else CPU_BLOB
            self.places.append(place)
            meta = (
                index,
                str(obj.dtype).replace("torch.", ""),
                tuple(obj.shape),
                obj.requires_grad,
                cls is _PARAMETER,
                obj.device.type,
            )
            return _tensor_ref, meta
        return NotImplemented


class _Null:
    """A file that forgets what is written: the single-process dry run pickles into it."""

    def write(self, data: Any) -> int:
        return len(data)


class _Checker(pickle.Pickler):
    def __init__(self) -> None:
        super().__init__(_Null(), protocol=5, buffer_callback=lambda buf: False)

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in (Tensor, _PARAMETER) and _sendable(obj):
            return _tensor_ref, ()
        return NotImplemented


class Encoded(NamedTuple):
    """An encoded object: the CPU part, and the packed device tensors (or None)."""

    cpu: Tensor
    dev: Optional[Tensor]


def _children(obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        out = []
        for k, v in obj.items():
            out.append((f"[{k!r}] (key)", k))
            out.append((f"[{k!r}]", v))
        return out
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        return [(f" element {v!r}", v) for v in obj]
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        return [(f".{k}", v) for k, v in attrs.items()]
    return []


def _picklable(obj: Any) -> bool:
    try:
        _Checker().dump(obj)
    except Exception:
        return False
    return True


def _locate(obj: Any, path: str, depth: int = 0) -> tuple[str, Any]:
    """Path to the innermost part of ``obj`` that cannot be pickled."""
    if depth < 50:
        for sub, child in _children(obj):
            if not _picklable(child):
                return _locate(child, path + sub, depth + 1)
    return path, obj


def _pickle_error(obj: Any, name: str, fn: str, comm: Any, exc: Exception) -> NoReturn:
    path, culprit = _locate(obj, name)
    kind = type(culprit).__name__
    fail(
        TypeError,
        fn,
        comm,
        f"{path} ({kind}) cannot be pickled: {exc}",
        "Object collectives send objects with pickle: use module-level functions "
        "and classes, and plain data instead of locks, files or generators",
    )


_local = threading.local()
_CONTAINERS = (dict, list, tuple)
_PLAIN_BUDGET = 64  # nodes the quick walk visits before handing over to the pickler


def flat(obj: dict) -> bool:
    """Whether a dict holds only atoms, keys and values: the metrics dict of a training step.

    The single-process fast path of ``all_gather_object`` uses this rather than
    :func:`_plain`, which accepts the same dicts but costs about 1.5x as much on two items.
    """
    for key, value in obj.items():
        if type(key) not in ATOMS or type(value) not in ATOMS:
            return False
    return True


def _plain(obj: Any) -> bool:
    """Whether ``obj`` is small and built only of builtin containers, atoms and tensors."""
    budget = _PLAIN_BUDGET
    pending: list = []
    node = obj
    while True:
        if type(node) is dict:
            for key in node:
                if type(key) not in ATOMS:
                    return False
            values = node.values()
        else:
            values = node
        budget -= len(node)
        if budget < 0:
            return False
        for value in values:
            kind = type(value)
            if kind not in ATOMS and kind is not Tensor:
                if kind not in _CONTAINERS:
                    return False
                pending.append(value)
        if not pending:
            return True
        node = pending.pop()


def check(obj: Any, name: str, fn: str, comm: Any) -> None:
    """Raise the encoder's error if ``obj`` could not be sent; send nothing.

    Small objects made of builtin containers, atoms and dense tensors pass a quick walk;
    anything else is pickled into a null sink (tensor data skipped), which finds exactly
    what the encoder would fail on.
    """
    if type(obj) in ATOMS or (type(obj) in _CONTAINERS and _plain(obj)):
        return
    checker = getattr(_local, "checker", None)
    if checker is None:
        checker = _local.checker = _Checker()
    try:
        checker.dump(obj)
    except Exception as exc:
        _local.checker = None  # a failed dump can leave the pickler in any state
        _pickle_error(obj, name, fn, comm, exc)
    finally:
        if getattr(_local, "checker", None) is not None:
            checker.clear_memo()


def _bytes_view(t: Tensor) -> memoryview:
    """A writable memoryview of a contiguous uint8 CPU tensor, sharing its memory."""
    n = t.numel()
    if n == 0:
        return memoryview(bytearray())
    array = (ctypes.c_char * n).from_address(t.data_ptr())
    array._owner = t  # type: ignore[attr-defined]  # keep the tensor alive with the view
    return memoryview(array).cast("B")


def encode(
    obj: Any, name: str, fn: str, comm: Any, device: Optional[torch.device] = None
) -> Encoded:
    """Encode ``obj``; tensors on ``device``'s type go to the device part, others to the CPU.

    Raises:
        TypeError: ``obj`` (or a part of it, named by its path) cannot be pickled.
    """
    stream = io.BytesIO()
    encoder = _Encoder(stream, device.type if device is not None else None)
    try:
        encoder.dump(obj)
    except Exception as exc:
        _pickle_error(obj, name, fn, comm, exc)
    skeleton = stream.getbuffer()
    blobs, places = encoder.blobs, encoder.places
    sizes = [b.nbytes if isinstance(b, memoryview) else b.numel() * b.element_size() for b in blobs]

    table_end = HEADER_BYTES + 16 * len(blobs)
    cpu_size = _align(table_end + len(skeleton))
    dev_size = 0
    offsets = []
    for size, place in zip(sizes, places):
        if place == DEV_BLOB:
            offsets.append(dev_size)
            dev_size = _align(dev_size + size)
        else:
            offsets.append(cpu_size)
            cpu_size = _align(cpu_size + size)

    # Assemble the CPU part through a memoryview: struct and slice copies cost far less
    # than small torch ops (which matters for one-round small objects). Small parts live
    # in a bytearray; large ones in uninitialized tensor memory (no zero-fill pass).
    if cpu_size <= 65536:
        cpu = None
        raw: Any = bytearray(cpu_size)
    else:
        cpu = torch.empty(cpu_size, dtype=torch.uint8)
        raw = _bytes_view(cpu)
    table = [v for pair in zip(sizes, places) for v in pair]
    struct.pack_into(f"<{4 + len(table)}q", raw, 0, MAGIC, len(skeleton), len(blobs), dev_size,
                     *table)
    raw[table_end : table_end + len(skeleton)] = skeleton
    skeleton.release()
    dev = torch.empty(dev_size, dtype=torch.uint8, device=device) if dev_size else None
    for blob, size, place, offset in zip(blobs, sizes, places, offsets):
        if size == 0:
            continue
        if place == OOB_BLOB:
            raw[offset : offset + size] = blob.cast("B")
        elif place == DEV_BLOB:
            dev[offset : offset + size].copy_(flat_bytes(blob))  # type: ignore[index]
        elif blob.device.type == "cpu":
            raw[offset : offset + size] = _bytes_view(flat_bytes(blob))
        else:  # an accelerator tensor on a CPU backend: one device-to-host copy
            raw[offset : offset + size] = _bytes_view(flat_bytes(blob).cpu())
    if cpu is None:
        cpu = torch.frombuffer(raw, dtype=torch.uint8)
    return Encoded(cpu, dev)


# -- decoding ----------------------------------------------------------------------

SERIALIZERS = ("pickle", "safe")
# False when DISTKIT_SERIALIZER holds a bad value: then even the single-process fast paths
# go through resolve_serializer, which raises the same error as with many ranks
ENV_OK = _settings._DEFAULTS["serializer"] in SERIALIZERS

#: Globals the safe serializer loads: plain data only. Nothing here runs code of the
#: sender's choosing when called with the arguments a pickle can give it.
SAFE_GLOBALS = frozenset(
    [("builtins", n) for n in (
        "bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int",
        "list", "range", "set", "slice", "str", "tuple",
    )]
    + [("collections", n) for n in ("Counter", "OrderedDict", "defaultdict", "deque")]
    + [("datetime", n) for n in ("date", "datetime", "time", "timedelta", "timezone")]
    + [("decimal", "Decimal"), ("fractions", "Fraction")]
    + [("torch", "Size"), ("torch", "device")]
    + [(m, n) for m in ("numpy", "numpy.core.multiarray", "numpy._core.multiarray",
                        "numpy.core.numeric", "numpy._core.numeric")
       for n in ("dtype", "ndarray", "scalar", "_reconstruct", "_frombuffer")]
)


class UnsafeObjectError(pickle.UnpicklingError):
    """The safe serializer refused a global that another rank's object needs.

    Attributes:
        rank: The rank that sent the object.
        global_name: ``module.name`` of the refused global.
    """

    def __init__(self, message: str, rank: int = -1, global_name: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.global_name = global_name


class _Refused(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _qualified(item: Any) -> tuple[str, str]:
    if isinstance(item, str):
        module, _, name = item.rpartition(".")
        if not module:
            raise ValueError(f"allow: give 'module.Name' strings or classes, got {item!r}")
        return module, name
    if isinstance(item, type) or callable(item):
        return item.__module__, item.__qualname__
    raise TypeError(f"allow: give classes or 'module.Name' strings, got {type(item).__name__}")


def set_serializer(serializer: str = "pickle", allow: Any = ()) -> None:
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
        raise ValueError(f"set_serializer: serializer must be 'pickle' or 'safe', got {serializer!r}")
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
    return _settings.get("serializer")


def resolve_serializer(serializer: Any, fn: str, comm: Any) -> str:
    """The serializer a call uses: its own argument, else the process-wide setting."""
    if serializer is None:
        serializer = _settings.get("serializer")
    if serializer not in SERIALIZERS:
        fail(ValueError, fn, comm, f"serializer must be 'pickle' or 'safe', got {serializer!r}",
             "Set DISTKIT_SERIALIZER to pickle or safe, or pass serializer=")
    return serializer


class _Decoder(pickle.Unpickler):
    def __init__(self, stream: Any, buffers: list, tensors: Any, safe: bool) -> None:
        super().__init__(stream, buffers=buffers)
        self._tensors = tensors
        self._safe = safe

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_tensor_ref":
            return self._tensors
        if self._safe and (module, name) not in SAFE_GLOBALS:
            is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
            if not is_dtype and (module, name) not in _settings.get("safe_allow"):
                raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


def _target_device(sent_type: str, map_location: Any) -> Optional[torch.device]:
    if map_location is not None:
        return torch.device(map_location)
    if sent_type == "cpu":
        return None
    module = getattr(torch, sent_type, None)
    if module is not None and getattr(module, "is_available", lambda: False)():
        return torch.device(sent_type, accelerator_current_index(sent_type))
    return None  # this rank has no such device: keep the tensor on the CPU


def decode(enc: Encoded, map_location: Any = None, serializer: str = "pickle",
           sender: int = -1, fn: str = "decode", comm: Any = None) -> Any:
    """Rebuild an object from its encoded parts (tensors are views of ``enc``'s buffers).

    Raises:
        UnsafeObjectError: ``serializer="safe"`` and the object needs a global outside
            plain data and the allow-list; nothing of the object has run.
    """
    cpu, dev = enc
    raw = _bytes_view(cpu)
    magic, skel_len, n_blobs, _ = struct.unpack_from("<4q", raw, 0)
    if magic != MAGIC:
        raise pickle.UnpicklingError("payload does not start with distkit's header")
    table_end = HEADER_BYTES + 16 * n_blobs
    table = struct.unpack_from(f"<{2 * n_blobs}q", raw, HEADER_BYTES)
    cpu_off = _align(table_end + skel_len)
    dev_off = 0
    spans = []
    oob = []
    for i in range(n_blobs):
        size, place = table[2 * i], table[2 * i + 1]
        if place == DEV_BLOB:
            spans.append((place, dev_off, size))
            dev_off = _align(dev_off + size)
        else:
            spans.append((place, cpu_off, size))
            if place == OOB_BLOB:
                oob.append(raw[cpu_off : cpu_off + size])
            cpu_off = _align(cpu_off + size)

    def tensor(index: int, dtype: str, shape: tuple, grad: bool, param: bool, dev_type: str):
        place, offset, size = spans[index]
        dt = getattr(torch, dtype)
        source = dev if place == DEV_BLOB else cpu
        if size == 0:
            t = torch.empty(shape, dtype=dt, device=source.device)  # type: ignore[union-attr]
        else:
            t = source[offset : offset + size].view(dt).view(shape)  # type: ignore[index]
        target = _target_device(dev_type, map_location)
        if target is not None and t.device != target:
            t = t.to(target)
        if param:
            return _PARAMETER(t, requires_grad=grad)
        return t.requires_grad_(True) if grad else t

    stream = io.BytesIO(raw[table_end : table_end + skel_len])
    try:
        return _Decoder(stream, oob, tensor, serializer == "safe").load()
    except _Refused as refused:
        where = f" (on rank {comm.rank} of {comm.size})" if comm is not None else ""
        raise UnsafeObjectError(
            f"{fn}: rank {sender} sent an object that needs {refused.name}, which the safe "
            f"serializer refuses{where}. Nothing of it was run. If rank {sender} is trusted "
            f"and {refused.name} is a plain data class, allow it on every rank: "
            f"dist.set_serializer('safe', allow=['{refused.name}'])",
            sender,
            refused.name,
        ) from None
