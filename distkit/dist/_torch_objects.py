"""Object collectives on a torch.distributed process group.

Each object is encoded by :mod:`distkit.dist._serial` into a CPU part (pickled skeleton,
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
from typing import Any, Optional

import torch
import torch.distributed as td
from torch import Tensor

from distkit._compat import all_gather_single
from distkit.dist import _serial
from distkit.dist._checks import fail
from distkit.dist._serial import Encoded
from distkit.dist._watch import watched

#: Bytes per rank in the first round. An object whose CPU part (pickle + CPU tensors)
#: fits in ``SLOT_BYTES - SLOT_HEAD`` needs no further round.
SLOT_BYTES = 4096
SLOT_HEAD = 64  # int64 status, cpu bytes, device bytes; padded to keep payloads aligned
INLINE_BYTES = SLOT_BYTES - SLOT_HEAD
#: Above this size a CPU overflow moves by exact-size broadcasts rather than a padded
#: all_gather (see BROADCAST_GATHER_BYTES in _torch.py for the measurement).
BROADCAST_BYTES = 256 * 1024

INLINE, OVERFLOW, FAILED = 0, 1, 2


class _Channel:
    """A process group and the device its tensors are staged on."""

    __slots__ = ("comm", "device", "pg")

    def __init__(self, comm: Any, pg: Any, device: torch.device) -> None:
        self.comm = comm
        self.pg = pg
        self.device = device

    def src(self, group_rank: int) -> int:
        return self.comm.global_rank(group_rank)


def _channels(comm: Any) -> tuple[_Channel, Optional[_Channel]]:
    from distkit.utils.groups import get_cpu_group

    device = comm.device()
    if device.type == "cpu":
        return _Channel(comm, comm.pg, device), None
    cpu_pg = get_cpu_group(comm.pg)
    cpu = _Channel(comm, cpu_pg, torch.device("cpu")) if cpu_pg is not None else None
    dev = _Channel(comm, comm.pg, device)
    return cpu or dev, dev


def _encode(comm: Any, obj: Any, name: str, fn: str, dev: Optional[_Channel]) -> tuple:
    """(Encoded, None) or (None, the TypeError to raise after telling the others)."""
    try:
        return _serial.encode(obj, name, fn, comm, dev.device if dev else None), None
    except TypeError as exc:
        return None, exc


def _slot(
    enc: Optional[Encoded], error: Optional[Exception], ch: _Channel, flags: tuple = (0, 0)
) -> Tensor:
    """One rank's first-round slot: a 64-byte header, then the inline CPU part.

    Header (int64): status, CPU bytes, device bytes, and two sender-wide flags used by
    all_to_all_object.
    """
    raw = bytearray(SLOT_BYTES)
    if error is not None:
        message = str(error).encode()[:INLINE_BYTES]
        head = (FAILED, len(message), 0)
        raw[SLOT_HEAD : SLOT_HEAD + len(message)] = message
    elif enc is not None:
        n = enc.cpu.numel()
        head = (INLINE if n <= INLINE_BYTES else OVERFLOW, n, enc.dev.numel() if enc.dev is not None else 0)
        if n <= INLINE_BYTES:
            raw[SLOT_HEAD : SLOT_HEAD + n] = _serial._bytes_view(enc.cpu)
    else:
        head = (INLINE, 0, 0)
    struct.pack_into("<5q", raw, 0, *head, *(int(f) for f in flags))
    slot = torch.frombuffer(raw, dtype=torch.uint8)
    return slot if ch.device.type == "cpu" else slot.to(ch.device)


def _heads(slots: Tensor) -> tuple[Tensor, list[tuple]]:
    """Host copy of received slots (one row per slot) and their parsed headers."""
    host = slots.reshape(-1, SLOT_BYTES).cpu()
    raw = _serial._bytes_view(host.reshape(-1))
    heads = [struct.unpack_from("<5q", raw, r * SLOT_BYTES) for r in range(host.shape[0])]
    return host, heads


def _raise_failures(
    fn: str, comm: Any, heads: dict[int, list[int]], host: dict[int, Tensor],
    own: Optional[Exception],
) -> None:
    if own is not None:
        raise own
    for r, (status, n, *_) in sorted(heads.items()):
        if status == FAILED:
            message = bytes(host[r][SLOT_HEAD : SLOT_HEAD + n].tolist()).decode(errors="replace")
            fail(TypeError, fn, comm, f"rank {r} could not send its object: {message}")


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
    mine = mine.to(ch.device) if mine is not None and rank in sizes else None
    if ch.device.type != "cpu" or (len(sizes) > 1 and max(sizes.values()) < BROADCAST_BYTES):
        rows = _padded_all_gather(ch, mine, max(sizes.values()))
        return {r: rows[r, :n] for r, n in sizes.items() if r != rank}
    bufs = {
        r: mine if r == rank else torch.empty(n, dtype=torch.uint8, device=ch.device)
        for r, n in sizes.items()
    }
    works = [td.broadcast(bufs[r], ch.src(r), group=ch.pg, async_op=True) for r in sizes]
    for w in works:
        w.wait()
    return {r: b for r, b in bufs.items() if r != rank}  # type: ignore[misc]


def _send_recv(
    ch: _Channel, sends: dict[int, Tensor], recv_sizes: dict[int, int]
) -> dict[int, Tensor]:
    """Point-to-point: send ``sends[r]`` to r, receive ``recv_sizes[r]`` bytes from r."""
    works = [td.isend(t.to(ch.device), ch.src(r), group=ch.pg) for r, t in sends.items()]
    bufs = {r: torch.empty(n, dtype=torch.uint8, device=ch.device) for r, n in recv_sizes.items()}
    works += [td.irecv(b, ch.src(r), group=ch.pg) for r, b in bufs.items()]
    for w in works:
        w.wait()
    return bufs


def _decoder(comm: Any, fn: str, map_location: Any, serializer: str) -> Any:
    """``decode(sender, cpu_part, dev_part)`` for one call's received objects."""

    def decode(sender: int, cpu: Tensor, dev: Optional[Tensor]) -> Any:
        return _serial.decode(Encoded(cpu.cpu(), dev), map_location, serializer, sender, fn, comm)

    return decode


