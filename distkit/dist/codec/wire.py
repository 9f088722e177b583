"""The wire format of object collectives: tensor-aware pickling.

An object is split in two. Its *skeleton* (everything but tensor data) is pickled with
protocol 5; each dense tensor in it is replaced by a small reference, and its bytes travel
as a raw blob, never through pickle. Large NumPy arrays and bytearrays leave the pickle
stream the same way (protocol-5 out-of-band buffers).

Wire format of one encoded object (``Encoded.cpu``, a uint8 CPU tensor)::

    int64[4]        MAGIC, skeleton length, number of blobs, bytes of the device part
    int64[n][2]     per blob: byte length, place (0 CPU tensor, 1 device tensor,
                    2 out-of-band pickle buffer, 3 CPU tensor sent apart)
    skeleton        the pickle stream
    blobs           CPU blobs, each at a 64-byte aligned offset

Device blobs (tensors on the group's accelerator, e.g. CUDA under nccl) are packed the
same way into ``Encoded.dev``, a uint8 tensor on that device, so they move through the
accelerator's own collectives. Decoding makes no copy of tensor data: received tensors
are views of the receive buffer (call ``.clone()`` to detach one from it).

Point-to-point sends (:mod:`distkit.dist.backends.p2p`) leave large CPU tensors out of
the CPU part (place 3): each travels as a message of its own, straight from the sender's
tensor into memory the receiver allocated for it alone (``Encoded.apart``, in table
order), so the receiver holds each tensor's bytes once.

NumPy arrays, scalars and dtypes of plain data pickle as calls to distkit's own checked
constructors (:func:`distkit.dist.codec.builders.numpy_array` and friends), never to NumPy's own
``_reconstruct``/``scalar``/``dtype`` globals, so the safe serializer never loads those.

Decoding checks the header and the blob table against the bytes received, and each tensor
reference against its blob, with either serializer: a malformed payload raises
``pickle.UnpicklingError`` naming the sender (``UnsafeObjectError`` under ``safe``).
"""

from __future__ import annotations

import ctypes
import gc
import io
import pickle
import struct
import sys
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, NoReturn, Optional

import torch
from torch import Tensor

from distkit import _settings
from distkit._compat import accelerator_current_index
from distkit.dist.codec import builders, policy
from distkit.dist.codec import pickling as _pickling
from distkit.dist.codec import safe as _safe
from distkit.dist.codec.policy import Refused
from distkit.dist.core import layouts
from distkit.dist.errors import UnsafeObjectError

if TYPE_CHECKING:
    from distkit.dist.core.comm import Comm

MAGIC, HEADER_BYTES = layouts.MAGIC, layouts.HEADER_BYTES  # the header's layout
ENTRY_BYTES = layouts.BLOB.size  # a blob's table entry
ALIGN = 64
# Out-of-band buffers smaller than this stay in the pickle stream: a blob costs a table
# entry and up to 63 bytes of alignment, which is not worth it for tiny arrays.
MIN_OOB_BYTES = 1024

CPU_BLOB, DEV_BLOB, OOB_BLOB, APART_BLOB = 0, 1, 2, 3
#: Point to point: tensors stay in the CPU part while together they are at most this many
#: bytes or a sixteenth of all tensor bytes, smallest first (see :func:`_apart`)
APART_INLINE = 1 << 20

_PARAMETER = torch.nn.Parameter


def _with_attributes(meta: tuple, t: Tensor) -> tuple:
    """The reduction of tensor ``t`` (its reference ``meta``), with its own Python
    attributes (``t.note = ...``, a parameter's flags), as torch's pickling keeps them.

    They travel as the reduction's state, set by a state setter once the tensor is in
    the pickle's memo, so attributes that lead back to the tensor (``t.me = t``) are a
    reference to it, not a second copy or an endless recursion.
    """
    attrs = t.__dict__
    if not attrs:
        return _tensor_ref, meta
    return _tensor_ref, meta, dict(attrs), None, None, builders.tensor_attributes


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
    return uint8_view(t.contiguous())


def uint8_view(t: Tensor) -> Tensor:
    """The bytes of a contiguous tensor, as a 1-D uint8 view.

    torch calls a tensor of at most one element contiguous whatever its stride (``x[:, 0]``
    of a batch of 1, ``torch.tensor(5.).expand(1)``), and ``view(torch.uint8)`` refuses a
    stride other than 1: such a tensor is viewed with stride 1 first (it has at most one
    element to read)."""
    flat = t.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8)


