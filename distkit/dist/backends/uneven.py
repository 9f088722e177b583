"""Uneven collectives in one round: shapes travel beside the data, at predicted sizes.

To gather or exchange tensors whose sizes the receivers do not know (``all_gather`` of
different shapes, ``all_to_all``), the ranks must learn each other's sizes. Exchanging them
first costs a whole round trip: at 1 MiB per rank that was half the time of an
``all_to_all`` on gloo. Instead, every rank sends a small header with the true sizes *in
the same round* as its data, and the data goes at a *capacity* predicted from what the
group moved in its last few calls of that kind: data larger than its capacity is cut,
smaller data is padded. Every rank knows those past sizes (it received them), so all agree
on the capacities without a word. When some data was larger than its capacity, every rank
learns it from the headers and the rest follows in a second round; the first call on a
group has no history, so it takes two rounds, as an explicit size exchange would.

Training loops repeat their shapes, or vary them around a level (MoE token dispatch): the
capacity of each peer (or pair of peers) is the largest size of the last :data:`HISTORY`
calls, so a loop that alternates two kinds of calls (dispatch and combine) keeps a
capacity that fits both. Padding costs bandwidth, so a capacity is only used where the
recent sizes were steady (within :data:`STEADY` of each other) or small enough that
padding is cheaper than a round trip (:data:`SMALL`); elsewhere (a small call after a
large one, say) that peer's data goes in the second round, exactly as it did before.

History is kept per process group and per kind of call, never per call site: ranks
calling the same collectives in the same order (which they must) always hold the same
history, whatever their code looks like.
"""

from __future__ import annotations

import ctypes
import struct
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as td
from torch import Tensor

from distkit._compat import all_gather_single
from distkit.dist.backends.base import BROADCAST_BYTES
from distkit.dist.core import layouts

if TYPE_CHECKING:
    from distkit.dist.core.comm import Comm

#: Calls of one kind on one group whose sizes set the next call's capacities.
HISTORY = 4
#: Capacities are multiples of this many bytes, so any dtype can be viewed in place.
ALIGN = layouts.ALIGN
#: A capacity is used when the largest recent size is at most this factor of the smallest
#: (so at most this much padding is sent), ...
STEADY = 1.25
#: ... or when it is at most this many bytes (padding them costs less than a round trip).
SMALL = 64 * 1024


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


_aligned = layouts.aligned


def history(comm: Comm, kind: str) -> deque[list[int]]:
    """The sizes the last calls of ``kind`` on ``comm``'s group moved (per peer, bytes)."""
    return comm.history(kind, HISTORY)


def capacities(past: deque[list[int]], n: int) -> list[int]:
    """Per peer, the bytes to send in the first round (see the module docstring).

    The largest size of the recent calls, aligned, where those were steady or small; 0
    (everything in the second round) with no history or unsteady sizes. A pure function
    of the history, which both ends of every pair hold alike.
    """
    if not past:
        return [0] * n
    caps = []
    for k in range(n):
        sizes = [call[k] for call in past]
        top = _round_up(max(sizes))
        caps.append(top if top <= SMALL or top <= STEADY * min(sizes) else 0)
    return caps


def _fit(data: Tensor, cap: int) -> Tensor:
    """``data`` (1-D uint8) cut or zero-padded to ``cap`` bytes; itself when it fits."""
    n = data.numel()
    if n == cap:
        return data
    if n > cap:
        return data[:cap]
    out = torch.zeros(cap, dtype=torch.uint8, device=data.device)
    out[:n] = data
    return out


def _encode(rows: list[list[int]], dev: torch.device) -> list[Tensor]:
    """Each header row as the bytes of its int64s (a 1-D uint8 tensor on ``dev``), in
    this machine's byte order, as :func:`_decode` reads them."""
    return list(torch.tensor(rows, dtype=torch.int64, device=dev).view(torch.uint8))


def _decode(
    first: Tensor, segments: tuple[Tensor, ...], splits: list[int], fmt: str
) -> list[list[int]]:
    """The header row at the front of each segment of ``first`` (as sent by :func:`_encode`).

    On the CPU, read straight from the received buffer's memory (``first`` is contiguous
    and each header lies inside it): an eighth of the time of stacking the header views
    and converting them to lists.
    """
    head = struct.calcsize(fmt)
    if first.device.type != "cpu":
        return torch.stack([seg[:head].view(torch.int64) for seg in segments]).tolist()
    rows, offset, base = [], 0, first.data_ptr()
    for n in splits:
        rows.append(list(struct.unpack(fmt, ctypes.string_at(base + offset, head))))
        offset += n
    return rows