@watched("all_gather_object")
def all_gather_object(comm: Any, data: Any, fn: str, map_location: Any, serializer: str) -> list:
    cpu, dev = _channels(comm)
    decode = _decoder(comm, fn, map_location, serializer)
    enc, error = _encode(comm, data, "data", fn, dev)
    slots = torch.empty(comm.size * SLOT_BYTES, dtype=torch.uint8, device=cpu.device)
    all_gather_single(slots, _slot(enc, error, cpu), group=cpu.pg)
    host, heads = _heads(slots)
    _raise_failures(fn, comm, dict(enumerate(heads)), dict(enumerate(host)), error)
    rank = comm.rank
    big = {r: h[1] for r, h in enumerate(heads) if h[0] == OVERFLOW}
    cpu_parts = _share(cpu, big, enc.cpu)  # type: ignore[union-attr]
    dev_sizes = {r: h[2] for r, h in enumerate(heads) if h[2]}
    dev_parts = {}
    if dev is not None and dev_sizes:
        dev_parts = _share(dev, dev_sizes, enc.dev)  # type: ignore[union-attr]
    out = []
    for r, (status, n, *_) in enumerate(heads):
        if r == rank:
            out.append(data)
            continue
        part = cpu_parts[r] if status == OVERFLOW else _inline(host[r], n)
        out.append(decode(r, part, dev_parts.get(r)))
    return out