def owned_bytes(raw: Any) -> Tensor:
    """A copy of ``raw`` (bytes, a bytearray or a memoryview) in a 1-D uint8 CPU tensor
    whose memory torch owns: what distkit hands a process group.

    Not ``torch.frombuffer``: that tensor keeps a Python object alive, and freeing it takes
    the GIL. A gloo worker thread drops its reference to a work's tensors after the work
    completed, so it can be the one that frees them; as the interpreter exits, that thread
    is ended inside a destructor and the process aborts ("terminate called without an
    active exception", after a run that succeeded), and before torch 2.8 a group destroyed
    meanwhile waits for it forever (pytorch#75097).
    """
    n = memoryview(raw).nbytes
    t = torch.empty(n, dtype=torch.uint8, device="cpu")
    if n:
        bytes_view(t)[:] = memoryview(raw).cast("B")
    return t


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
        if cls in _REDUCERS:
            reducer = _REDUCERS[cls]
        else:
            reducer = _REDUCERS[cls] = _reducer(cls)
        if reducer is not None:
            return reducer(obj)
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
            return _with_attributes(meta, obj)
        if cls is not Tensor and isinstance(obj, Tensor) and _pickling.is_dtensor(obj):
            # a DTensor travels as this rank's shard, a plain tensor: pickling it whole
            # would pickle its DeviceMesh (process groups cannot travel; torch warns)
            return self.reducer_override(obj.to_local())  # type: ignore[attr-defined]
        return NotImplemented


def _plain_dtype(dtype: Any) -> bool:
    """A NumPy dtype of plain data (see :data:`distkit.dist.codec.builders.NUMPY_KINDS`)."""
    return (
        dtype.kind in builders.NUMPY_KINDS
        and dtype.fields is None
        and dtype.subdtype is None
        and not dtype.hasobject
        and dtype.itemsize > 0
        and dtype.metadata is None
    )


def _reduce_array(array: Any) -> Any:
    if not _plain_dtype(array.dtype):
        return NotImplemented  # NumPy's own reduction: the safe serializer refuses it
    import numpy as np

    order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        array = np.ascontiguousarray(array)
    # A PickleBuffer travels out of band when large, in band (bytearray) when small,
    # read-only if the array is: what NumPy's own protocol-5 reduction does. Datetimes
    # export no buffer: their bytes travel as the int64s they are.
    buffer = pickle.PickleBuffer(array.view(np.int64) if array.dtype.kind in "mM" else array)
    return builders.numpy_array, (array.dtype.str, array.shape, order, buffer)


def _reduce_scalar(scalar: Any) -> Any:
    if not _plain_dtype(scalar.dtype):
        return NotImplemented
    return builders.numpy_scalar, (scalar.dtype.str, scalar.tobytes())


def _reduce_dtype(dtype: Any) -> Any:
    if not _plain_dtype(dtype):
        return NotImplemented
    return builders.numpy_dtype, (dtype.str,)


#: The reducer of each class the encoder met (``None``: the default pickling).
_REDUCERS: dict[type, Optional[Callable[[Any], Any]]] = {}


def _reducer(cls: type) -> Optional[Callable[[Any], Any]]:
    np = sys.modules.get("numpy")  # an object of NumPy's means NumPy is imported
    if np is None or not cls.__module__.startswith("numpy"):
        return None
    if cls is np.ndarray:  # subclasses (matrix, masked, memmap) keep NumPy's pickling
        return _reduce_array
    if issubclass(cls, np.generic):
        return _reduce_scalar
    if issubclass(cls, np.dtype):
        return _reduce_dtype
    return None


class Encoded(NamedTuple):
    """An encoded object: the CPU part, the packed device tensors (or None), and the CPU
    tensors sent apart (flat uint8 tensors, in table order)."""

    cpu: Tensor
    dev: Optional[Tensor]
    apart: tuple[Tensor, ...] = ()


