"""Object collectives on a torch.distributed process group (half of the torch backend).

Each object is encoded by :mod:`distkit.dist._wire` into a CPU part (pickled skeleton,
CPU tensors, NumPy buffers) and a device part (tensors on the group's accelerator). The
rounds:

1. **Slot round**, on the group's CPU channel (the group itself under gloo, its gloo
   twin under nccl): every rank sends a fixed ``SLOT_BYTES`` slot holding its status and
   part sizes and, when the CPU part fits, the whole CPU part. Small objects are done
   after this one round.
2. **Overflow round**, only for ranks whose CPU part did not fit: exact-size broadcasts
   or point-to-point sends, so nobody is padded to the largest rank (a padded all_gather
   only for several medium payloads, where one call beats several).
3. **Device round**, only if some rank has accelerator tensors: their packed bytes
   move through the accelerator's own collectives (NCCL under nccl) and land on the
   receiving rank's device, never pickled, never on the host.

A rank whose object cannot be pickled still takes part in round 1 with an error status,
so every rank raises (the failing one its own ``TypeError``, the others a ``TypeError``
naming it) instead of the others hanging.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch
import torch.distributed as td
from torch import Tensor

from distkit._compat import all_gather_single
from distkit.dist import _args, _pickling, _wire
from distkit.dist._backend import Backend, ObjectCall
from distkit.dist._watch import watched
from distkit.dist._wire import Encoded
from distkit.utils.groups import get_cpu_group

if TYPE_CHECKING:
    from distkit.dist._comm import Comm

#: Bytes per rank in the first round. An object whose CPU part (pickle + CPU tensors)
#: fits in ``SLOT_BYTES - SLOT_HEAD`` needs no further round.
SLOT_BYTES = 4096
SLOT_HEAD = 64  # int64 status, cpu bytes, device bytes, 2 flags; padded for alignment
INLINE_BYTES = SLOT_BYTES - SLOT_HEAD
#: Above this size a CPU overflow moves by exact-size broadcasts rather than a padded
#: all_gather (see BROADCAST_GATHER_BYTES in _torch.py for the measurement).
BROADCAST_BYTES = 256 * 1024

# Slot status: the object fits, it overflows, or the sender failed: FAILED + the index of
# its error's type in _args.REMOTE_ERRORS, so the other ranks raise the same type.
# STREAM (broadcast_object only): the object follows in chunks (see _Sender).
INLINE, OVERFLOW, FAILED, STREAM = 0, 1, 2, -1

#: broadcast_object streams a pickle stream longer than this: the source sends it in
#: chunks while it is still pickling, and the receivers unpickle each chunk as it
#: arrives, so pickling, moving and unpickling overlap instead of following each other.
STREAM_BYTES = 64 * 1024
CHUNK_HEAD = 32  # int64 status (MORE, LAST or FAILED + code), data bytes, rest, device bytes
MORE, LAST = 0, 1


def chunk_bytes(k: int) -> int:
    """Bytes of the ``k``-th chunk message of a stream, its header included; both sides
    know the schedule, so no chunk waits for the size of the next: 64 KiB for the first
    four (the receivers start early), then doubling every four, up to 4 MiB (a long
    stream takes few calls)."""
    return min(STREAM_BYTES << (k // 4), 4 << 20)


class _Channel:
    """A process group and the device its tensors are staged on."""

    __slots__ = ("comm", "device", "pg")

    def __init__(self, comm: Comm, pg: Any, device: torch.device) -> None:
        self.comm = comm
        self.pg = pg
        self.device = device

    def src(self, group_rank: int) -> int:
        return self.comm.global_rank(group_rank)


def _channels(comm: Comm) -> tuple[_Channel, Optional[_Channel]]:
    """The CPU channel (skeletons and CPU tensors) and the device channel, if any."""
    device = comm.device()
    if device.type == "cpu":
        return _Channel(comm, comm.pg, device), None
    cpu_pg = get_cpu_group(comm.pg)
    cpu = _Channel(comm, cpu_pg, torch.device("cpu")) if cpu_pg is not None else None
    dev = _Channel(comm, comm.pg, device)
    return cpu or dev, dev


class _Head(NamedTuple):
    """The header of one slot: what its sender holds."""

    status: int
    cpu_bytes: int
    dev_bytes: int
    overflows: int  # the sender sends some rank an overflow (all_to_all_object)
    on_device: int  # the sender sends some rank device bytes (all_to_all_object)


def _encode(
    comm: Comm,
    obj: Any,
    name: str,
    fn: str,
    dev: Optional[_Channel],
    stream: Optional[_wire.Streamer] = None,
) -> tuple[Optional[Encoded], Optional[Exception]]:
    """``(Encoded, None)``, or ``(None, the error to raise after telling the others)``."""
    try:
        return _wire.encode(obj, name, fn, comm, dev.device if dev else None, stream), None
    except Exception as exc:  # whatever breaks, the other ranks must hear of it
        return None, exc


def _slot(
    enc: Optional[Encoded],
    error: Optional[Exception],
    ch: _Channel,
    flags: tuple[bool, bool] = (False, False),
    streamed: bool = False,
) -> Tensor:
    """One rank's first-round slot: a 64-byte header, then the inline CPU part."""
    raw = bytearray(SLOT_BYTES)
    if streamed:
        head = (STREAM, 0, 0)
    elif error is not None:
        message = str(error).encode()[:INLINE_BYTES]
        head = (FAILED + _args.error_code(error), len(message), 0)
        raw[SLOT_HEAD : SLOT_HEAD + len(message)] = message
    elif enc is not None:
        n = enc.cpu.numel()
        dev_bytes = enc.dev.numel() if enc.dev is not None else 0
        head = (INLINE if n <= INLINE_BYTES else OVERFLOW, n, dev_bytes)
        if n <= INLINE_BYTES:
            raw[SLOT_HEAD : SLOT_HEAD + n] = _wire.bytes_view(enc.cpu)
    else:
        head = (INLINE, 0, 0)
    struct.pack_into("<5q", raw, 0, *head, *(int(f) for f in flags))
    slot = torch.frombuffer(raw, dtype=torch.uint8)
    return slot if ch.device.type == "cpu" else slot.to(ch.device)