@watched("gather_object")
def gather_object(
    comm: Any, data: Any, dst: int, fn: str, map_location: Any, serializer: str
) -> Optional[list]:
    cpu, dev = _channels(comm)
    decode = _decoder(comm, fn, map_location, serializer)
    rank, dst_global = comm.rank, comm.global_rank(dst)
    if rank != dst:
        enc, error = _encode(comm, data, "data", fn, dev)
        td.gather(_slot(enc, error, cpu), None, dst=dst_global, group=cpu.pg)
        if error is not None:
            raise error
        if enc.cpu.numel() > INLINE_BYTES:  # type: ignore[union-attr]
            _send_recv(cpu, {dst: enc.cpu}, {})  # type: ignore[union-attr]
        if enc.dev is not None:  # type: ignore[union-attr]
            _send_recv(dev, {dst: enc.dev}, {})  # type: ignore[arg-type,union-attr]
        return None

    error = None
    try:
        _serial.check(data, "data", fn, comm)
    except TypeError as exc:
        error = exc
    slots = [torch.empty(SLOT_BYTES, dtype=torch.uint8, device=cpu.device) for _ in range(comm.size)]
    td.gather(_slot(None, None, cpu), slots, dst=dst_global, group=cpu.pg)
    host, heads = _heads(torch.stack(slots))
    others = {r: h for r, h in enumerate(heads) if r != rank}
    _raise_failures(fn, comm, others, dict(enumerate(host)), error)
    cpu_parts = _send_recv(cpu, {}, {r: h[1] for r, h in others.items() if h[0] == OVERFLOW})
    dev_parts = (
        _send_recv(dev, {}, {r: h[2] for r, h in others.items() if h[2]}) if dev is not None else {}
    )
    out = []
    for r in range(comm.size):
        if r == rank:
            out.append(data)
            continue
        status, n = heads[r][:2]
        part = cpu_parts[r] if status == OVERFLOW else _inline(host[r], n)
        out.append(decode(r, part, dev_parts.get(r)))
    return out


@watched("broadcast_object")
def broadcast_object(
    comm: Any, obj: Any, src: int, fn: str, name: str, map_location: Any, serializer: str
) -> Any:
    cpu, dev = _channels(comm)
    decode = _decoder(comm, fn, map_location, serializer)
    rank, src_global = comm.rank, comm.global_rank(src)
    enc, error = _encode(comm, obj, name, fn, dev) if rank == src else (None, None)
    slot = _slot(enc, error, cpu)
    td.broadcast(slot, src_global, group=cpu.pg)
    if rank == src:
        if error is not None:
            raise error
        if enc.cpu.numel() > INLINE_BYTES:  # type: ignore[union-attr]
            td.broadcast(enc.cpu.to(cpu.device), src_global, group=cpu.pg)  # type: ignore[union-attr]
        if enc.dev is not None:  # type: ignore[union-attr]
            td.broadcast(enc.dev, src_global, group=dev.pg)  # type: ignore[union-attr]
        return obj
    host, heads = _heads(slot)
    status, n, dev_n = heads[0][:3]
    _raise_failures(fn, comm, {src: heads[0]}, {src: host[0]}, None)
    if status == OVERFLOW:
        part = torch.empty(n, dtype=torch.uint8, device=cpu.device)
        td.broadcast(part, src_global, group=cpu.pg)
    else:
        part = _inline(host[0], n)
    dev_part = None
    if dev_n:
        dev_part = torch.empty(dev_n, dtype=torch.uint8, device=dev.device)  # type: ignore[union-attr]
        td.broadcast(dev_part, src_global, group=dev.pg)  # type: ignore[union-attr]
    return decode(src, part, dev_part)


def _encode_each(comm: Any, items: list, fn: str, dev: Optional[_Channel]) -> tuple:
    """Encode ``items[r]`` for every other rank r; this rank's own item is only checked."""
    encs: list = []
    for r, item in enumerate(items):
        try:
            if r == comm.rank:
                _serial.check(item, f"data[{r}]", fn, comm)
                encs.append(None)
            else:
                encs.append(
                    _serial.encode(item, f"data[{r}]", fn, comm, dev.device if dev else None)
                )
        except TypeError as exc:
            return [None] * comm.size, exc
    return encs, None