def _apart(sizes: list[int], places: list[int]) -> set[int]:
    """Which CPU tensor blobs travel apart: the largest, until the rest (smallest first)
    is at most :data:`APART_INLINE` bytes or a sixteenth of every tensor's bytes, so a
    receiver never holds more than that twice (once received, once copied out)."""
    tensors = sorted(
        (size, i) for i, (size, place) in enumerate(zip(sizes, places)) if place == CPU_BLOB
    )
    budget = max(APART_INLINE, sum(size for size, _ in tensors) // 16)
    inline = 0
    for k, (size, _) in enumerate(tensors):
        inline += size
        if inline > budget:
            return {i for _, i in tensors[k:]}
    return set()


def encode(
    obj: Any,
    name: _pickling.Naming,
    fn: str,
    comm: Comm,
    device: Optional[torch.device] = None,
    apart: bool = False,
) -> Encoded:
    """Encode ``obj``; tensors on ``device``'s type go to the device part, others to the CPU.

    With ``apart``, the largest CPU tensors are left out of the CPU part (see
    :func:`_apart`): ``Encoded.apart`` holds their bytes (views of the tensors when they
    are contiguous CPU tensors, no copy).

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
    if apart:
        for i in _apart(sizes, places):
            places[i] = APART_BLOB

    table_end = HEADER_BYTES + ENTRY_BYTES * len(blobs)
    cpu_size = _align(table_end + len(skeleton))
    dev_size = 0
    offsets = []
    for size, place in zip(sizes, places):
        if place == DEV_BLOB:
            offsets.append(dev_size)
            dev_size = _align(dev_size + size)
        elif place == APART_BLOB:
            offsets.append(0)
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
        cpu = torch.empty(cpu_size, dtype=torch.uint8, device="cpu")
        raw = bytes_view(cpu)
    table = [v for pair in zip(sizes, places) for v in pair]
    layouts.WIRE_HEADER.pack_into(raw, 0, MAGIC, len(skeleton), len(blobs), dev_size)
    struct.pack_into(f"<{len(table)}q", raw, HEADER_BYTES, *table)  # BLOB entries
    raw[table_end : table_end + len(skeleton)] = skeleton
    skeleton.release()
    dev = torch.empty(dev_size, dtype=torch.uint8, device=device) if dev_size else None
    sent_apart = []
    for blob, size, place, offset in zip(blobs, sizes, places, offsets):
        if place == APART_BLOB:
            sent_apart.append(flat_bytes(blob).cpu())
            continue
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
        cpu = owned_bytes(raw)
    return Encoded(cpu, dev, tuple(sent_apart))


def apart_sizes(cpu: Tensor) -> tuple[list[int], int]:
    """The byte sizes of the tensors an encoded object's CPU part says were sent apart
    (in order), and of its device part: what a receiver allocates before the bytes come.

    Raises:
        pickle.UnpicklingError: the CPU part is malformed (its header or table).
    """
    raw = bytes_view(cpu)
    if len(raw) < HEADER_BYTES:
        raise pickle.UnpicklingError(f"{len(raw)} bytes, shorter than distkit's header")
    magic, _, n_blobs, dev_bytes = layouts.WIRE_HEADER.unpack_from(raw, 0)
    if magic != MAGIC or not 0 <= n_blobs <= (len(raw) - HEADER_BYTES) // ENTRY_BYTES:
        raise pickle.UnpicklingError("the payload does not start with distkit's header")
    table = struct.unpack_from(f"<{2 * n_blobs}q", raw, HEADER_BYTES)
    sizes = [table[2 * i] for i in range(n_blobs) if table[2 * i + 1] == APART_BLOB]
    if dev_bytes < 0 or any(size < 0 for size in sizes):
        raise pickle.UnpicklingError("the payload's table holds a negative size")
    return sizes, dev_bytes


# -- decoding ----------------------------------------------------------------------


class _Parts(NamedTuple):
    """A received payload, its header checked against the bytes received."""

    skeleton: bytes
    spans: list  # per blob: (place, offset, size), within the part that holds it
    buffers: list  # the out-of-band buffers: views of the receive buffer, or copies
    received: int  # bytes received, CPU and device parts together
    raw: memoryview  # the CPU part
    copied: int  # bytes of out-of-band buffers copied out of the receive buffer


def _parse(enc: Encoded) -> _Parts:
    cpu, dev, apart = enc
    raw = bytes_view(cpu)
    total, dev_total = len(raw), (dev.numel() if dev is not None else 0)
    apart_total, k = sum(a.numel() for a in apart), 0
    if total < HEADER_BYTES:
        raise Refused(f"{total} bytes, shorter than distkit's {HEADER_BYTES}-byte header")
    magic, skel_len, n_blobs, dev_bytes = layouts.WIRE_HEADER.unpack_from(raw, 0)
    if magic != MAGIC:
        raise Refused("the payload does not start with distkit's header")
    if not 0 <= n_blobs <= (total - HEADER_BYTES) // ENTRY_BYTES:
        raise Refused(f"a table of {n_blobs} blobs does not fit in {total} bytes")
    table_end = HEADER_BYTES + ENTRY_BYTES * n_blobs
    if not 0 <= skel_len <= total - table_end:
        raise Refused(f"a skeleton of {skel_len} bytes does not fit in {total} bytes")
    if dev_bytes != dev_total:
        raise Refused(f"the header claims a device part of {dev_bytes} bytes, got {dev_total}")
    table = struct.unpack_from(f"<{2 * n_blobs}q", raw, HEADER_BYTES)
    cpu_off, dev_off = _align(table_end + skel_len), 0
    spans: list = []
    buffers: list[Any] = []
    cpu_buffer, copied = cpu.untyped_storage().nbytes(), 0  # all the receive buffer holds
    for i in range(n_blobs):
        size, place = table[2 * i], table[2 * i + 1]
        if place == APART_BLOB:  # its own message: the k-th of Encoded.apart, whole
            if k >= len(apart) or apart[k].numel() != size:
                raise Refused(f"blob {i} ({size} bytes, sent apart) was not received whole")
            spans.append((place, k, size))
            k += 1
            continue
        offset, limit = (dev_off, dev_total) if place == DEV_BLOB else (cpu_off, total)
        if place not in (CPU_BLOB, DEV_BLOB, OOB_BLOB) or not 0 <= size <= limit - offset:
            raise Refused(f"blob {i} (place {place}, {size} bytes) does not fit in the payload")
        spans.append((place, offset, size))
        if place == DEV_BLOB:
            dev_off = _align(dev_off + size)
        else:
            if place == OOB_BLOB:
                part = raw[offset : offset + size]
                if _shares(size, cpu_buffer):
                    buffers.append(part)
                else:
                    buffers.append(bytearray(part))
                    copied += size
            cpu_off = _align(cpu_off + size)
    if k != len(apart):
        raise Refused(f"{len(apart)} tensors were received apart, the table names {k}")
    skeleton = bytes(raw[table_end : table_end + skel_len])
    return _Parts(skeleton, spans, buffers, total + dev_total + apart_total, raw, copied)


#: Tensor dtypes a reference may name: torch's, by name, but for the quantized ones
#: (their bytes mean nothing without scales).
_QUANTIZED = frozenset(["qint8", "quint8", "qint32", "quint4x2", "quint2x4"])
_TENSOR_DTYPES: dict[str, tuple[torch.dtype, int, bool]] = {}


def _tensor_dtype(name: Any) -> Optional[tuple[torch.dtype, int, bool]]:
    """``(dtype, itemsize, can require grad)`` of a tensor dtype's name, or ``None``."""
    if not _TENSOR_DTYPES:
        for n, dt in policy.torch_dtypes().items():
            if n not in _QUANTIZED:
                _TENSOR_DTYPES[n] = (dt, dt.itemsize, dt.is_floating_point or dt.is_complex)
    return _TENSOR_DTYPES.get(name) if type(name) is str else None


class _Ref(NamedTuple):
    blob: int
    dtype: torch.dtype
    shape: tuple
    grad: bool
    param: bool
    dev_type: str


class _Blobs(_safe.Tensors):
    """The tensor blobs of one payload, handed out through checked tensor references."""

    def __init__(self, enc: Encoded, parts: _Parts, map_location: Any, safe: bool) -> None:
        self.cpu, self.dev, self.apart = enc
        self.raw = parts.raw
        self.cpu_buffer = self.cpu.untyped_storage().nbytes()
        self.spans = parts.spans
        self.map_location = map_location
        self.safe = safe
        self.used: set[int] = set()
        self.targets: dict[str, Optional[torch.device]] = {}

    def check(self, args: tuple) -> _Ref:
        if len(args) != 6:
            raise Refused(f"a tensor reference takes 6 arguments, got {len(args)}")
        index, name, shape, grad, param, dev_type = args
        if type(index) is not int or not 0 <= index < len(self.spans) or index in self.used:
            raise Refused(f"a tensor reference to blob {index!r} of {len(self.spans)}, or twice")
        place, _, size = self.spans[index]
        if place == OOB_BLOB:
            raise Refused(f"a tensor reference to blob {index}, an out-of-band buffer")
        kind = _tensor_dtype(name)
        if kind is None:
            raise Refused(f"a tensor reference names {name!r}, which is not a tensor dtype")
        dtype, itemsize, can_grad = kind
        if type(shape) is not tuple or len(shape) > builders.MAX_DIMS:
            raise Refused(f"a tensor shape is a tuple of sizes, got {shape!r}")
        numel = span = 1
        for d in shape:
            if type(d) is not int or d < 0:
                raise Refused(f"a tensor shape is a tuple of sizes, got {shape!r}")
            numel *= d
            span *= max(d, 1)
        if span >= 1 << 62:  # an empty tensor whose strides would overflow
            raise Refused(f"a tensor shape of more than 2**62 places, got {shape!r}")
        if numel * itemsize != size:
            raise Refused(f"a {name} tensor of shape {shape} in blob {index} of {size} bytes")
        if type(grad) is not bool or type(param) is not bool or (grad and not can_grad):
            raise Refused(f"a {name} tensor's requires_grad ({grad!r}) or parameter flag")
        if dev_type != "cpu" and not builders.device_type(dev_type):
            raise Refused(f"a tensor reference names {dev_type!r}, which is not a device type")
        self.used.add(index)
        return _Ref(index, dtype, shape, grad, param, dev_type)

    def build(self, key: _Ref, budget: Optional[_safe.Budget]) -> Tensor:
        index, dtype, shape, grad, param, dev_type = key
        place, offset, size = self.spans[index]
        source = self.dev if place == DEV_BLOB else self.cpu
        if place == APART_BLOB:  # memory of its own, received for this tensor alone
            t = self.apart[offset]
            t = t.view(dtype).view(shape) if size else torch.zeros(shape, dtype=dtype, device="cpu")
        elif size == 0 or source is None:  # no bytes, and so no element: zeros all the same
            device = source.device if source is not None else None
            t = torch.zeros(shape, dtype=dtype, device=device)
        else:
            buffer = self.cpu_buffer if place != DEV_BLOB else source.untyped_storage().nbytes()
            if _shares(size, buffer):  # most of the buffer: stays there, uncopied
                if place == DEV_BLOB:
                    t = source[offset : offset + size].view(dtype).view(shape)
                else:  # a storage of its own over the receive buffer
                    t = torch.frombuffer(self.raw[offset : offset + size], dtype=dtype)
                    t = t.view(shape)
            else:  # a small part: memory of its own, so it never keeps the rest alive
                if budget is not None:
                    budget.charge(size, f"copying tensor {index} out of the receive buffer")
                t = source[offset : offset + size].clone().view(dtype).view(shape)
        if self.safe and dtype is torch.bool and size and int(t.view(torch.uint8).max()) > 1:
            raise Refused(f"the bool tensor in blob {index} holds a byte that is not 0 or 1")
        if dev_type not in self.targets:
            self.targets[dev_type] = _target_device(dev_type, self.map_location)
        target = self.targets[dev_type]
        if target is not None and t.device != target:
            if budget is not None:
                budget.charge(size, f"moving tensor {index} to {target}")
            t = t.to(target)
        if param:
            return _PARAMETER(t, requires_grad=grad)
        return t.requires_grad_(True) if grad else t

    def reference(self, *args: Any) -> Tensor:
        """The ``_tensor_ref`` global of the ``pickle`` serializer: check, then build."""
        return self.build(self.check(args), None)


class _Decoder(pickle.Unpickler):
    """The ``pickle`` serializer: any global, tensor references resolved to blobs."""

    def __init__(self, stream: Any, buffers: list, tensors: Any) -> None:
        super().__init__(stream, buffers=buffers)
        self._tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_tensor_ref":
            return self._tensors
        if module == "distkit.dist.codec.builders" and name in builders.BUILDERS:
            return builders.BUILDERS[name]  # pickle trusts its peers: no checks to repeat
        try:
            return super().find_class(module, name)
        except Exception as exc:  # said with the sender by _rebuild
            # missing here (ImportError, AttributeError), or its import fails on this rank
            raise _Unloadable(module, name, exc) from exc


class _Unloadable(Exception):
    """A class or function the sender has and this rank cannot import: its module or
    the name is missing here, or importing the module raises here."""

    def __init__(self, module: str, name: str, error: Exception) -> None:
        super().__init__(module, name, error)
        self.module, self.name, self.error = module, name, error

    def reraise(self, fn: str, sender: int, where: str) -> NoReturn:
        """Raise :attr:`error`'s class (RuntimeError where that class takes other
        arguments), saying who sent what and what to do."""
        if self.module == "__main__":
            fix = (
                "Define it at the top level of a module every rank imports (or of the "
                "script, run by every rank)"
            )
        elif isinstance(self.error, ImportError):
            fix = f"Make {self.module} importable on every rank (the same code everywhere)"
        elif isinstance(self.error, AttributeError):
            fix = f"Run the same version of {self.module} on every rank"
        else:
            fix = f"Importing {self.module} fails on this rank: make it import on every rank"
        head = (
            f"{fn}: rank {sender} sent an object that needs {self.module}.{self.name}, which "
            f"this rank cannot import{where}: "
        )
        tail = f"{self.error}. {fix}"
        try:  # the class the import raised, as a caller would catch it
            error = type(self.error)(head + tail)
        except Exception:  # a class built from other arguments (UnicodeDecodeError, ...)
            error = RuntimeError(f"{head}{type(self.error).__name__}: {tail}")
        raise error from self.error


def _target_device(sent_type: str, map_location: Optional[torch.device]) -> Optional[torch.device]:
    if map_location is not None:
        return map_location
    if sent_type == "cpu":
        return None
    # sent_type is a device type torch parsed (never "_dynamo": no lazy import here)
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
    max_bytes: Optional[int] = None,
) -> Any:
    """Rebuild an object from its encoded parts (see :func:`_rebuild`), with Python's
    cyclic garbage collector paused.

    Unpickling builds one container after another, and CPython starts a collection every
    few hundred of them, each walking the young objects (and now and then all of them):
    pausing it made unpickling 20k small dicts 1.3x to 1.6x faster on this project's
    machine (12-15 ms against 9 ms). What unpickling builds is the result, not garbage;
    a cycle that some reduce function drops meanwhile is collected afterwards, as usual.
    A collector that was already disabled stays so.
    """
    collecting = gc.isenabled()
    if collecting:
        gc.disable()
    try:
        return _rebuild(enc, map_location, serializer_name, sender, fn, comm, max_bytes)
    finally:
        if collecting:
            gc.enable()