def _heads(slots: Tensor) -> tuple[Tensor, list[_Head]]:
    """Host copy of received slots (one row per slot) and their parsed headers."""
    host = slots.reshape(-1, SLOT_BYTES).cpu()
    raw = _wire.bytes_view(host.reshape(-1))
    heads = [_Head(*struct.unpack_from("<5q", raw, r * SLOT_BYTES)) for r in range(host.shape[0])]
    return host, heads


def _raise_failures(
    fn: str,
    comm: Comm,
    heads: dict[int, _Head],
    host: dict[int, Tensor],
    own: Optional[Exception],
) -> None:
    if own is not None:
        raise own
    for r, head in sorted(heads.items()):
        if head.status >= FAILED:
            text = bytes(_inline(host[r], head.cpu_bytes).tolist()).decode(errors="replace")
            _args.remote_failure(
                head.status - FAILED, fn, comm, f"rank {r} could not send its object: {text}"
            )


def _inline(host_row: Tensor, n: int) -> Tensor:
    return host_row[SLOT_HEAD : SLOT_HEAD + n]


def _padded_all_gather(ch: _Channel, mine: Optional[Tensor], longest: int) -> Tensor:
    send = torch.zeros(longest, dtype=torch.uint8, device=ch.device)
    if mine is not None:
        send[: mine.numel()] = mine
    out = torch.empty(ch.comm.size * longest, dtype=torch.uint8, device=ch.device)
    all_gather_single(out, send, group=ch.pg)
    return out.view(ch.comm.size, longest)