def _frame(head: Tensor, data: Tensor, cap: int) -> list[Tensor]:
    """The pieces of one framed segment: ``head``, then ``data`` cut or zero-padded to
    ``cap`` bytes. One ``torch.cat`` of them writes the segment: about half the time of
    filling a preallocated buffer slice by slice."""
    n = data.numel()
    if n >= cap:
        return [head, data if n == cap else data[:cap]]
    return [head, data, torch.zeros(cap - n, dtype=torch.uint8, device=data.device)]


def _join(first: Tensor, rest: Tensor, total: int) -> Tensor:
    """The ``total`` bytes of a peer: its first-round part, then its second-round part."""
    if rest.numel() == 0:
        return first[:total]
    return torch.cat([first[: total - rest.numel()], rest])


Finish = Callable[[], tuple[list[Tensor], list[list[int]]]]


def all_gather(comm: Comm, mine: Tensor, row: list[int]) -> tuple[list[Any], Finish]:
    """Gather every rank's bytes and header row: ``(works, finish)``.

    ``mine`` is this rank's data as a 1-D uint8 tensor; ``row`` its header (ints, the
    same length on every rank). ``finish()``, once ``works`` are done, returns every rank's
    bytes (exactly as many as it sent; this rank's entry is ``mine``) and header row.
    """
    size, rank = comm.size, comm.rank
    width = len(row)
    past = history(comm, "all_gather")
    caps = capacities(past, size)
    dev = mine.device
    header = torch.tensor(_aligned([mine.numel(), *row]), dtype=torch.int64, device=dev)
    head = header.numel() * header.element_size()
    widest = max(caps)
    firsts: list[Tensor]
    works: list[Any]

    def framed(cap: int) -> Tensor:
        """This rank's header, then its first ``cap`` bytes (zero-padded)."""
        return torch.cat(_frame(header.view(torch.uint8), mine, cap))

    if widest and dev.type == "cpu" and widest >= BROADCAST_BYTES:
        # each rank's header rides in front of its bytes, in its own broadcast
        frames = [
            framed(caps[r])
            if r == rank
            else torch.empty(head + caps[r], dtype=torch.uint8, device="cpu")
            for r in range(size)
        ]
        works = [
            td.broadcast(frames[r], comm.global_rank(r), group=comm.pg, async_op=True)
            for r in range(size)
        ]
        rows_out = torch.empty(size * header.numel(), dtype=torch.int64, device=dev)
        firsts = [f[head:] for f in frames]
    elif widest:  # one padded all_gather of header + bytes
        gathered = torch.empty(size * (head + widest), dtype=torch.uint8, device=dev)
        works = [all_gather_single(gathered, framed(widest), group=comm.pg, async_op=True)]
        frames = list(gathered.split(head + widest))
        rows_out = torch.empty(size * header.numel(), dtype=torch.int64, device=dev)
        firsts = [f[head:] for f in frames]
    else:  # no history (or no steady size): the sizes first, then the data
        frames = []
        rows_out = torch.empty(size * header.numel(), dtype=torch.int64, device=dev)
        works = [all_gather_single(rows_out, header, group=comm.pg, async_op=True)]
        firsts = [mine[:0]] * size

    def finish() -> tuple[list[Tensor], list[list[int]]]:
        if frames:
            rows_out.copy_(torch.cat([f[:head].view(torch.int64) for f in frames]))
        flat = rows_out.tolist()
        n = header.numel()
        rows = [flat[r * n : (r + 1) * n] for r in range(size)]
        sizes = [row[0] for row in rows]
        over = {r: sizes[r] - caps[r] for r in range(size) if sizes[r] > caps[r]}
        rests: dict[int, Tensor] = {}
        if over:  # every rank saw the same headers: all take this second round
            longest = max(over.values())
            if dev.type == "cpu" and longest >= BROADCAST_BYTES:
                bufs = {
                    r: mine[caps[r] :]
                    if r == rank
                    else torch.empty(k, dtype=torch.uint8, device="cpu")
                    for r, k in over.items()
                }
                waits = [
                    td.broadcast(b, comm.global_rank(r), group=comm.pg, async_op=True)
                    for r, b in bufs.items()
                ]
                for w in waits:
                    if w is not None:  # async works (typed Optional since torch 2.14)
                        w.wait()
                rests = bufs
            else:
                send = _fit(mine[caps[rank] :], longest)
                out = torch.empty(size * longest, dtype=torch.uint8, device=dev)
                all_gather_single(out, send, group=comm.pg)
                rests = {r: out[r * longest : r * longest + k] for r, k in over.items()}
        past.append(sizes)
        parts = [
            mine if r == rank else _join(firsts[r], rests.get(r, mine[:0]), sizes[r])
            for r in range(size)
        ]
        return parts, [got[1 : 1 + width] for got in rows]

    return works, finish