@watched("scatter_object")
def scatter_object(
    comm: Any, data: Optional[list], src: int, fn: str, map_location: Any, serializer: str
) -> Any:
    cpu, dev = _channels(comm)
    decode = _decoder(comm, fn, map_location, serializer)
    rank, src_global = comm.rank, comm.global_rank(src)
    mine = torch.empty(SLOT_BYTES, dtype=torch.uint8, device=cpu.device)
    if rank != src:
        td.scatter(mine, None, src=src_global, group=cpu.pg)
        host, heads = _heads(mine)
        status, n, dev_n = heads[0][:3]
        _raise_failures(fn, comm, {src: heads[0]}, {src: host[0]}, None)
        part = _send_recv(cpu, {}, {src: n})[src] if status == OVERFLOW else _inline(host[0], n)
        dev_part = _send_recv(dev, {}, {src: dev_n})[src] if dev_n else None  # type: ignore[arg-type]
        return decode(src, part, dev_part)

    encs, error = _encode_each(comm, data, fn, dev)  # type: ignore[arg-type]
    td.scatter(mine, [_slot(e, error, cpu) for e in encs], src=src_global, group=cpu.pg)
    if error is not None:
        raise error
    sent = [(r, e) for r, e in enumerate(encs) if e is not None]
    _send_recv(cpu, {r: e.cpu for r, e in sent if e.cpu.numel() > INLINE_BYTES}, {})
    if dev is not None:
        _send_recv(dev, {r: e.dev for r, e in sent if e.dev is not None}, {})
    return data[src]  # type: ignore[index]


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


@watched("all_to_all_object")
def all_to_all_object(
    comm: Any, data: list, fn: str, map_location: Any, serializer: str
) -> list:
    cpu, dev = _channels(comm)
    decode = _decoder(comm, fn, map_location, serializer)
    rank, size = comm.rank, comm.size
    encs, error = _encode_each(comm, data, fn, dev)
    # Each slot also carries two flags of its sender: "I send an overflow to someone" and
    # "I send device bytes to someone". Every rank gets a slot from every rank, so all
    # agree on whether rounds 2 and 3 happen without a round of their own.
    big = any(e is not None and e.cpu.numel() > INLINE_BYTES for e in encs)
    on_dev = any(e is not None and e.dev is not None for e in encs)
    send = torch.cat([_slot(e, error, cpu, (big, on_dev)) for e in encs])
    recv = torch.empty_like(send)
    td.all_to_all_single(recv, send, group=cpu.pg)
    host, heads = _heads(recv)
    others = {r: h for r, h in enumerate(heads) if r != rank}
    _raise_failures(fn, comm, others, dict(enumerate(host)), error)

    cpu_parts: list = [None] * size
    if any(h[3] for h in heads):
        sizes = [h[1] if h[0] == OVERFLOW and r != rank else 0 for r, h in enumerate(heads)]
        parts = [e.cpu if e is not None and e.cpu.numel() > INLINE_BYTES else None for e in encs]
        cpu_parts = _all_to_all_bytes(cpu, sizes, parts)
    dev_parts: list = [None] * size
    if dev is not None and any(h[4] for h in heads):
        sizes = [h[2] if r != rank else 0 for r, h in enumerate(heads)]
        parts = [e.dev if e is not None else None for e in encs]
        dev_parts = [p if p.numel() else None for p in _all_to_all_bytes(dev, sizes, parts)]
    out = []
    for r in range(size):
        if r == rank:
            out.append(data[r])
            continue
        status, n = heads[r][:2]
        part = cpu_parts[r] if status == OVERFLOW else _inline(host[r], n)
        out.append(decode(r, part, dev_parts[r]))
    return out
