"""Object collectives on a torch.distributed process group (half of the torch backend).

Each object is encoded by :mod:`distkit.dist.codec.wire` into a CPU part (pickled skeleton,
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

from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch
import torch.distributed as td
from torch import Tensor

from distkit._compat import all_gather_single
from distkit.dist.backends.base import BROADCAST_BYTES, Backend, ObjectCall, Refused
from distkit.dist.codec import pickling as _pickling
from distkit.dist.codec import wire as _wire
from distkit.dist.codec.wire import Encoded
from distkit.dist.core import args as _args
from distkit.dist.core import layouts
from distkit.dist.guard.watch import watched
from distkit.utils.groups import get_cpu_group

if TYPE_CHECKING:
    from distkit.dist.core.comm import Comm

#: The first round's slots (see distkit.dist.core.layouts): an object whose CPU part
#: (pickle + CPU tensors) fits in INLINE_BYTES needs no further round.
SLOT_BYTES, SLOT_HEAD, INLINE_BYTES = layouts.SLOT_BYTES, layouts.SLOT_HEAD, layouts.INLINE_BYTES

INLINE, OVERFLOW, FAILED = layouts.INLINE, layouts.OVERFLOW, layouts.FAILED


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
    comm: Comm, obj: Any, name: _pickling.Naming, call: ObjectCall, dev: Optional[_Channel]
) -> tuple[Optional[Encoded], Optional[Exception]]:
    """``(Encoded, None)``, or ``(None, the error to raise after telling the others)``."""
    if call.refused is not None:
        return None, call.refused
    try:
        return _wire.encode(obj, name, call.fn, comm, dev.device if dev else None), None
    except Exception as exc:  # whatever breaks, the other ranks must hear of it
        return None, exc


def _slot(
    enc: Optional[Encoded],
    error: Optional[Exception],
    ch: _Channel,
    fn: str,
    flags: tuple[bool, bool] = (False, False),
) -> Tensor:
    """One rank's first-round slot: a 64-byte header, then the inline CPU part (or this
    rank's error, as the others say it after ``rank <r> ``: without the call's name and
    this rank's place, which their own message gives)."""
    raw = bytearray(SLOT_BYTES)
    if error is not None:
        said = str(error) if isinstance(error, Refused) else _args.bare(error, fn, ch.comm)
        message = said.encode()[:INLINE_BYTES]
        head = (FAILED + _args.error_code(_own(error)), len(message), 0)
        raw[SLOT_HEAD : SLOT_HEAD + len(message)] = message
    elif enc is not None:
        n = enc.cpu.numel()
        dev_bytes = enc.dev.numel() if enc.dev is not None else 0
        head = (INLINE if n <= INLINE_BYTES else OVERFLOW, n, dev_bytes)
        if n <= INLINE_BYTES:
            raw[SLOT_HEAD : SLOT_HEAD + n] = _wire.bytes_view(enc.cpu)
    else:
        head = (INLINE, 0, 0)
    layouts.SLOT.pack_into(raw, 0, *head, *(int(f) for f in flags))
    slot = _wire.owned_bytes(raw)
    return slot if ch.device.type == "cpu" else slot.to(ch.device)


def _heads(slots: Tensor) -> tuple[Tensor, list[_Head]]:
    """Host copy of received slots (one row per slot) and their parsed headers."""
    host = slots.reshape(-1, SLOT_BYTES).cpu()
    raw = _wire.bytes_view(host.reshape(-1))
    heads = [_Head(*layouts.SLOT.unpack_from(raw, r * SLOT_BYTES)) for r in range(host.shape[0])]
    return host, heads


def _raise_failures(
    fn: str,
    comm: Comm,
    heads: dict[int, _Head],
    host: dict[int, Tensor],
    own: Optional[Exception],
) -> None:
    if own is not None:
        raise _own(own)
    for r, head in sorted(heads.items()):
        if head.status >= FAILED:
            text = bytes(_inline(host[r], head.cpu_bytes).tolist()).decode(errors="replace")
            if not text.startswith(_args.REFUSED):
                text = f"could not send its object: {text}"
            _args.remote_failure(head.status - FAILED, fn, comm, f"rank {r} {text}")


def _refused(call: ObjectCall, head: _Head) -> Optional[Exception]:
    """This rank's own argument error to raise at once, where nothing follows the slot
    from ``head``'s sender (it failed too; else this rank receives the rest first)."""
    return call.refused if head.status >= FAILED else None


