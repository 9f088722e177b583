"""The wire format of object collectives: tensor-aware pickling.

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
import struct
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, Optional

import torch
from torch import Tensor

from distkit._compat import accelerator_current_index
from distkit.dist import _pickling, serializer
from distkit.dist.serializer import UnsafeObjectError

if TYPE_CHECKING:
    from distkit.dist._comm import Comm

MAGIC = 0x31544B44  # "DKT1"
ALIGN = 64
HEADER_BYTES = 32
# Out-of-band buffers smaller than this stay in the pickle stream: a blob costs a table
# entry and up to 63 bytes of alignment, which is not worth it for tiny arrays.
MIN_OOB_BYTES = 1024

CPU_BLOB, DEV_BLOB, OOB_BLOB = 0, 1, 2

_PARAMETER = torch.nn.Parameter


def _tensor_ref(*args: Any) -> NoReturn:
    """Placeholder global named by encoded tensors; only distkit's decoder resolves it."""
    raise pickle.UnpicklingError(
        "this payload was encoded by distkit with its tensors sent out of band; "
        "decode it with distkit.dist, not plain pickle"
    )


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def flat_bytes(t: Tensor) -> Tensor:
    """A contiguous 1-D uint8 view of ``t``'s data (a copy only if ``t`` is strided)."""
    t = t.detach()
    if t.layout is not torch.strided:  # MKL-DNN: its bytes, as a dense tensor's
        t = t.to_dense()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t.contiguous().reshape(-1).view(torch.uint8)


def bytes_view(t: Tensor) -> memoryview:
    """A writable memoryview of a contiguous uint8 CPU tensor, sharing its memory."""
    n = t.numel()
    if n == 0:
        return memoryview(bytearray())
    array = (ctypes.c_char * n).from_address(t.data_ptr())
    array._owner = t  # type: ignore[attr-defined]  # keep the tensor alive with the view
    return memoryview(array).cast("B")


class _Encoder(pickle.Pickler):
    def __init__(self, file: Any, dev_type: Optional[str]) -> None:
        super().__init__(file, protocol=5, buffer_callback=self._buffer)
        self.dev_type = dev_type  # a device type string: "cuda", or None
        self.blobs: list[Any] = []  # Tensor or memoryview
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
        if (cls is Tensor or cls is _PARAMETER) and _pickling.sendable(obj):
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
        if cls is not Tensor and isinstance(obj, Tensor) and _pickling.is_dtensor(obj):
            # a DTensor travels as this rank's shard, a plain tensor: pickling it whole
            # would pickle its DeviceMesh (process groups cannot travel; torch warns)
            return self.reducer_override(obj.to_local())  # type: ignore[attr-defined]
        return NotImplemented


class Encoded(NamedTuple):
    """An encoded object: the CPU part, and the packed device tensors (or None)."""

    cpu: Tensor
    dev: Optional[Tensor]