def _share(ch: _Channel, sizes: dict[int, int], mine: Optional[Tensor]) -> dict[int, Tensor]:
    """Every rank gets the exact ``sizes[r]`` bytes that each listed rank ``r`` holds."""
    if not sizes:
        return {}
    rank = ch.comm.rank
    if rank in sizes:
        assert mine is not None  # this rank holds bytes of its own to share
        mine = mine.to(ch.device)
    if ch.device.type != "cpu" or (len(sizes) > 1 and max(sizes.values()) < BROADCAST_BYTES):
        rows = _padded_all_gather(ch, mine, max(sizes.values()))
        return {r: rows[r, :n] for r, n in sizes.items() if r != rank}
    bufs, works = {}, []
    for r, n in sizes.items():
        if r == rank:
            assert mine is not None
            buf = mine
        else:
            buf = bufs[r] = torch.empty(n, dtype=torch.uint8, device=ch.device)
        works.append(td.broadcast(buf, ch.src(r), group=ch.pg, async_op=True))
    for w in works:
        if w is not None:  # async works (typed Optional since torch 2.14)
            w.wait()
    return bufs


def _send_recv(
    ch: _Channel, sends: dict[int, Tensor], recv_sizes: dict[int, int]
) -> dict[int, Tensor]:
    """Point-to-point: send ``sends[r]`` to r, receive ``recv_sizes[r]`` bytes from r."""
    works = [td.isend(t.to(ch.device), ch.src(r), group=ch.pg) for r, t in sends.items()]
    bufs = {r: torch.empty(n, dtype=torch.uint8, device=ch.device) for r, n in recv_sizes.items()}
    works += [td.irecv(b, ch.src(r), group=ch.pg) for r, b in bufs.items()]
    for w in works:
        if w is not None:  # point-to-point sends return a Work on every backend distkit runs on
            w.wait()
    return bufs


def _decode(comm: Comm, call: ObjectCall, sender: int, cpu: Tensor, dev: Optional[Tensor]) -> Any:
    enc = Encoded(cpu.cpu(), dev)
    return _wire.decode(enc, call.map_location, call.serializer, sender, call.fn, comm)


class _Sender(_wire.Streamer):
    """broadcast_object's source side of a stream: the slot (status STREAM), then chunks
    of the pickle stream as the encoder writes it, then the last chunk, which gives the
    sizes of the rest (blob table and CPU blobs, :func:`distkit.dist._wire.encode`) and
    of the device part, or the error that stopped the encoder.

    Every chunk is an asynchronous broadcast on the CPU channel, so the source goes on
    pickling while gloo sends; the chunks are waited for at the end.
    """

    threshold = STREAM_BYTES

    def __init__(self, ch: _Channel, src_global: int) -> None:
        self.ch = ch
        self.src = src_global
        self.works: list[Any] = []
        self.k = 0
        self.started = False

    def _send(self, t: Tensor) -> None:
        self.works.append(td.broadcast(t, self.src, group=self.ch.pg, async_op=True))

    def _new(self) -> None:
        self.buf = torch.empty(chunk_bytes(self.k), dtype=torch.uint8)
        self.view = _wire.bytes_view(self.buf)
        self.n = CHUNK_HEAD

    def start(self) -> None:
        self.started = True
        self._send(_slot(None, None, self.ch, streamed=True))
        self._new()

    def write(self, data: Any) -> None:
        data = memoryview(data).cast("B")
        i, m = 0, len(data)
        while i < m:
            take = min(len(self.view) - self.n, m - i)
            self.view[self.n : self.n + take] = data[i : i + take]
            self.n += take
            i += take
            if self.n == len(self.view):
                self._ship(MORE)

    def _ship(self, status: int, rest: int = 0, dev: int = 0) -> None:
        struct.pack_into("<4q", self.view, 0, status, self.n - CHUNK_HEAD, rest, dev)
        self._send(self.buf)
        self.k += 1
        if status == MORE:
            self._new()

    def finish(self, enc: Optional[Encoded], error: Optional[Exception]) -> None:
        """Send the last chunk and the rest, wait for every chunk; raise ``error`` if any."""
        try:
            if error is not None:
                message = str(error).encode()[: len(self.view) - CHUNK_HEAD]
                self.view[CHUNK_HEAD : CHUNK_HEAD + len(message)] = message
                self.n = CHUNK_HEAD + len(message)
                self._ship(FAILED + _args.error_code(error))
            else:
                assert enc is not None
                rest = None if _wire.is_empty(enc) else enc.cpu
                dev = enc.dev.numel() if enc.dev is not None else 0
                self._ship(LAST, rest.numel() if rest is not None else 0, dev)
                if rest is not None:
                    self._send(rest)
        finally:
            works, self.works = self.works, []
            for work in works:
                work.wait()
        if error is not None:
            raise error