def all_to_all(
    comm: Comm,
    chunks: list[Tensor],
    rows: list[list[int]],
    kind: str = "all_to_all",
    check: Optional[Callable[[list[list[int]]], None]] = None,
) -> tuple[list[Tensor], list[list[int]]]:
    """Send ``chunks[d]`` (1-D uint8) and header ``rows[d]`` to rank ``d``.

    Returns what each rank sent here: its bytes (exactly as many as it sent) and its
    header row. This rank's own chunk comes back as it was passed.

    ``check``, given, is called with the header rows received (in sender order) as soon
    as they arrive, before any second round: when it raises on every rank (it sees what
    every rank sent, so a check of what all ranks must agree on does), nothing more moves
    and the group's size history is left as it was.
    """
    size, rank = comm.size, comm.rank
    dev = chunks[0].device
    # this rank's own chunk never travels (it comes back as passed): it is sent as empty,
    # so it counts as 0 bytes for capacities, overflows and the history; its header goes
    mine = chunks[rank]
    chunks = [*chunks[:rank], mine[:0], *chunks[rank + 1 :]]
    past = history(comm, kind)  # per call: [sent to d..., received from s...]
    caps = capacities(past, 2 * size)
    send_caps, recv_caps = caps[:size], caps[size:]
    sent = [c.numel() for c in chunks]
    overflow = any(n > cap for n, cap in zip(sent, send_caps))
    header_rows = [_aligned([n, int(overflow), *row]) for n, row in zip(sent, rows)]
    width = len(rows[0]) if rows else 0
    if not past:  # the group's first call of this kind: the headers alone, then the data
        headers = torch.tensor(header_rows, dtype=torch.int64, device=dev)
        incoming = torch.empty_like(headers)
        td.all_to_all_single(incoming, headers, group=comm.pg)
        got = incoming.tolist()
        first = headers.new_empty(0).view(torch.uint8)
        firsts = [first] * size
    else:
        # One collective: each peer's header rides in front of its data (fixed size, so
        # every segment stays aligned), and every rank of the group takes part even when
        # all its own capacities are 0.
        fmt = layouts.frame_format(len(header_rows[0]))
        head = struct.calcsize(fmt)
        out_splits = [head + cap for cap in recv_caps]
        in_splits = [head + cap for cap in send_caps]
        heads = _encode(header_rows, dev)
        send = torch.cat(
            [piece for d in range(size) for piece in _frame(heads[d], chunks[d], send_caps[d])]
        )
        first = torch.empty(sum(out_splits), dtype=torch.uint8, device=dev)
        td.all_to_all_single(first, send, out_splits, in_splits, group=comm.pg)
        segments = first.split(out_splits)
        got = _decode(first, segments, out_splits, fmt)
        firsts = [seg[head:] for seg in segments]
    theirs = [row[2 : 2 + width] for row in got]  # the header rows as the callers sent them
    if check is not None:
        check(theirs)
    received = [row[0] for row in got]
    rests: list[Tensor] = [first[:0]] * size
    if any(row[1] for row in got):  # some rank sent more than its capacity somewhere
        out_rest = [max(0, n - cap) for n, cap in zip(received, recv_caps)]
        in_rest = [max(0, n - cap) for n, cap in zip(sent, send_caps)]
        tails = [c[cap:] for c, cap in zip(chunks, send_caps)]
        send_rest = torch.cat(tails) if sum(in_rest) else first[:0]
        rest = torch.empty(sum(out_rest), dtype=torch.uint8, device=dev)
        td.all_to_all_single(rest, send_rest, out_rest, in_rest, group=comm.pg)
        rests = list(rest.split(out_rest))
    past.append(sent + received)
    parts = [mine if s == rank else _join(firsts[s], rests[s], received[s]) for s in range(size)]
    return parts, theirs