def _rebuild(
    enc: Encoded,
    map_location: Optional[torch.device] = None,
    serializer_name: str = "pickle",
    sender: int = -1,
    fn: str = "decode",
    comm: Optional[Comm] = None,
    max_bytes: Optional[int] = None,
) -> Any:
    """Rebuild an object from its encoded parts (tensors are views of ``enc``'s buffers).

    Args:
        enc: The parts received.
        map_location: Where received tensors go (``None``: their own device type).
        serializer_name: ``pickle`` or ``safe`` (see :mod:`distkit.dist.codec.safe`).
        sender: The sending rank, for messages.
        fn: The collective, for messages.
        comm: This rank's group, for messages.
        max_bytes: Under ``safe``, the most the decoded object may allocate; ``None``:
            the process's setting (:func:`~distkit.dist.set_serializer`), else
            ``_safe.EXPANSION`` times the bytes received.

    Raises:
        UnsafeObjectError: ``serializer_name="safe"`` and the object needs a global
            outside plain data and the allow-list, or anything else that plain data
            never does; nothing of it was built.
        pickle.UnpicklingError: the payload is malformed (``pickle`` serializer).
    """
    safe = serializer_name == "safe"
    where = f" (on rank {comm.rank} of {comm.size})" if comm is not None else ""
    try:
        parts = _parse(enc)
        blobs = _Blobs(enc, parts, map_location, safe)
        if not safe:
            stream = io.BytesIO(parts.skeleton)
            return _Decoder(stream, parts.buffers, blobs.reference).load()
        if max_bytes is None:
            max_bytes = _settings.get("safe_max_bytes")
        if max_bytes is None:
            budget = _safe.Budget(
                _safe.EXPANSION * parts.received,
                f"a payload of {parts.received} bytes may take ({_safe.EXPANSION} per byte)",
            )
        else:
            budget = _safe.Budget(max_bytes, "max_bytes allows")
        budget.charge(parts.copied, "copying small buffers out of the receive buffer")
        return _safe.load(parts.skeleton, parts.buffers, blobs, budget)
    except Refused as refused:
        if safe and refused.global_name:
            name = refused.global_name
            raise UnsafeObjectError(
                f"{fn}: rank {sender} sent an object that needs {name}, which the safe "
                f"serializer refuses{where}. Nothing of it was run. If rank {sender} is trusted "
                f"and {name} is a plain data class, allow it on every rank: "
                f"dist.set_serializer('safe', allow=['{name}'])",
                sender,
                name,
            ) from None
        if safe:
            raise UnsafeObjectError(
                f"{fn}: rank {sender} sent an object that the safe serializer refuses{where}: "
                f"{refused.reason}. Nothing of it was run.",
                sender,
            ) from None
        raise pickle.UnpicklingError(
            f"{fn}: rank {sender} sent an object that distkit cannot decode{where}: "
            f"{refused.reason}"
        ) from None
    except _Unloadable as unloadable:
        unloadable.reraise(fn, sender, where)
    except (pickle.UnpicklingError, EOFError) as exc:
        error = UnsafeObjectError if safe else pickle.UnpicklingError
        raise error(
            f"{fn}: rank {sender} sent an object that distkit cannot decode{where}: {exc}",
            *((sender,) if safe else ()),
        ) from exc
    except Exception as exc:
        if not safe:
            raise  # pickle trusts its peers: their objects' own errors pass through
        raise UnsafeObjectError(
            f"{fn}: rank {sender} sent an object that the safe serializer cannot decode"
            f"{where}: {type(exc).__name__}: {exc}",
            sender,
        ) from exc