class _Receiver:
    """broadcast_object's receiving side of a stream: a file of the pickle stream for
    the unpickler (``read``, ``readinto``, ``readline``), which receives chunk ``k + 1``
    while chunk ``k`` is unpickled, then the rest (see :class:`_Sender`)."""

    def __init__(self, comm: Comm, ch: _Channel, dev: Optional[_Channel], src: int, fn: str):
        self.comm, self.ch, self.dev, self.src, self.fn = comm, ch, dev, src, fn
        self.src_global = comm.global_rank(src)
        self.k = 0
        self.buf = b""
        self.pos = 0
        self.last = False
        self.failure: Optional[Exception] = None
        self.rest_bytes = self.dev_bytes = 0
        self.got: Optional[Encoded] = None
        self.pending = self._post()

    def _post(self) -> tuple[Tensor, Any]:
        t = torch.empty(chunk_bytes(self.k), dtype=torch.uint8)
        self.k += 1
        return t, td.broadcast(t, self.src_global, group=self.ch.pg, async_op=True)

    def _fill(self) -> bool:
        """Receive the next chunk into the buffer; False at the end of the stream."""
        if self.last:
            return False
        t, work = self.pending
        work.wait()
        view = _wire.bytes_view(t)
        status, n, rest, dev = struct.unpack_from("<4q", view, 0)
        if not 0 <= n <= len(view) - CHUNK_HEAD:
            self.last = True
            raise _wire.Refused(f"a chunk of {len(view)} bytes claims {n}")
        if status == MORE:
            self.pending = self._post()
        else:
            self.last = True
            if status >= FAILED:
                text = bytes(view[CHUNK_HEAD : CHUNK_HEAD + n]).decode(errors="replace")
                try:
                    _args.remote_failure(
                        status - FAILED,
                        self.fn,
                        self.comm,
                        f"rank {self.src} could not send its object: {text}",
                    )
                except Exception as exc:
                    self.failure = exc
                    raise
            if status != LAST or rest < 0 or dev < 0:
                raise _wire.Refused(f"a chunk of status {status} ends the stream")
            self.rest_bytes, self.dev_bytes = rest, dev
        self.buf = self.buf[self.pos :] + bytes(view[CHUNK_HEAD : CHUNK_HEAD + n])
        self.pos = 0
        return True

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            while self._fill():
                pass
            n = len(self.buf) - self.pos
        else:
            while len(self.buf) - self.pos < n and self._fill():
                pass
        out = self.buf[self.pos : self.pos + n]
        self.pos += len(out)
        return out

    def readinto(self, b: Any) -> int:
        out = self.read(len(memoryview(b).cast("B")))
        memoryview(b).cast("B")[: len(out)] = out
        return len(out)

    def readline(self) -> bytes:
        while self.buf.find(b"\n", self.pos) < 0 and self._fill():
            pass
        end = self.buf.find(b"\n", self.pos)
        return self.read(end + 1 - self.pos if end >= 0 else -1)

    def unread(self) -> int:
        """Bytes of the stream not read (after receiving all of it)."""
        while self._fill():
            pass
        return len(self.buf) - self.pos

    def rest(self) -> Encoded:
        """What follows the stream: the CPU rest and the device part (received once)."""
        while self._fill():  # the stream's end stays in the buffer, for the unpickler
            pass
        if self.got is None:
            cpu: Tensor
            if self.rest_bytes:
                cpu = torch.empty(self.rest_bytes, dtype=torch.uint8)
                td.broadcast(cpu, self.src_global, group=self.ch.pg)
            else:
                cpu = _wire.empty().cpu
            dev_part = None
            if self.dev_bytes and self.dev is not None:
                dev_part = torch.empty(self.dev_bytes, dtype=torch.uint8, device=self.dev.device)
                td.broadcast(dev_part, self.src_global, group=self.dev.pg)
            self.got = Encoded(cpu, dev_part)
        return self.got

    def decode(self, call: ObjectCall) -> Any:
        """The object, unpickled as it arrives; every message of the call is received even
        when decoding fails, so the ranks stay in step for their next collective."""
        try:
            obj = _wire.decode(
                None,
                call.map_location,
                call.serializer,
                self.src,
                self.fn,
                self.comm,
                incoming=self,
            )
        except Exception:
            if self.failure is None:
                try:
                    self.rest()
                except Exception:
                    pass  # the decoding error says more
            if self.failure is not None:
                raise self.failure from None
            raise
        self.rest()
        return obj