def _own(error: Exception) -> Exception:
    """The error this rank raises (its own arguments' as they are)."""
    return error.error if isinstance(error, Refused) else error


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
    comm: Comm, items: list[Any], call: ObjectCall, dev: Optional[_Channel]
) -> tuple[list[Optional[Encoded]], Optional[Exception]]:
    """Encode ``items[r]`` for every other rank r; this rank's own item is only checked."""
    if call.refused is not None:
        return [None] * comm.size, call.refused
    fn = call.fn
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
    """The object collectives of the torch backend
    (:class:`~distkit.dist.backends.tensors.TorchBackend`)."""

    @watched
    def all_gather_object(self, comm: Comm, data: Any, call: ObjectCall) -> list[Any]:
        cpu, dev = _channels(comm)
        enc, error = _encode(comm, data, call.name, call, dev)
        slots = torch.empty(comm.size * SLOT_BYTES, dtype=torch.uint8, device=cpu.device)
        all_gather_single(slots, _slot(enc, error, cpu, call.fn), group=cpu.pg)
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
            enc, error = _encode(comm, data, call.name, call, dev)
            td.gather(_slot(enc, error, cpu, call.fn), None, dst=dst_global, group=cpu.pg)
            if error is not None:
                raise _own(error)
            assert enc is not None
            if enc.cpu.numel() > INLINE_BYTES:
                _send_recv(cpu, {dst: enc.cpu}, {})
            if enc.dev is not None and dev is not None:
                _send_recv(dev, {dst: enc.dev}, {})
            return None

        own: Optional[Exception] = call.refused
        try:
            _pickling.check(data, call.name, call.fn, comm)
        except TypeError as exc:
            own = own or exc
        slots = [
            torch.empty(SLOT_BYTES, dtype=torch.uint8, device=cpu.device) for _ in range(comm.size)
        ]
        td.gather(_slot(None, None, cpu, call.fn), slots, dst=dst_global, group=cpu.pg)
        host, heads = _heads(torch.stack(slots))
        others = {r: h for r, h in enumerate(heads) if r != rank}
        # the ranks that did send take their bytes to dst before it raises another's
        # error: otherwise they would wait in their sends until the group's timeout
        big = {r: h.cpu_bytes for r, h in others.items() if h.status == OVERFLOW}
        cpu_parts = _send_recv(cpu, {}, big)
        dev_parts = _Parts()
        if dev is not None:
            dev_parts.update(
                _send_recv(dev, {}, {r: h.dev_bytes for r, h in others.items() if h.dev_bytes})
            )
        _raise_failures(call.fn, comm, others, dict(enumerate(host)), own)
        return _received(comm, call, data, heads, host, cpu_parts, dev_parts)

    @watched
    def broadcast_object(self, comm: Comm, obj: Any, src: int, name: str, call: ObjectCall) -> Any:
        cpu, dev = _channels(comm)
        rank, src_global = comm.rank, comm.global_rank(src)
        enc, error = _encode(comm, obj, name, call, dev) if rank == src else (None, None)
        slot = _slot(enc, error, cpu, call.fn)
        td.broadcast(slot, src_global, group=cpu.pg)
        if rank == src:
            if error is not None:
                raise _own(error)
            assert enc is not None
            if enc.cpu.numel() > INLINE_BYTES:
                td.broadcast(enc.cpu.to(cpu.device), src_global, group=cpu.pg)
            if enc.dev is not None and dev is not None:
                td.broadcast(enc.dev, src_global, group=dev.pg)
            return obj
        host, heads = _heads(slot)
        head = heads[0]
        _raise_failures(call.fn, comm, {src: head}, {src: host[0]}, _refused(call, head))
        if head.status == OVERFLOW:
            part = torch.empty(head.cpu_bytes, dtype=torch.uint8, device=cpu.device)
            td.broadcast(part, src_global, group=cpu.pg)
        else:
            part = _inline(host[0], head.cpu_bytes)
        dev_part = None
        if head.dev_bytes and dev is not None:
            dev_part = torch.empty(head.dev_bytes, dtype=torch.uint8, device=dev.device)
            td.broadcast(dev_part, src_global, group=dev.pg)
        if call.refused is not None:  # received, so the group stays in step: now raise
            raise call.refused.error
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
            _raise_failures(call.fn, comm, {src: head}, {src: host[0]}, _refused(call, head))
            if head.status == OVERFLOW:
                part = _send_recv(cpu, {}, {src: head.cpu_bytes})[src]
            else:
                part = _inline(host[0], head.cpu_bytes)
            dev_part = None
            if head.dev_bytes and dev is not None:
                dev_part = _send_recv(dev, {}, {src: head.dev_bytes})[src]
            if call.refused is not None:  # received, so the group stays in step
                raise call.refused.error
            return _decode(comm, call, src, part, dev_part)

        if error is None:
            assert data is not None  # checked on src
            encs, error = _encode_each(comm, data, call, dev)
        else:  # src's own arguments were bad: say so to every rank, then raise
            encs = [None] * comm.size
        td.scatter(
            mine, [_slot(e, error, cpu, call.fn) for e in encs], src=src_global, group=cpu.pg
        )
        if error is not None:
            raise _own(error)
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
        encs, error = _encode_each(comm, data, call, dev)
        # Each slot also carries two flags of its sender: "I send an overflow to someone"
        # and "I send device bytes to someone". Every rank gets a slot from every rank, so
        # all agree on whether rounds 2 and 3 happen without a round of their own.
        big = any(e is not None and e.cpu.numel() > INLINE_BYTES for e in encs)
        on_dev = any(e is not None and e.dev is not None for e in encs)
        send = torch.cat([_slot(e, error, cpu, call.fn, (big, on_dev)) for e in encs])
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