def encode(
    obj: Any, name: str, fn: str, comm: Comm, device: Optional[torch.device] = None
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
        raise _pickling.error(obj, name, fn, comm, exc) from None
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
    cpu: Optional[Tensor]
    raw: Any
    if cpu_size <= 65536:
        cpu = None
        raw = bytearray(cpu_size)
    else:
        cpu = torch.empty(cpu_size, dtype=torch.uint8)
        raw = bytes_view(cpu)
    table = [v for pair in zip(sizes, places) for v in pair]
    struct.pack_into(
        f"<{4 + len(table)}q", raw, 0, MAGIC, len(skeleton), len(blobs), dev_size, *table
    )
    raw[table_end : table_end + len(skeleton)] = skeleton
    skeleton.release()
    dev = torch.empty(dev_size, dtype=torch.uint8, device=device) if dev_size else None
    for blob, size, place, offset in zip(blobs, sizes, places, offsets):
        if size == 0:
            continue
        if place == OOB_BLOB:
            raw[offset : offset + size] = blob.cast("B")
        elif place == DEV_BLOB:
            assert dev is not None
            dev[offset : offset + size].copy_(flat_bytes(blob))
        elif blob.device.type == "cpu":
            raw[offset : offset + size] = bytes_view(flat_bytes(blob))
        else:  # an accelerator tensor on a CPU backend: one device-to-host copy
            raw[offset : offset + size] = bytes_view(flat_bytes(blob).cpu())
    if cpu is None:
        cpu = torch.frombuffer(raw, dtype=torch.uint8)
    return Encoded(cpu, dev)


# -- decoding ----------------------------------------------------------------------


class _Refused(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _Decoder(pickle.Unpickler):
    def __init__(self, stream: Any, buffers: list, tensors: Any, safe: bool) -> None:
        super().__init__(stream, buffers=buffers)
        self._tensors = tensors
        self._safe = safe

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_tensor_ref":
            return self._tensors
        if self._safe and not serializer.allowed(module, name):
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


def _target_device(sent_type: str, map_location: Optional[torch.device]) -> Optional[torch.device]:
    if map_location is not None:
        return map_location
    if sent_type == "cpu":
        return None
    module = getattr(torch, sent_type, None)
    if module is not None and getattr(module, "is_available", lambda: False)():
        return torch.device(sent_type, accelerator_current_index(sent_type))
    return None  # this rank has no such device: keep the tensor on the CPU


def _shares(size: int, buffer: int) -> bool:
    """Whether a received part of ``size`` bytes may stay in the ``buffer``-byte receive
    buffer (no copy) rather than get memory of its own.

    A received tensor that stays in the receive buffer keeps all of it alive (and, for
    the first round's slots, the buffer holds other ranks' objects too). So only a part
    that is most of its buffer stays there (zero-copy: at most 2x its size is kept
    alive); smaller parts are copied out. Each received tensor has a storage of its own
    either way, exactly its size: ``torch.save`` writes its bytes and nothing else.
    """
    return 2 * size >= buffer


def decode(
    enc: Encoded,
    map_location: Optional[torch.device] = None,
    serializer_name: str = "pickle",
    sender: int = -1,
    fn: str = "decode",
    comm: Optional[Comm] = None,
) -> Any:
    """Rebuild an object from its encoded parts (tensors are views of ``enc``'s buffers).

    Raises:
        UnsafeObjectError: ``serializer_name="safe"`` and the object needs a global
            outside plain data and the allow-list; nothing of the object has run.
    """
    cpu, dev = enc
    raw = bytes_view(cpu)
    magic, skel_len, n_blobs, _ = struct.unpack_from("<4q", raw, 0)
    if magic != MAGIC:
        raise pickle.UnpicklingError("payload does not start with distkit's header")
    table_end = HEADER_BYTES + 16 * n_blobs
    table = struct.unpack_from(f"<{2 * n_blobs}q", raw, HEADER_BYTES)
    cpu_off = _align(table_end + skel_len)
    dev_off = 0
    spans = []
    oob: list[Any] = []
    cpu_buffer = cpu.untyped_storage().nbytes()  # all the receive buffer holds
    for i in range(n_blobs):
        size, place = table[2 * i], table[2 * i + 1]
        if place == DEV_BLOB:
            spans.append((place, dev_off, size))
            dev_off = _align(dev_off + size)
        else:
            spans.append((place, cpu_off, size))
            if place == OOB_BLOB:
                part = raw[cpu_off : cpu_off + size]
                oob.append(part if _shares(size, cpu_buffer) else bytearray(part))
            cpu_off = _align(cpu_off + size)

    def tensor(
        index: int, dtype: str, shape: tuple, grad: bool, param: bool, dev_type: str
    ) -> Tensor:
        place, offset, size = spans[index]
        dt = getattr(torch, dtype)
        source = dev if place == DEV_BLOB else cpu
        assert source is not None
        if size == 0:
            t = torch.zeros(shape, dtype=dt, device=source.device)
        elif place == DEV_BLOB:
            own = source[offset : offset + size]
            if not _shares(size, source.untyped_storage().nbytes()):
                own = own.clone()
            t = own.view(dt).view(shape)
        elif _shares(size, cpu_buffer):  # most of the buffer: a storage of its own over it
            t = torch.frombuffer(raw[offset : offset + size], dtype=dt).view(shape)
        else:  # a small part: memory of its own, so it never keeps the rest alive
            t = source[offset : offset + size].clone().view(dt).view(shape)
        target = _target_device(dev_type, map_location)
        if target is not None and t.device != target:
            t = t.to(target)
        if param:
            return _PARAMETER(t, requires_grad=grad)
        return t.requires_grad_(True) if grad else t

    stream = io.BytesIO(raw[table_end : table_end + skel_len])
    try:
        return _Decoder(stream, oob, tensor, serializer_name == "safe").load()
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