def _received(
    comm: Comm,
    call: ObjectCall,
    own: Any,
    heads: list[_Head],
    host: Tensor,
    cpu_parts: Any,
    dev_parts: Any,
) -> list[Any]:
    """One object per rank: ``own`` at this rank's index, the others decoded."""
    out = []
    for r, head in enumerate(heads):
        if r == comm.rank:
            out.append(own)
            continue
        part = cpu_parts[r] if head.status == OVERFLOW else _inline(host[r], head.cpu_bytes)
        out.append(_decode(comm, call, r, part, dev_parts[r] if dev_parts else None))
    return out


def _encode_each(
    comm: Comm, items: list[Any], fn: str, dev: Optional[_Channel]
) -> tuple[list[Optional[Encoded]], Optional[Exception]]:
    """Encode ``items[r]`` for every other rank r; this rank's own item is only checked."""
    encs: list[Optional[Encoded]] = []
    for r, item in enumerate(items):
        try:
            if r == comm.rank:
                _pickling.check(item, f"data[{r}]", fn, comm)
                encs.append(None)
            else:
                encs.append(_wire.encode(item, f"data[{r}]", fn, comm, dev.device if dev else None))
        except Exception as exc:
            return [None] * comm.size, exc
    return encs, None


def _all_to_all_bytes(
    ch: _Channel, out_sizes: list[int], parts: list[Optional[Tensor]]
) -> list[Tensor]:
    """Exact-size all_to_all of byte buffers (``None`` sends nothing)."""
    in_sizes = [0 if p is None else p.numel() for p in parts]
    send = [p.to(ch.device) for p in parts if p is not None and p.numel()]
    buf = torch.cat(send) if send else torch.empty(0, dtype=torch.uint8, device=ch.device)
    out = torch.empty(sum(out_sizes), dtype=torch.uint8, device=ch.device)
    td.all_to_all_single(out, buf, out_sizes, in_sizes, group=ch.pg)
    return list(out.split(out_sizes))


class _Parts(dict):
    """Received parts by rank; a missing rank has none."""

    def __missing__(self, key: int) -> None:
        return None


