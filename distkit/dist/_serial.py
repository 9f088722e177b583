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
import pickle
import threading
from typing import Any, NamedTuple, NoReturn, Optional

import torch
from torch import Tensor

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
        self.dev_type = dev_type
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


def encode(obj: Any, name: str, fn: str, comm: Any, dev_type: Optional[str] = None) -> Encoded:
    """Encode ``obj``; tensors on ``dev_type`` go to the device part, others to the CPU part.

    Raises:
        TypeError: ``obj`` (or a part of it, named by its path) cannot be pickled.
    """
    stream = io.BytesIO()
    encoder = _Encoder(stream, dev_type)
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

    cpu = torch.empty(cpu_size, dtype=torch.uint8)
    meta = [MAGIC, len(skeleton), len(blobs), dev_size]
    for size, place in zip(sizes, places):
        meta += [size, place]
    cpu[:table_end].view(torch.int64).copy_(torch.tensor(meta, dtype=torch.int64))
    view = _bytes_view(cpu)
    view[table_end : table_end + len(skeleton)] = skeleton
    dev = None
    if dev_size:
        dev_device = next(b.device for b, p in zip(blobs, places) if p == DEV_BLOB)
        dev = torch.empty(dev_size, dtype=torch.uint8, device=dev_device)
    for blob, size, place, offset in zip(blobs, sizes, places, offsets):
        if size == 0:
            continue
        if place == OOB_BLOB:
            view[offset : offset + size] = blob.cast("B")
        else:
            target = dev if place == DEV_BLOB else cpu
            target[offset : offset + size].copy_(flat_bytes(blob))  # type: ignore[index]
    return Encoded(cpu, dev)


class _Decoder(pickle.Unpickler):
    def __init__(self, stream: Any, buffers: list, tensors: Any) -> None:
        super().__init__(stream, buffers=buffers)
        self._tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_tensor_ref":
            return self._tensors
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


def decode(enc: Encoded, map_location: Any = None) -> Any:
    """Rebuild an object from its encoded parts (tensors are views of ``enc``'s buffers)."""
    cpu, dev = enc
    magic, skel_len, n_blobs, _ = cpu[:HEADER_BYTES].view(torch.int64).tolist()
    if magic != MAGIC:
        raise pickle.UnpicklingError("payload does not start with distkit's header")
    table_end = HEADER_BYTES + 16 * n_blobs
    table = cpu[HEADER_BYTES:table_end].view(torch.int64).tolist() if n_blobs else []
    raw = _bytes_view(cpu)
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
    return _Decoder(stream, oob, tensor).load()