# -- sizing ------------------------------------------------------------------------


class _Sizer(pickle.Pickler):
    """Pickles like :class:`_Encoder` into a counter: tensor and buffer data are counted,
    never copied."""

    def __init__(self, sink: io.BytesIO) -> None:
        super().__init__(sink, protocol=5, buffer_callback=self._buffer)
        self.blob_bytes = 0
        self.blobs = 0

    def _buffer(self, buf: pickle.PickleBuffer) -> bool:
        n = buf.raw().nbytes
        if n < MIN_OOB_BYTES:
            return True
        self.blobs += 1
        self.blob_bytes += _align(n)
        return False

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if (cls is Tensor or cls is _PARAMETER) and _pickling.sendable(obj):
            self.blobs += 1
            self.blob_bytes += _align(obj.numel() * obj.element_size())
            meta = (self.blobs, str(obj.dtype), tuple(obj.shape), False, False, "cpu")
            return _with_attributes(meta, obj)
        return NotImplemented


def encoded_sizes(items: Any, name: str, fn: str, comm: Comm) -> list[int]:
    """About how many bytes :func:`encode` makes of each item alone (exact for the data
    of tensors and large buffers, within a few bytes for the pickle stream).

    Nothing is copied: this is a pickling dry run, and the picklability check.

    Raises:
        TypeError: An item (named ``name[i]...``) cannot be pickled.
    """
    sink = io.BytesIO()  # holds one item's pickle stream (tensor data never enters it)
    sizer = _Sizer(sink)
    out = []
    for i, item in enumerate(items):
        sizer.blob_bytes = sizer.blobs = 0
        sink.seek(0)
        try:
            sizer.dump(item)
        except Exception as exc:
            raise _pickling.error(item, f"{name}[{i}]", fn, comm, exc) from None
        sizer.clear_memo()
        out.append(
            _align(HEADER_BYTES + ENTRY_BYTES * sizer.blobs + sink.tell()) + sizer.blob_bytes
        )
    return out