class TorchObjects(Backend):
    """The object collectives of the torch backend (:class:`~distkit.dist._torch.TorchBackend`)."""

    @watched
    def all_gather_object(self, comm: Comm, data: Any, call: ObjectCall) -> list[Any]:
        cpu, dev = _channels(comm)
        enc, error = _encode(comm, data, "data", call.fn, dev)
        slots = torch.empty(comm.size * SLOT_BYTES, dtype=torch.uint8, device=cpu.device)
        all_gather_single(slots, _slot(enc, error, cpu), group=cpu.pg)
        host, heads = _heads(slots)
        _raise_failures(call.fn, comm, dict(enumerate(heads)), dict(enumerate(host)), error)
        assert enc is not None
        big = {r: h.cpu_bytes for r, h in enumerate(heads) if h.status == OVERFLOW}
        cpu_parts = _share(cpu, big, enc.cpu)
        dev_sizes = {r: h.dev_bytes for r, h in enumerate(heads) if h.dev_bytes}
        dev_parts = _Parts()
        if dev is not None and dev_sizes:
            dev_parts.update(_share(dev, dev_sizes, enc.dev))
        return _received(comm, call, data, heads, host, cpu_parts, dev_parts)

    @watched
    def gather_object(
        self, comm: Comm, data: Any, dst: int, call: ObjectCall
    ) -> Optional[list[Any]]:
        cpu, dev = _channels(comm)
        rank, dst_global = comm.rank, comm.global_rank(dst)
        if rank != dst:
            enc, error = _encode(comm, data, "data", call.fn, dev)
            td.gather(_slot(enc, error, cpu), None, dst=dst_global, group=cpu.pg)
            if error is not None:
                raise error
            assert enc is not None
            if enc.cpu.numel() > INLINE_BYTES:
                _send_recv(cpu, {dst: enc.cpu}, {})
            if enc.dev is not None and dev is not None:
                _send_recv(dev, {dst: enc.dev}, {})
            return None

        own: Optional[Exception] = None
        try:
            _pickling.check(data, "data", call.fn, comm)
        except TypeError as exc:
            own = exc
        slots = [
            torch.empty(SLOT_BYTES, dtype=torch.uint8, device=cpu.device) for _ in range(comm.size)
        ]
        td.gather(_slot(None, None, cpu), slots, dst=dst_global, group=cpu.pg)
        host, heads = _heads(torch.stack(slots))
        others = {r: h for r, h in enumerate(heads) if r != rank}
        _raise_failures(call.fn, comm, others, dict(enumerate(host)), own)
        big = {r: h.cpu_bytes for r, h in others.items() if h.status == OVERFLOW}
        cpu_parts = _send_recv(cpu, {}, big)
        dev_parts = _Parts()
        if dev is not None:
            dev_parts.update(
                _send_recv(dev, {}, {r: h.dev_bytes for r, h in others.items() if h.dev_bytes})
            )
        return _received(comm, call, data, heads, host, cpu_parts, dev_parts)

    @watched
    def broadcast_object(self, comm: Comm, obj: Any, src: int, name: str, call: ObjectCall) -> Any:
        cpu, dev = _channels(comm)
        rank, src_global = comm.rank, comm.global_rank(src)
        if rank == src:
            sender = _Sender(cpu, src_global) if cpu.device.type == "cpu" else None
            enc, error = _encode(comm, obj, name, call.fn, dev, sender)
            if sender is not None and sender.started:
                sender.finish(enc, error)
            else:
                td.broadcast(_slot(enc, error, cpu), src_global, group=cpu.pg)
                if error is not None:
                    raise error
                assert enc is not None
                if enc.cpu.numel() > INLINE_BYTES:
                    td.broadcast(enc.cpu.to(cpu.device), src_global, group=cpu.pg)
            assert enc is not None
            if enc.dev is not None and dev is not None:
                td.broadcast(enc.dev, src_global, group=dev.pg)
            return obj
        slot = _slot(None, None, cpu)
        td.broadcast(slot, src_global, group=cpu.pg)
        host, heads = _heads(slot)
        head = heads[0]
        _raise_failures(call.fn, comm, {src: head}, {src: host[0]}, None)
        if head.status == STREAM:
            return _Receiver(comm, cpu, dev, src, call.fn).decode(call)
        if head.status == OVERFLOW:
            part = torch.empty(head.cpu_bytes, dtype=torch.uint8, device=cpu.device)
            td.broadcast(part, src_global, group=cpu.pg)
        else:
            part = _inline(host[0], head.cpu_bytes)
        dev_part = None
        if head.dev_bytes and dev is not None:
            dev_part = torch.empty(head.dev_bytes, dtype=torch.uint8, device=dev.device)
            td.broadcast(dev_part, src_global, group=dev.pg)
        return _decode(comm, call, src, part, dev_part)

    @watched
    def scatter_object(
        self,
        comm: Comm,
        data: Optional[list[Any]],
        src: int,
        call: ObjectCall,
        error: Optional[Exception] = None,
    ) -> Any:
        cpu, dev = _channels(comm)
        rank, src_global = comm.rank, comm.global_rank(src)
        mine = torch.empty(SLOT_BYTES, dtype=torch.uint8, device=cpu.device)
        if rank != src:
            td.scatter(mine, None, src=src_global, group=cpu.pg)
            host, heads = _heads(mine)
            head = heads[0]
            _raise_failures(call.fn, comm, {src: head}, {src: host[0]}, None)
            if head.status == OVERFLOW:
                part = _send_recv(cpu, {}, {src: head.cpu_bytes})[src]
            else:
                part = _inline(host[0], head.cpu_bytes)
            dev_part = None
            if head.dev_bytes and dev is not None:
                dev_part = _send_recv(dev, {}, {src: head.dev_bytes})[src]
            return _decode(comm, call, src, part, dev_part)

        if error is None:
            assert data is not None  # checked on src
            encs, error = _encode_each(comm, data, call.fn, dev)
        else:  # src's own arguments were bad: say so to every rank, then raise
            encs = [None] * comm.size
        td.scatter(mine, [_slot(e, error, cpu) for e in encs], src=src_global, group=cpu.pg)
        if error is not None:
            raise error
        sent = [(r, e) for r, e in enumerate(encs) if e is not None]
        _send_recv(cpu, {r: e.cpu for r, e in sent if e.cpu.numel() > INLINE_BYTES}, {})
        if dev is not None:
            _send_recv(dev, {r: e.dev for r, e in sent if e.dev is not None}, {})
        assert data is not None
        return data[src]

    @watched
    def all_to_all_object(self, comm: Comm, data: list[Any], call: ObjectCall) -> list[Any]:
        cpu, dev = _channels(comm)
        rank, size = comm.rank, comm.size
        encs, error = _encode_each(comm, data, call.fn, dev)
        # Each slot also carries two flags of its sender: "I send an overflow to someone"
        # and "I send device bytes to someone". Every rank gets a slot from every rank, so
        # all agree on whether rounds 2 and 3 happen without a round of their own.
        big = any(e is not None and e.cpu.numel() > INLINE_BYTES for e in encs)
        on_dev = any(e is not None and e.dev is not None for e in encs)
        send = torch.cat([_slot(e, error, cpu, (big, on_dev)) for e in encs])
        recv = torch.empty_like(send)
        td.all_to_all_single(recv, send, group=cpu.pg)
        host, heads = _heads(recv)
        others = {r: h for r, h in enumerate(heads) if r != rank}
        _raise_failures(call.fn, comm, others, dict(enumerate(host)), error)

        cpu_parts: list[Any] = [None] * size
        if any(h.overflows for h in heads):
            sizes = [
                h.cpu_bytes if h.status == OVERFLOW and r != rank else 0
                for r, h in enumerate(heads)
            ]
            parts = [
                e.cpu if e is not None and e.cpu.numel() > INLINE_BYTES else None for e in encs
            ]
            cpu_parts = _all_to_all_bytes(cpu, sizes, parts)
        dev_parts = _Parts()
        if dev is not None and any(h.on_device for h in heads):
            sizes = [h.dev_bytes if r != rank else 0 for r, h in enumerate(heads)]
            dev_send = [e.dev if e is not None else None for e in encs]
            received = _all_to_all_bytes(dev, sizes, dev_send)
            dev_parts.update({r: p for r, p in enumerate(received) if p.numel()})
        return _received(comm, call, data[rank], heads, host, cpu_parts, dev_parts)
