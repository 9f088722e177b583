"""Point-to-point messages of any shape: frames at predicted sizes, received in order.

torch's ``recv`` needs a buffer of exactly the sender's shape and dtype. Here a send
starts with a *frame* (:data:`~distkit.dist.core.layouts.P2P_HEAD`): the head says what
follows (a tensor's dtype and shape, an encoded object, or the sender's failure), and a
tensor of at most :data:`TENSOR_INLINE` bytes rides in the frame itself, so the usual
message is one message, as with torch. The receiver takes the frame into a buffer of a
*capacity* predicted from the sizes of the channel's last frames, which both ends know
(they sent and received them): a frame longer than that sends the rest in a second
message of exact size (the first message of a channel, or a larger one than before); gloo
takes a message shorter than the buffer, so on gloo the capacity is the largest recent
frame, and on backends that need exact sizes (NCCL) it is used only where recent sizes
were steady, with the frame padded to it. Then come the messages of exact size whose
sizes the frame told: a larger tensor's bytes, received straight into the new tensor, and
an object's large tensors (each into memory of its own: see
:mod:`distkit.dist.codec.wire`) and device part. On gloo, a tensor that follows two of
its dtype and shape goes *bare*, with no frame at all: its bytes alone, straight from and
into the tensors, known at the receiver by a mark it wrote behind them (see
:meth:`Channel.note`).

A *channel* is one direction of one pair on one tag. Its messages are numbered from 1 at
both ends (the number travels in the head and is checked), and its receives are posted
strictly in order: a receive posts its frame only once every message of the receive
before it is posted (its size came from that one's frame), so sends and receives pair up
in the order they were made, whatever order handles are waited in. Sends are posted at
once, all their messages together. ``exchange`` posts every frame of the call at once
(batched on NCCL, where two ranks sending to each other on one stream would wait for each
other), then every rest, then every part sent apart: a ring never deadlocks.

Tags on the wire are the caller's plus :data:`~distkit.dist.core.layouts.P2P_TAG_BASE`,
apart from the tags distkit's collectives use for their own point-to-point messages.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import struct
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from datetime import timedelta
from threading import get_ident
from typing import Any, NamedTuple, Optional, Union

import torch
import torch.distributed as td
from torch import Tensor

from distkit._compat import (
    group_timeout,
    has_torch_function_unary,
    in_compiled_eager,
    is_compiling,
    is_registered,
    storage_use_count,
)
from distkit.dist.backends.base import ObjectCall
from distkit.dist.codec import policy
from distkit.dist.codec import wire as _wire
from distkit.dist.core import args as _args
from distkit.dist.core import layouts
from distkit.dist.core.comm import _FACTS, Comm
from distkit.dist.core.layouts import P2P_FAILED, P2P_HEAD, P2P_OBJECT, P2P_TENSOR
from distkit.dist.errors import CollectiveTimeoutError
from distkit.dist.guard import check as _check
from distkit.dist.guard import debugmode, pairs
from distkit.dist.guard import record as _record
from distkit.dist.guard.pairs import Op
from distkit.dist.guard.watch import _local
from distkit.dist.handle import Handle

#: Frames of a channel whose sizes set the next capacity.
HISTORY = 4
#: On backends that need exact sizes, a capacity is used when the largest recent frame is
#: at most this factor of the smallest (so at most this much padding is sent) ...
STEADY = 1.25
#: ... or at most this many bytes.
SMALL = 64 * 1024
#: A tensor of at most this many bytes rides in its frame (copied into it: cheaper than a
#: second message up to about this size on this project's machine); a larger one follows
#: in a message of its own, straight from and into the tensors.
TENSOR_INLINE = 4 << 20
#: A tensor of at least this many bytes that follows two of the same dtype and shape on a
#: gloo channel travels *bare*: its bytes alone, from and into the tensors (see
#: :meth:`Channel.note`).
BARE_MIN = 64 * 1024
#: Bytes of the mark a receiver puts right behind where a bare message would end.
MARK = 16
#: Messages a receive takes in turn: the frame, the rest of the frame, the parts apart.
FRAME, REST, PARTS, DONE = 1, 2, 3, 4
ALIGN = layouts.P2P_ALIGN
_HEAD_SIZE = P2P_HEAD.size


class _Stage:
    """A sender's frame buffer on the CPU, reused from one send to the next (a fresh one
    costs page faults), with what the fast path needs of it at hand."""

    __slots__ = ("ptr", "raw", "size", "tensor", "views", "works")

    def __init__(self, size: int) -> None:
        self.tensor = torch.empty(size, dtype=torch.uint8, device="cpu")
        self.size = size
        self.ptr = self.tensor.data_ptr()
        self.raw = (ctypes.c_char * size).from_address(self.ptr)  # for struct.pack_into
        self.views: dict[int, Tensor] = {}  # its first n bytes, by n
        self.works: list[Any] = []  # what reads it now

    def free(self) -> bool:
        if self.works and all(w.is_completed() for w in self.works):
            self.works = []
        return not self.works

    def view(self, n: int) -> Tensor:
        found = self.views.get(n)
        if found is None:
            if len(self.views) >= 8:
                self.views.clear()
            found = self.views[n] = self.tensor[:n]
        return found


class _Spare:
    """Holds a receive buffer that may be free (see :func:`_unused`)."""

    __slots__ = ("buf",)

    def __init__(self, buf: Optional[Tensor] = None) -> None:
        self.buf = buf


def _holders(holder: Any) -> Optional[tuple[int, int, int]]:
    """Who holds ``holder.buf``'s memory: Python references to the tensor and to its
    storage's object, and the storage's references in C++ (each tensor made on it counts
    one); ``None`` when this torch cannot count the last."""
    t = holder.buf
    st = t.untyped_storage()
    n = storage_use_count(st)
    return None if n is None else (sys.getrefcount(t), sys.getrefcount(st), n)


#: A buffer nothing else ever holds: what the counts of :func:`_holders` read for a buffer
#: held by its holder alone, on this torch (measured the same way, so they mean the same)
_PROBE = _Spare(torch.empty(ALIGN, dtype=torch.uint8, device="cpu"))
#: Held while the probe is measured: a second thread measuring it at the same time would
#: add its own references to the counts, which could then hide one of the caller's
_PROBE_LOCK = threading.Lock()


def _unused(ch: Channel, cap: int) -> Optional[Tensor]:
    """The channel's last receive buffer, when it has ``cap`` bytes and nothing but the
    channel holds its memory any more: the result made of it, every view of that, every
    storage object and every array of it dropped (each one would count in
    :func:`_holders`); else ``None``, and a new buffer is made."""
    spare = ch.spare
    if spare.buf is None:
        return None
    with _PROBE_LOCK:
        alone = _holders(_PROBE)  # both measured before any other reference is taken
    held = _holders(spare)
    buf, spare.buf = spare.buf, None  # in use from here on (or dropped)
    if alone is None or held != alone or buf.numel() != cap:
        return None
    storage = buf.untyped_storage()
    if storage.nbytes() != cap or storage.data_ptr() != buf.data_ptr():
        return None  # resized or replaced under it: never read through it again
    if storage.is_shared():
        return None  # moved to shared memory (put in a torch.multiprocessing queue):
        # another process may map it, which no count here sees
    return buf


class Meta(NamedTuple):
    """A tensor message as a channel notes it (see :meth:`Channel.note`)."""

    code: int  # its dtype's
    dims: tuple
    nbytes: int
    frame: int  # the bytes of its frame, had it one (what the channel's history notes)


class Channel:
    """One direction of one pair on one tag, at this end."""

    __slots__ = (
        "bare",
        "count",
        "guess",
        "helper",
        "history",
        "last",
        "lock",
        "moved",
        "queue",
        "spare",
        "stage",
        "todo",
    )

    def __init__(self) -> None:
        self.count = 0  # messages made on it (the next one's number is count + 1)
        self.history: deque[int] = deque(maxlen=HISTORY)  # bytes of its last frames
        self.queue: deque[Receive] = deque()  # receives whose messages are not all posted
        self.lock = threading.RLock()  # one thread drives its receives at a time
        # told when the thread that drives them lets go of the lock or posted a receive's
        # last messages (see _locked)
        self.moved = threading.Condition(threading.Lock())
        # irecvs handed to its helper thread, and whether it has one (see progress)
        self.todo: deque[Receive] = deque()
        self.helper = False
        self.stage: Optional[_Stage] = None  # a sender's frame buffer, reused
        # a receiver's last frame buffer on the fast path, received into again once its
        # result is dropped (see _unused): no page faults and warm caches, as torch's recv
        # into a tensor allocated once
        self.spare = _Spare()
        # a receiver's last tensor frame on the fast path: (head bytes before and after
        # the number, head, frame, dtype, dims), to build the next result while it comes
        self.guess: Optional[tuple[bytes, bytes, int, int, Any, tuple]] = None
        # the last message's tensor (see Meta), when it was one of at least
        # BARE_MIN bytes on a gloo group; and that, when the one before it was the same:
        # then the next message may be bare (see note)
        self.last: Optional[Meta] = None
        self.bare: Optional[Meta] = None

    def note(self, meta: Optional[Meta]) -> None:
        """Note a message's tensor (``None``: not a tensor that may go bare), at both ends
        alike, in the channel's order.

        After two tensors of one dtype and shape (of at least :data:`BARE_MIN` bytes, on
        a gloo group), the next message may go *bare*: when it is one more of them, the
        sender sends its bytes alone, straight from the tensor, and the receiver takes them
        into its result; no head, no copy. The receiver cannot tell how long a gloo message
        was, so before it posts the buffer it writes :data:`MARK` random bytes right behind
        where a bare message ends, and every other message is sent at least that long
        (padded with zeros): the mark found intact means the message was bare. Nothing a
        sender can send matches a mark it never saw, short of 16 random bytes."""
        self.bare = meta if meta is not None and meta == self.last else None
        self.last = meta


def channel(comm: Comm, way: str, peer: int, tag: int) -> Channel:
    """The channel of ``comm``'s group to (``way="send"``) or from ``peer`` on ``tag``."""
    assert comm._facts is not None, "a world of one rank has no channel"
    table = comm._facts.pairs
    found = table.get((way, peer, tag))
    if found is None:
        found = table[(way, peer, tag)] = Channel()
    return found


def exact(comm: Comm) -> bool:
    """Whether the group's backend needs a receive buffer of exactly the message's size
    (gloo takes a shorter message; NCCL and the others are taken to need it exact)."""
    return "gloo" not in (comm.backend_name or "")


def _round(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def capacity(history: deque[int], exact_sizes: bool) -> int:
    """The bytes of the first message of a channel's next frame (a pure function of the
    history, which both ends hold alike)."""
    least = layouts.P2P_MIN_CAPACITY
    if not history:
        return least
    top = _round(max(history))
    if exact_sizes and top > SMALL and top > STEADY * min(history):
        return least
    return max(top, least)


def first_bytes(ch: Channel, exact_sizes: bool) -> int:
    """The bytes of the first message of ``ch``'s next frame: its capacity, and when the
    message may be bare, at least a bare message and its mark."""
    cap = capacity(ch.history, exact_sizes)
    bare = ch.bare
    return cap if bare is None else max(cap, bare.nbytes + MARK)


def meta_of(comm: Comm, code: int, dims: tuple, nbytes: int) -> Optional[Meta]:
    """What :meth:`Channel.note` keeps of a tensor message (``None`` when it may not go
    bare: too small, or a group that is not gloo's on the CPU)."""
    if nbytes < BARE_MIN or not comm.cpu_home or exact(comm):
        return None
    return Meta(code, dims, nbytes, layouts.p2p_head_bytes(len(dims)) + nbytes)


def _marked(buf: Tensor, at: int) -> bytes:
    """Write a fresh mark into the CPU buffer ``buf`` at ``at``; the mark."""
    mark = os.urandom(MARK)
    ctypes.memmove(buf.data_ptr() + at, mark, MARK)
    return mark


def _copied(frame: int, buffer: int) -> bool:
    """Whether a tensor received in a frame of ``frame`` bytes is copied out of its
    ``buffer``-byte receive buffer (else it is a view of it): when it is less than half of
    a buffer larger than :data:`SMALL`, so it never keeps much more than itself alive."""
    return buffer > SMALL and 2 * frame < buffer


def _wire_tag(tag: int) -> int:
    return layouts.P2P_TAG_BASE + tag


# -- staging ---------------------------------------------------------------------------


def _contiguous(comm: Comm, t: Tensor) -> Tensor:
    """``t`` as it travels: untracked, contiguous, plain (conjugation and negation
    resolved), on the group's communication device."""
    t = t.detach() if t.requires_grad else t
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        if t.is_cpu and comm.cpu_home:
            return t
    return t.resolve_conj().resolve_neg().to(comm.device(t)).contiguous()


def _head(kind: int, head: int, frame: int, number: int, apart: int, code: int, dims: Any) -> bytes:
    """A frame's head (see :data:`~distkit.dist.core.layouts.P2P_HEAD`)."""
    raw = bytearray(head)
    ndim = len(dims) if kind == P2P_TENSOR else dims
    P2P_HEAD.pack_into(raw, 0, kind, head, frame, number, apart, code, ndim, 0)
    if kind == P2P_TENSOR and dims:
        struct.pack_into(f"<{len(dims)}q", raw, _HEAD_SIZE, *dims)
    return bytes(raw)


def _put(buf: Tensor, at: int, raw: Union[bytes, Tensor]) -> None:
    """Copy ``raw`` (bytes, or a contiguous uint8 tensor) into ``buf`` (uint8) at ``at``."""
    n = len(raw) if isinstance(raw, bytes) else raw.numel()
    if n == 0:
        return
    if buf.is_cpu and (isinstance(raw, bytes) or raw.is_cpu):
        source = raw if isinstance(raw, bytes) else raw.data_ptr()
        ctypes.memmove(buf.data_ptr() + at, source, n)
        return
    if isinstance(raw, bytes):
        raw = _wire.owned_bytes(raw)
    buf[at : at + n].copy_(raw)


# -- sending ---------------------------------------------------------------------------


class Outgoing(NamedTuple):
    """A send's messages, by the round of ``exchange`` they go in: the frame (cut to the
    capacity), the rest of the frame (or nothing), the parts apart."""

    rounds: tuple[list[Tensor], list[Tensor], list[Tensor]]
    frame_bytes: int
    error: Optional[Exception]  # the sender's failure: raised once the frame is out


#: Frames up to this size are built in a channel's reused buffer.
STAGE_BYTES = TENSOR_INLINE + 4096


def _staged(ch: Channel, size: int) -> _Stage:
    """The channel's frame buffer, of at least ``size`` bytes and read by no send."""
    stage = ch.stage
    if stage is None or stage.size < size or not stage.free():
        stage = ch.stage = _Stage(max(_round(size), layouts.P2P_MIN_CAPACITY))
    return stage


def _frame_buffer(comm: Comm, ch: Channel, size: int, reuse: bool) -> Tensor:
    """A uint8 buffer of ``size`` bytes for a frame on the group's device (the channel's
    own, on the CPU, for a tensor's frame)."""
    dev = comm.device()
    if not (reuse and dev.type == "cpu" and size <= STAGE_BYTES):
        return torch.empty(size, dtype=torch.uint8, device=dev)
    return _staged(ch, size).view(size)


class _Body(NamedTuple):
    """What a frame carries: its kind, its inline body, the parts apart, the head's
    ``apart, code, dims`` fields, and the sender's failure (raised once it is told)."""

    kind: int
    body: Any  # a uint8 tensor, bytes, or None
    apart: list[Tensor]
    fields: tuple[int, int, Any]
    error: Optional[Exception] = None


def _encoded(comm: Comm, data: Any, call: ObjectCall) -> _Body:
    if isinstance(data, Tensor):
        t = _contiguous(comm, data)
        flat = _wire.uint8_view(t)
        code = layouts.dtype_code(t.dtype)
        if flat.numel() <= TENSOR_INLINE:
            return _Body(P2P_TENSOR, flat, [], (0, code, tuple(t.shape)))
        return _Body(P2P_TENSOR, None, [flat], (1, code, tuple(t.shape)))
    dev = comm.device()
    on_cpu = dev.type == "cpu"
    try:
        enc = _wire.encode(data, call.name, call.fn, comm, None if on_cpu else dev, on_cpu)
    except Exception as exc:  # the receiver must hear of it, or wait forever
        text = _args.bare(exc, call.fn, comm).encode()[:65536]  # as the receiver says it
        return _Body(P2P_FAILED, text, [], (0, _args.error_code(exc), len(text)), exc)
    parts = list(enc.apart) + ([enc.dev] if enc.dev is not None else [])
    return _Body(P2P_OBJECT, enc.cpu, parts, (len(parts), 0, 0))


def build(comm: Comm, data: Any, ch: Channel, number: int, call: ObjectCall) -> Outgoing:
    """The messages that send ``data`` as message ``number`` of channel ``ch``."""
    kind, body, apart, (n_apart, code, dims), error = _encoded(comm, data, call)
    meta = None
    if kind == P2P_TENSOR:
        flat = body if body is not None else apart[0]
        meta = meta_of(comm, code, dims, flat.numel())
        if meta is not None and meta == ch.bare:  # bare: its bytes alone, no copy
            ch.note(meta)
            return Outgoing(([flat], [], []), meta.frame, None)
    head_bytes = layouts.p2p_head_bytes(len(dims) if kind == P2P_TENSOR else 0)
    body_bytes = 0 if body is None else len(body) if isinstance(body, bytes) else body.numel()
    frame_bytes = head_bytes + body_bytes
    needs_exact = exact(comm)
    cap = first_bytes(ch, needs_exact)
    # at least the receiver's capacity where it needs exact sizes, and past the mark
    # where the message might have been bare
    least = cap if needs_exact else 0 if ch.bare is None else ch.bare.nbytes + MARK
    size = max(frame_bytes, least)
    buf = _frame_buffer(comm, ch, size, kind == P2P_TENSOR)
    _put(buf, 0, _head(kind, head_bytes, frame_bytes, number, n_apart, code, dims))
    if body is not None:
        _put(buf, head_bytes, body)
    if size > frame_bytes:  # padding: zeros, never stale bytes
        buf[frame_bytes:].zero_()
    ch.note(meta)
    first = buf[: min(size, cap)]
    rest = [buf[cap:frame_bytes]] if frame_bytes > cap else []
    return Outgoing(([first], rest, apart), frame_bytes, error)


def _post(comm: Comm, sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]], tag: int):
    """Post sends and receives (``(bytes, peer)`` pairs) together; their works in order."""
    pg, wire = comm.pg, _wire_tag(tag)
    assert pg is not None
    if exact(comm) and len(sends) + len(recvs) > 1:
        ops = [td.P2POp(td.isend, t, comm.global_rank(p), pg, wire) for t, p in sends]
        ops += [td.P2POp(td.irecv, t, comm.global_rank(p), pg, wire) for t, p in recvs]
        return list(td.batch_isend_irecv(ops))
    # what torch.distributed.isend/irecv do after their own checks (the tensors are
    # contiguous uint8 on the group's device; the peers are group ranks)
    works = [pg.send([t], p, wire) for t, p in sends]
    return works + [pg.recv([t], p, wire) for t, p in recvs]


# -- receiving -------------------------------------------------------------------------


class Receive:
    """One message coming from a channel: its frame, the rest of it, its parts apart."""

    __slots__ = (
        "buf",
        "call",
        "cap",
        "ch",
        "comm",
        "error",
        "head",
        "mark",
        "number",
        "parts",
        "raw",
        "result",
        "src",
        "stage",
        "tag",
        "works",
    )

    def __init__(
        self,
        comm: Comm,
        src: int,
        tag: int,
        number: int,
        call: ObjectCall,
        ch: Optional[Channel] = None,
    ) -> None:
        self.comm = comm
        self.src = src
        self.tag = tag
        self.number = number
        self.call = call
        self.ch = ch if ch is not None else channel(comm, "recv", src, tag)
        self.stage = 0  # the last stage posted (FRAME ... DONE)
        self.works: list[Any] = []  # of that stage
        self.buf: Optional[Tensor] = None
        self.cap = 0
        self.head: tuple = ()
        self.mark = b""  # behind where a bare message would end (see Channel.note)
        self.parts: list[Tensor] = []
        self.result: Any = None
        #: what ended a wait for its messages (in whichever thread): raised again by the
        #: next one, which must not wait for those works a second time
        self.error: Optional[BaseException] = None
        self.raw = False  # error is a helper thread's, not yet told as the caller's

    @property
    def op(self) -> Op:
        return Op("recv", self.src, self.tag, self.number)

    def next_buffers(self) -> list[Tensor]:
        """The buffers of the next stage's messages, once this stage's arrived (empty: a
        stage with no message)."""
        if self.stage == 0:
            self.cap = first_bytes(self.ch, exact(self.comm))
            self.buf = torch.empty(self.cap, dtype=torch.uint8, device=self.comm.device())
            if self.ch.bare is not None:
                self.mark = _marked(self.buf, self.ch.bare.nbytes)
            self.stage = FRAME
            return [self.buf]
        if self.stage == FRAME:
            self.stage = REST
            return self._frame_arrived()
        if self.stage == REST:
            self.stage = PARTS
            return self._parts()
        self.stage = DONE
        self.result = self._finish()
        return []

    def _read(self, at: int, n: int) -> bytes:
        assert self.buf is not None
        if self.buf.is_cpu:
            return ctypes.string_at(self.buf.data_ptr() + at, n)
        return bytes(self.buf[at : at + n].cpu().tolist())

    def _broken(self, what: str) -> RuntimeError:
        facts = self.comm._facts
        me = self.comm.rank
        text = (
            f"{self.call.fn}: rank {self.src} sent a message this rank cannot read as its "
            f"message #{self.number} on tag {self.tag}: {what} (on rank {me} of "
            f"{self.comm.size}). The two ranks are out of step (a message was not received, "
            "or a process that is not distkit sent on its tag)"
        )
        if facts is not None:
            facts.broken = f"point-to-point messages from rank {self.src} came out of step"
        return RuntimeError(text)

    def _frame_arrived(self) -> list[Tensor]:
        assert self.buf is not None
        bare = self.ch.bare
        if self.mark and bare is not None and self._read(bare.nbytes, MARK) == self.mark:
            code, dims, nbytes, _ = bare  # a bare message: its tensor's bytes alone
            dtype = layouts.code_dtype(code)
            self.head = (P2P_TENSOR, 0, nbytes, self.number, 0, code, len(dims), 0, dtype, dims)
            self.ch.history.append(bare.frame)
            return []
        self.mark = b""
        head = P2P_HEAD.unpack(self._read(0, _HEAD_SIZE))
        kind, head_bytes, frame_bytes, number, apart = head[:5]
        if number != self.number:
            raise self._broken(f"its head says message #{number}")
        if kind not in (P2P_TENSOR, P2P_OBJECT, P2P_FAILED) or not (
            _HEAD_SIZE <= head_bytes <= frame_bytes and head_bytes % ALIGN == 0 and apart >= 0
        ):
            raise self._broken(f"a malformed head {head}")
        self.head = head
        self.ch.history.append(frame_bytes)
        if frame_bytes <= self.cap:
            return []
        full = torch.empty(frame_bytes, dtype=torch.uint8, device=self.buf.device)
        full[: self.cap].copy_(self.buf)
        self.buf = full
        return [full[self.cap :]]

    def _parts(self) -> list[Tensor]:
        """The buffers of the parts sent apart, as the whole frame says."""
        if self.mark:  # a bare message: all of it came
            return []
        kind, head_bytes, frame_bytes, _, apart, code, ndim, _ = self.head
        dev = self.comm.device()
        if kind != P2P_TENSOR:
            self.ch.note(None)
        if kind == P2P_TENSOR:
            if ndim < 0 or head_bytes < layouts.p2p_head_bytes(ndim):
                raise self._broken(f"a tensor head of {ndim} dims in {head_bytes} bytes")
            dims = struct.unpack(f"<{ndim}q", self._read(_HEAD_SIZE, 8 * ndim)) if ndim else ()
            try:
                dtype = layouts.code_dtype(code)
            except TypeError as exc:
                raise self._broken(str(exc)) from None
            numel = 1
            for d in dims:
                numel *= d
            inline = frame_bytes - head_bytes
            nbytes = numel * dtype.itemsize
            fits = (apart == 0 and inline == nbytes) or (apart == 1 and inline == 0)
            if min(dims, default=0) < 0 or not fits:
                raise self._broken(f"a {dtype} tensor of shape {dims} in {frame_bytes} bytes")
            self.head = (*self.head, dtype, tuple(dims))
            self.ch.note(meta_of(self.comm, code, tuple(dims), nbytes))
            if apart:
                out = torch.empty(dims, dtype=dtype, device=dev)
                self.parts = [out]
                return [_wire.uint8_view(out)]
            return []
        if kind == P2P_OBJECT:
            cpu = self._body()
            try:
                sizes, dev_bytes = _wire.apart_sizes(cpu)
            except Exception as exc:
                raise self._broken(str(exc)) from None
            if len(sizes) + int(dev_bytes > 0) != apart:
                raise self._broken(f"{apart} parts apart announced, {len(sizes)} in its table")
            self.parts = [torch.empty(n, dtype=torch.uint8, device="cpu") for n in sizes]
            if dev_bytes:
                self.parts.append(torch.empty(dev_bytes, dtype=torch.uint8, device=dev))
            return list(self.parts)
        return []

    def _body(self) -> Tensor:
        assert self.buf is not None
        _, head_bytes, frame_bytes = self.head[:3]
        body = self.buf[head_bytes:frame_bytes]
        return body if body.is_cpu else body.cpu()

    def _finish(self) -> Any:
        kind, head_bytes, frame_bytes, _, apart, code, ndim = self.head[:7]
        comm, call = self.comm, self.call
        if kind == P2P_TENSOR:
            if apart:
                return self.parts[0]
            dtype, dims = self.head[8:10]
            assert self.buf is not None
            body = self.buf[head_bytes:frame_bytes]
            if _copied(frame_bytes, self.buf.numel()):  # a small part of a large buffer
                body = body.clone()  # memory of its own: it keeps nothing else alive
            return body.view(dtype).view(dims)
        if kind == P2P_OBJECT:
            cpu = self._body()
            dev = None
            apart_cpu = self.parts
            if self.parts and self.parts[-1].device != cpu.device:
                dev, apart_cpu = self.parts[-1], self.parts[:-1]
            enc = _wire.Encoded(cpu, dev, tuple(apart_cpu))
            return _wire.decode(enc, call.map_location, call.serializer, self.src, call.fn, comm)
        text = self._read(head_bytes, min(ndim, frame_bytes - head_bytes))
        _args.remote_failure(
            code,
            call.fn,
            comm,
            f"rank {self.src} could not send its object: {text.decode(errors='replace')}",
        )


def _wait(comm: Comm, public: str, op: Op, works: list[Any], timeout: Any = None) -> None:
    """Wait for ``works`` (of ``op``), naming the peer when they time out or it went away
    (the group cannot be used any more after that: the pair is out of step)."""
    try:
        for w in works:
            if timeout is None:
                w.wait()
            else:
                w.wait(timeout)
    except Exception as exc:
        _raise_failure(comm, public, op, exc)
        raise


def _raise_failure(comm: Comm, public: str, op: Op, exc: BaseException) -> None:
    """Raise what ``exc`` (the backend's, waiting for or posting ``op``) means when it
    says the peer went away (:class:`RankGoneError`: nothing more comes from it, and the
    ranks still there may go on exchanging messages) or the wait timed out (the group
    cannot be used any more after that: the message may still arrive, and the pair is out
    of step); return for any other error."""
    better = pairs.failure(comm, public, op, exc)
    if better is None:
        return
    if isinstance(better, CollectiveTimeoutError):  # say what it leaves behind
        facts = comm._facts
        if facts is not None:
            facts.broken = f"a point-to-point {pairs.describe(op)} timed out"
        better = CollectiveTimeoutError(
            f"{better}\n{_BROKEN_AFTER}", better.missing, better.reports
        )
    raise better from exc


def _refused(comm: Comm, public: str, kind: str, peer: int, tag: int, exc: BaseException) -> None:
    """:func:`_raise_failure` for a message the backend refused to post (gloo refuses
    one to or from a rank that exited: the connection is closed)."""
    _raise_failure(comm, public, Op(kind, peer, tag, _tentative(comm, kind, peer, tag)), exc)


#: What a point-to-point timeout leaves behind (a wait(timeout=...) used to poll too).
_BROKEN_AFTER = (
    "The group cannot be used any more: the message may still arrive, and its ranks would "
    "be out of step. Start a new world (dist.destroy_dist(), then dist.init_dist()), or use "
    "another group (a wait(timeout=...) is a deadline, not a way to poll)."
)


def _advance(rcv: Receive, block: bool, public: str, timeout: Any = None) -> bool:
    """Post ``rcv``'s next stage once its current one arrived (waiting for it if
    ``block``); whether it moved."""
    helper = getattr(_helper, "on", False)
    if rcv.error is not None:
        if rcv.raw and not helper:  # a helper's wait failed: said here, for the caller
            rcv.raw = False
            try:
                _wait(rcv.comm, public, rcv.op, [_Failed(rcv.error)])
            except BaseException as exc:
                rcv.error = exc
        raise rcv.error
    try:
        if rcv.works:
            if block and helper:  # no timeout of its own: the caller's wait has it
                for w in rcv.works:  # (see _locked)
                    w.wait(_FOREVER)
            elif block:
                _wait(rcv.comm, public, rcv.op, rcv.works, timeout)
            elif not all(w.is_completed() for w in rcv.works):
                return False
            rcv.works = []
        bufs = rcv.next_buffers()
        if bufs:
            try:
                rcv.works = _post(rcv.comm, [], [(b, rcv.src) for b in bufs], rcv.tag)
            except Exception as exc:
                if not helper:  # (a helper's error is said by the caller's wait, above)
                    _raise_failure(rcv.comm, public, rcv.op, exc)
                raise
    except BaseException as exc:
        rcv.error, rcv.raw = exc, helper
        raise
    return True


def _drive(rcv: Receive, block: bool, public: str, timeout: Any = None) -> None:
    """Post the messages of the receives queued on ``rcv``'s channel in order, up to all
    of ``rcv``'s (the frame of a receive goes only once the one before it has posted
    every message: its capacity comes from that one's frame)."""
    ch = rcv.ch
    if not _locked(rcv, block, public, timeout):
        return  # another thread drives the channel now (see progress)
    try:
        while ch.queue:
            first = ch.queue[0]
            if first.stage >= PARTS:
                ch.queue.popleft()
                with ch.moved:
                    ch.moved.notify_all()
                continue
            if first.stage == 0:
                _advance(first, False, public)
                continue
            if first is not rcv and (not block or rcv not in ch.queue):
                # a later receive (``rcv`` has posted all of its messages): posted, never
                # waited for here, as its message may come only after this one is used
                if not _advance(first, False, public):
                    return
                continue
            if not _advance(first, block, public, timeout):
                return
            if rcv not in ch.queue:
                return
    finally:
        ch.lock.release()
        with ch.moved:
            ch.moved.notify_all()


def _locked(rcv: Receive, block: bool, public: str, timeout: Any) -> bool:
    """Take ``rcv``'s channel for this thread, at once or (``block``) once the thread
    driving it lets go; ``False`` when it is taken (not ``block``), or when that thread
    posted every message of ``rcv`` meanwhile (then there is nothing to drive: a helper
    thread (see :func:`progress`) may hold the lock while it waits for a later receive's
    frame, which may come only once ``rcv`` is used). A ``timeout`` that passes first
    fails as a wait for the message would
    (:class:`~distkit.dist.errors.CollectiveTimeoutError`)."""
    ch = rcv.ch
    if ch.lock.acquire(blocking=False):
        return True
    if not block:
        return False
    if timeout is None:  # the group's, as the backend's own wait would take
        timeout = group_timeout(rcv.comm.pg) or _DEFAULT_TIMEOUT
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    deadline = time.monotonic() + seconds
    with ch.moved:
        while True:
            if _posted(rcv):
                return False
            if ch.lock.acquire(blocking=False):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ch.moved.wait(left)
    late = RuntimeError(f"Timed out waiting {int(seconds * 1000)}ms for recv operation to complete")
    _wait(rcv.comm, public, rcv.op, [_Failed(late)])
    raise late  # (_wait raised already)


class _Failed:
    """A work that failed with ``error`` (for :func:`_wait` to report it as its own)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def wait(self, timeout: Any = None) -> bool:
        raise self.error


def serve(gid: str, group: list[int], kind: str, peer: int, tag: int, number: int) -> str:
    """What this rank did of message ``number`` on ``tag`` that ``peer`` waits for on the
    group ``gid`` (its members' global ranks ``group``; ``peer`` global too), its side
    being ``kind``; asked by the default check (:mod:`distkit.dist.guard.check`) while
    this thread waits in a collective for ``peer``.

    ``"missing"`` when this rank has not posted its side of it: then the peer cannot
    finish (a deadlock). ``"served"`` when this rank's receives from ``peer`` up to that
    message had messages left to post, now posted: a receive posts its messages after
    the frame in this rank's next call on the pair, and the sending peer waits for them
    (an ``irecv`` waited for after a collective with its sender). Else ``"posted"`` (a
    group this rank does not know is never called missing)."""
    facts = next((f for f in list(_FACTS.values()) if f.gid == gid and f.ref() is not None), None)
    if facts is None or peer not in group:
        return "posted"
    p = group.index(peer)
    if kind == "recv":  # the peer receives what this rank sends
        ch = facts.pairs.get(("send", p, tag))
        return "posted" if ch is not None and ch.count >= number else "missing"
    ch = facts.pairs.get(("recv", p, tag))
    if ch is None or ch.count < number:
        return "missing"
    for rcv in list(ch.queue):
        # (batched rounds, on backends of exact sizes, post their messages in their call)
        if rcv.number == number and rcv.stage < PARTS and not exact(rcv.comm):
            _drive(rcv, True, rcv.call.fn)  # the peer sends it now: no wait for ever
            return "served"
    return "posted"


_check.serve_p2p = serve


def receive(comm: Comm, src: int, tag: int, number: int, call: ObjectCall) -> Receive:
    """Queue a receive of message ``number`` from ``src`` on ``tag``; its frame is posted
    at once when nothing is queued before it on the channel."""
    rcv = Receive(comm, src, tag, number, call)
    rcv.ch.count = number
    rcv.ch.queue.append(rcv)
    _drive(rcv, False, call.fn)
    return rcv


def _posted(rcv: Receive) -> bool:
    """Whether every message of ``rcv`` is posted and it left its channel's queue: from
    then on only the thread that waits for it touches it. (Its stage alone does not say
    so: a helper thread moves it to ``PARTS`` before the parts' buffers and receives
    exist, and takes it off the queue only once they do.)"""
    return rcv.stage >= PARTS and rcv not in rcv.ch.queue


def finish(rcv: Receive, public: str, timeout: Any = None) -> Any:
    """Wait for every message of ``rcv`` and return what was sent."""
    while rcv.stage < DONE:
        if not _posted(rcv):
            _drive(rcv, True, public, timeout)
        else:
            _advance(rcv, True, public, timeout)
    return rcv.result


def done(rcv: Receive, public: str) -> bool:
    """Whether ``rcv`` can finish without waiting (posting what it can meanwhile)."""
    if not _posted(rcv):
        _drive(rcv, False, public)
        if not _posted(rcv):
            return False
    return rcv.stage == DONE or all(w.is_completed() for w in rcv.works)


# -- progress ----------------------------------------------------------------------------
#
# A receive posts its frame at once; the rest of a large frame, the parts sent apart and
# the next queued receive's frame can only be posted once that frame arrived, and the
# sender's blocking ``send`` waits for them. Left to this rank's next call on the pair, an
# ``irecv`` waited for after a collective with its sender would hang (the sender in
# ``send``, this rank in the collective), where torch's own ``irecv`` (one message into a
# buffer of known size) completes. So each ``irecv`` of a CPU group of gloo is handed to
# a helper thread of its channel, which waits for its frame and posts what follows, as a
# blocking ``wait`` would; the caller's ``wait`` then finds it posted (or waits until the
# helper posted it) and waits for the last messages and decodes the result itself. gloo
# offers no other way to learn that a message arrived: a receive's ``is_completed()`` stays
# False until something waits for it, and a work is never waited for twice.
#
# At exit, a thread left inside gloo's wait (an irecv whose message never came) would be
# stopped mid-wait once the interpreter finalizes if the peer's exit woke it then, and the
# process would abort ("terminate called without an active exception"). So the exit says
# which receive is unfinished and waits up to EXIT_WAIT seconds for the peer to send it or
# to exit (the usual case: both ranks end together, and the wait ends while Python is
# whole), EXIT_TEARDOWN seconds more for a peer of a lower rank: of two ranks that each
# wait for the other (or a ring of them), the lower one leaves first, its exit wakes the
# other's helper while that one still waits, and the other leaves only once the first is
# gone. The first one's exit (its own wait, then torch's teardown) took over 4 s on a
# loaded machine: the wait ends as soon as the peer is gone, so a long bound costs only
# an exit whose peer does not exit at all.

#: Marks a helper thread (``_helper.on``): its waits take no timeout of their own, and
#: their errors are told by the caller's wait, as the caller's (its call site, its peer)
_helper = threading.local()
#: A wait that does not end before its message or its peer's end ("wait(timeout)" that
#: times out leaves a gloo work failed: the helper never lets one time out)
_FOREVER = timedelta(days=30)
#: The backend's timeout when a group does not say its own (torch's default)
_DEFAULT_TIMEOUT = timedelta(minutes=30)

#: Seconds an exit waits for the peer of an unfinished ``irecv`` (see above).
EXIT_WAIT = 2.0
#: Seconds more for a peer of a lower rank: its own exit's wait, then its teardown.
EXIT_TEARDOWN = 10.0
#: Seconds a channel's helper thread waits for its next ``irecv`` before it ends.
LINGER = 1.0
_helping = threading.Condition(threading.Lock())
_unposted: list[Receive] = []  # handed to helpers, their messages not all posted yet
_at_exit_set: list[bool] = []


def progress(rcv: Receive) -> None:
    """Have a helper thread of ``rcv``'s channel post its messages once they are known.

    One thread per channel, while it has ``irecv``s: a receive that never comes (its
    sender gone, or never sending) then holds up its own channel only."""
    ch = rcv.ch
    with _helping:
        ch.todo.append(rcv)
        _unposted.append(rcv)
        if ch.helper:
            _helping.notify_all()
            return
        ch.helper = True
        if not _at_exit_set:
            _at_exit_set.append(True)
            atexit.register(_at_exit)
    name = f"distkit-irecv-{rcv.src}-tag{rcv.tag}"
    threading.Thread(target=_help, args=(ch,), name=name, daemon=True).start()


def _help(ch: Channel) -> None:
    """A channel's helper: drive each ``irecv`` handed to it, in order."""
    _helper.on = True
    while True:
        with _helping:
            until = time.monotonic() + LINGER
            while not ch.todo:
                left = until - time.monotonic()
                if left <= 0:
                    ch.helper = False
                    return
                _helping.wait(left)
            rcv = ch.todo.popleft()
        try:
            if rcv.stage < PARTS and rcv.error is None:
                _drive(rcv, True, rcv.call.fn)
        except BaseException:  # kept on the receive (Receive.error): its wait raises it
            pass
        finally:
            with _helping:
                _unposted.remove(rcv)
                _helping.notify_all()


def _at_exit() -> None:
    with _helping:
        if not _unposted:
            return
        waiting = list(_unposted)
    ranks = []
    for rcv in waiting:
        try:
            ranks.append((rcv.comm.global_rank(rcv.comm.rank), rcv.comm.global_rank(rcv.src)))
        except Exception:  # its group was destroyed: its own ranks, then
            ranks.append((rcv.comm.rank, rcv.src))
    # of two ranks that each wait for the other, the lower one leaves first and the other
    # is still waiting (Python whole) when that exit wakes its helper
    me, peer = ranks[0]
    seconds = EXIT_WAIT + (EXIT_TEARDOWN if any(p < m for m, p in ranks) else 0.0)
    rcv = waiting[0]
    # a destroyed group's receive can never be sent: its helper still waits inside gloo
    # until the peer's exit wakes it, which must happen while Python is whole
    awaited = (
        f"its group was destroyed, so it never will; waiting up to {seconds:g} s for rank "
        f"{peer} to exit. Wait for every irecv before destroy_dist"
        if rcv.comm.pg is not None and not is_registered(rcv.comm.pg)
        else f"waiting up to {seconds:g} s for rank {peer} to send it or exit. Wait for "
        "every irecv before exiting"
    )
    print(
        f"distkit: rank {me} exits while its {rcv.call.fn} of message #{rcv.number} from "
        f"rank {peer} (tag {rcv.tag}) has not received it; {awaited}",
        file=sys.stderr,
        flush=True,
    )
    until = time.monotonic() + seconds
    with _helping:
        while _unposted and time.monotonic() < until:
            _helping.wait(until - time.monotonic())


# -- the fast path -----------------------------------------------------------------------
#
# A blocking send of a CPU tensor, and a blocking receive, on a gloo group outside debug
# mode: what a pipeline stage does every step, in few steps. Between two gloo calls the
# process was blocked and every layer of Python runs cold: each step skipped here saved
# microseconds (the general path costs 50 to 80 us more per message on this project's
# machine). The messages are the general path's, byte for byte.

_HEADS = [layouts.p2p_head_bytes(n) for n in range(64)]
_DIMS = [struct.Struct(f"<{n}q") for n in range(64)]
_CODES, _DTYPES = layouts.CODES, layouts.DTYPES
_TENSOR = Tensor


def _fast(comm: Comm) -> bool:
    return comm.cpu_home and not exact(comm) and not pairs.debugging()


class _Unstaged:
    """What a bare send has instead of a stage: nothing to free."""

    __slots__ = ("works",)

    def __init__(self) -> None:
        self.works: list[Any] = []


_NO_STAGE = _Unstaged()


def _quick_send(
    comm: Comm, data: Any, dst: int, tag: int
) -> Optional[tuple[Op, list, Union[_Stage, _Unstaged]]]:
    """Post ``data`` to ``dst`` if it takes the fast path: ``(op, works, its buffer)``."""
    if (
        data.__class__ is not _TENSOR
        or not data.is_cpu
        or data.requires_grad
        or not data.is_contiguous()
        or data.is_conj()
        or data.is_neg()
    ):
        return None
    ndim = data.dim()
    nbytes = data.numel() * data.element_size()
    code = _CODES.get(data.dtype)
    ch = channel(comm, "send", dst, tag)
    number = ch.count + 1
    pg, wire = comm.pg, layouts.P2P_TAG_BASE + tag
    assert pg is not None
    bare = ch.bare
    if bare is not None and bare.code == code and bare.nbytes == nbytes and bare.dims == data.shape:
        # bare: the tensor's bytes alone, straight from it (see Channel.note)
        works = [pg.send([data], dst, wire)]  # (gloo sends bytes, whatever the dtype)
        ch.count = number
        ch.history.append(bare.frame)
        return Op("send", dst, tag, number), works, _NO_STAGE
    if ndim >= len(_HEADS) or nbytes > TENSOR_INLINE or code is None:
        return None
    if bare is not None and bare.nbytes + MARK > STAGE_BYTES:
        return None  # padded past a large run: a buffer of its own (see _frame_buffer)
    head = _HEADS[ndim]
    frame = head + nbytes
    cap = first_bytes(ch, False)
    size = frame if bare is None else max(frame, bare.nbytes + MARK)  # past the mark
    stage = _staged(ch, size)
    P2P_HEAD.pack_into(stage.raw, 0, P2P_TENSOR, head, frame, number, 0, code, ndim, 0)
    if ndim:
        _DIMS[ndim].pack_into(stage.raw, _HEAD_SIZE, *data.shape)
    if nbytes:
        ctypes.memmove(stage.ptr + head, data.data_ptr(), nbytes)
    if size > frame:  # padding: zeros, never stale bytes
        stage.tensor[frame:size].zero_()
    if size <= cap:
        works = [pg.send([stage.view(size)], dst, wire)]
    else:  # larger than the channel's last frames: the rest in a second message
        rest = stage.tensor[cap:frame]
        works = [pg.send([stage.view(cap)], dst, wire), pg.send([rest], dst, wire)]
    ch.count = number
    ch.history.append(frame)
    ch.note(meta_of(comm, code, tuple(data.shape), nbytes))
    stage.works = works
    return Op("send", dst, tag, number), works, stage


def send_fast(comm: Comm, data: Any, dst: int, tag: int, public: str) -> bool:
    """Send ``data`` now if it takes the fast path; whether it did."""
    if not _fast(comm):
        return False
    try:
        posted = _quick_send(comm, data, dst, tag)
    except Exception as exc:
        _refused(comm, public, "send", dst, tag, exc)
        raise
    if posted is None:
        return False
    op, works, stage = posted
    _wait_noted(comm, public, op, works)
    stage.works = []
    return True


def _wait_noted(comm: Comm, public: str, op: Op, works: list[Any]) -> None:
    """:func:`_wait`, with the watchdog told that this thread waits for ``op``."""
    table = comm._facts.p2p if comm._facts is not None else {}
    key = next(pairs.tokens)
    table[key] = (public, (op.peer,), op.tag, get_ident(), (op,))
    try:
        _wait(comm, public, op, works)
    finally:
        del table[key]


class _Quick:
    """A receive on the fast path, inside a blocking call: its frame posted, and its
    result built while it comes, as a tensor of the dtype and shape of the channel's last
    one (a pipeline's activations mostly are): when the head says so, nothing is left to
    do once it arrived."""

    __slots__ = (
        "buf",
        "call",
        "cap",
        "ch",
        "comm",
        "expected",
        "mark",
        "number",
        "src",
        "tag",
        "view",
        "work",
    )

    def __init__(
        self, comm: Comm, src: int, tag: int, call: Optional[ObjectCall], ch: Channel
    ) -> None:
        self.comm, self.src, self.tag, self.call, self.ch = comm, src, tag, call, ch
        self.number = ch.count + 1
        self.cap = first_bytes(ch, False)
        buf = _unused(ch, self.cap)
        if buf is None:
            buf = torch.empty(self.cap, dtype=torch.uint8, device="cpu")
        self.buf = buf
        bare = ch.bare
        self.mark = b"" if bare is None else _marked(buf, bare.nbytes)
        pg = comm.pg
        assert pg is not None
        self.work: Any = pg.recv([self.buf], src, layouts.P2P_TAG_BASE + tag)
        ch.count = self.number
        self.view: Optional[Tensor] = None
        self.expected = b""
        guess = ch.guess
        if bare is not None:  # built while it comes, as for a guess
            code, dims, nbytes, _ = bare
            self.view = buf[:nbytes].view(_DTYPES[code]).view(dims)
        elif guess is not None and guess[3] <= self.cap and not _copied(guess[3], self.cap):
            before, after, head, frame, dtype, dims = guess
            self.expected = before + _NUMBER.pack(self.number) + after
            self.view = self.buf[head:frame].view(dtype).view(dims)

    @property
    def op(self) -> Op:
        return Op("recv", self.src, self.tag, self.number)


def _quick_recv(comm: Comm, src: int, tag: int, call: Optional[ObjectCall]) -> Optional[_Quick]:
    """Post a receive from ``src`` on the fast path (nothing queued before it)."""
    ch = channel(comm, "recv", src, tag)
    if ch.queue:
        return None  # receives posted before this one come first
    return _Quick(comm, src, tag, call, ch)


def _quick_result(q: _Quick, public: str) -> Any:
    """What came, once ``q``'s frame arrived."""
    buf, ch, cap, number = q.buf, q.ch, q.cap, q.number
    ptr = buf.data_ptr()
    bare = ch.bare
    if q.mark and bare is not None and ctypes.string_at(ptr + bare.nbytes, MARK) == q.mark:
        ch.history.append(bare.frame)  # bare: its bytes alone (see Channel.note)
        ch.spare.buf = buf  # the result is a view of it: free again once that is dropped
        view = q.view
        assert view is not None
        return view.clone() if _copied(bare.nbytes, cap) else view
    guess = ch.guess
    if (
        not q.mark
        and q.view is not None
        and guess
        and ctypes.string_at(ptr, len(q.expected)) == q.expected
    ):
        ch.history.append(guess[3])
        ch.note(meta_of(q.comm, _CODES[guess[4]], guess[5], guess[3] - guess[2]))
        ch.spare.buf = buf  # the result is a view of it: free again once that is dropped
        return q.view
    kind, head, frame, got, apart, code, ndim, _ = P2P_HEAD.unpack(ctypes.string_at(ptr, 64))
    if (
        kind == P2P_TENSOR
        and apart == 0
        and got == number
        and frame <= cap
        and 0 <= ndim < len(_HEADS)
        and head == _HEADS[ndim]
        and code in _DTYPES
    ):
        dtype = _DTYPES[code]
        raw = ctypes.string_at(ptr, head)
        dims = _DIMS[ndim].unpack_from(raw, _HEAD_SIZE)
        numel = 1
        for d in dims:
            numel *= d
        if numel * dtype.itemsize == frame - head and min(dims, default=0) >= 0:
            ch.history.append(frame)
            ch.note(meta_of(q.comm, code, dims, frame - head))
            ch.guess = (raw[:24], raw[32:], head, frame, dtype, dims)
            body = buf[head:frame]
            if _copied(frame, cap):  # a small part of a large buffer: memory of its own
                body = body.clone()
            ch.spare.buf = buf
            return body.view(dtype).view(dims)
    ch.guess = None  # anything else: the general path reads the frame again
    call = q.call if q.call is not None else call_of(public, q.comm)
    rcv = Receive(q.comm, q.src, q.tag, number, call, ch)
    rcv.cap, rcv.buf, rcv.stage = cap, buf, FRAME
    ch.queue.append(rcv)
    return finish(rcv, public)


# -- the lanes ---------------------------------------------------------------------------
#
# ``send(t, dst)`` and ``recv(src)`` with every default, on a gloo group outside debug
# mode: the public functions' shortcuts (:mod:`distkit.dist.core.shortcut`) call these
# instead of resolving the group and checking each argument, as ``all_reduce(t)`` takes
# :func:`distkit.dist.backends.tensors._all_reduce_lane`. Between two blocking messages
# every layer of Python runs cold: the checked path's layers cost a 1 MiB message about
# 30 us before it leaves (10 % of its time on this project's machine). Each condition
# below is a plain attribute test; when one fails the lane returns :data:`MISS` and the
# checked path runs, which raises what needs raising (a lane raises no argument error of
# its own). The lanes keep what the watched backend gives every call: the thread that
# holds the group (when another does, the checked path says so), the watchdog's note of
# the wait, errors that name the peer; under a profile, the checked path runs (it records
# the call). The messages are the checked path's, byte for byte.

#: What a lane returns when the call needs the checked path.
MISS = object()
_STRIDED = torch.strided
_has_torch_function = has_torch_function_unary


def _lane_comm(pg: Any, peer: int) -> Optional[Comm]:
    """The group ``pg`` as a lane takes it, holding it for this thread, or ``None`` when
    the call needs the checked path (``peer``, an int, is out of range or this rank, or
    anything else the fast path does not do)."""
    if (
        is_compiling()
        or in_compiled_eager()
        or getattr(_local, "depth", False)
        or _record.active is not None
    ):
        return None  # traced or under torch.compile's hook, inside another call, or
        # recorded: the checked path
    facts = _FACTS.get(id(pg))
    if (
        facts is None  # a group the checked path has not met yet, or none at all
        or facts.ref() is not pg
        or facts.broken
        or facts.backend is None
        or peer == facts.rank
        or not 0 <= peer < facts.size
    ):
        return None
    comm = Comm(pg, facts.rank, facts.size, facts.backend, facts)
    if not _fast(comm):
        return None  # an accelerator's group, exact sizes, debug mode: the checked path
    me = get_ident()
    if facts.thread and facts.thread != me:
        return None  # another thread is in a call on it: the checked path says so
    facts.thread = me  # Comm.enter of a point-to-point call, inlined
    return comm


def send_lane(data: Any, dst: int, pg: Any) -> Any:
    """``send(data, dst)`` on the default group ``pg``: ``None`` once sent, or
    :data:`MISS`."""
    comm = _lane_comm(pg, dst) if data.__class__ is _TENSOR else None
    if comm is None:
        return MISS
    facts = comm._facts
    try:
        posted = (
            None
            if data.layout is not _STRIDED  # sparse, MKL-DNN: the checked path says so
            or data.is_nested
            or _has_torch_function is None
            or _has_torch_function(data)  # a torch function mode is active
            else _quick_send(comm, data, dst, 0)
        )
        if posted is None:
            return MISS  # a large tensor, an exotic one: the checked path
        op, works, stage = posted
        _wait_noted(comm, "send", op, works)
        stage.works = []
    except Exception as exc:  # (the wait's errors come said already: left as they are)
        _refused(comm, "send", "send", dst, 0, exc)
        raise
    finally:
        facts.thread = 0  # type: ignore[union-attr]
    return None


def recv_lane(src: int, pg: Any) -> Any:
    """``recv(src)`` on the default group ``pg``: what was sent, or :data:`MISS`."""
    comm = _lane_comm(pg, src)
    if comm is None:
        return MISS
    facts = comm._facts
    try:
        q = _quick_recv(comm, src, 0, None)  # (its call is made once needed)
        if q is None:
            return MISS  # receives posted before it come first: the checked path
        _wait_noted(comm, "recv", q.op, [q.work])
        return _quick_result(q, "recv")
    except Exception as exc:  # (the wait's errors come said already: left as they are)
        _refused(comm, "recv", "recv", src, 0, exc)
        raise
    finally:
        facts.thread = 0  # type: ignore[union-attr]


_CALLS: dict[tuple[str, str], ObjectCall] = {}


def call_of(fn: str, comm: Comm) -> ObjectCall:
    """How the point-to-point call ``fn`` reports errors and decodes objects (the
    process-wide serializer; received tensors stay where they land)."""
    serializer = policy.serializer_of(None, fn, comm)
    found = _CALLS.get((fn, serializer))
    if found is None:
        found = _CALLS[(fn, serializer)] = ObjectCall(fn, None, serializer)
    return found


def recv_fast(comm: Comm, src: int, tag: int, call: ObjectCall) -> Any:
    """Receive from ``src`` now if it takes the fast path (what was sent), else
    :data:`MISS`. A message that turns out not to be a tensor in one frame is finished
    by the general path."""
    if not _fast(comm):
        return MISS
    try:
        q = _quick_recv(comm, src, tag, call)
    except Exception as exc:
        _refused(comm, call.fn, "recv", src, tag, exc)
        raise
    if q is None:
        return MISS
    _wait_noted(comm, call.fn, q.op, [q.work])
    return _quick_result(q, call.fn)


_NUMBER = struct.Struct("<q")


# -- calls -------------------------------------------------------------------------------


def _fields(kind: str, peer: int, tag: int, data: Any = None) -> dict:
    """What debug mode shows of a call."""
    fields: dict[str, Any] = {"dst" if kind == "send" else "src": peer, "tag": tag}
    if kind == "send":
        fields["data"] = (
            {"dtype": str(data.dtype).replace("torch.", ""), "shape": list(data.shape)}
            if isinstance(data, Tensor)
            else type(data).__name__
        )
    return fields


class _Waiter:
    """What a :class:`~distkit.dist.Handle` of a point-to-point call waits on: the debug
    check at the first wait, the bookkeeping of the watchdog, errors that name the peer."""

    def __init__(
        self,
        comm: Comm,
        public: str,
        ops: list[Op],
        fields: dict,
        site: str,
        sent: list[Any],
        received: dict[int, Union[Receive, _Quick]],
        checked: bool,
    ) -> None:
        self.comm = comm
        self.public = public
        self.ops = ops
        self.fields = fields
        self.site = site
        self.sent = sent  # (op, works) of the sends
        self.received = received  # src -> Receive
        self.checked = checked
        self.results: dict[int, Any] = {}
        self.errors: list[Exception] = []
        self.waited = False  # wait() was called (a dropped handle warns otherwise)
        #: What ended a wait that failed (a timeout): its messages may never have come,
        #: so what its buffers hold is not read again; later waits raise it again
        self.failed: Optional[BaseException] = None

    def _finished(self) -> bool:
        """Whether every message was waited for (nothing is left to read)."""
        return len(self.results) == len(self.received) and all(
            w.is_completed() for _, works in self.sent for w in works
        )

    def _check_world(self) -> None:
        """Raise when the handle's group was destroyed with messages still to wait for:
        they can no longer arrive, and the group cannot say who its members were."""
        pg = self.comm.pg
        if pg is None or is_registered(pg) or self._finished():
            return
        self.failed = RuntimeError(
            f"{self.public}: this handle's process group was destroyed "
            "(destroy_dist() or destroy_process_group()) before its messages were waited "
            f"for (on rank {self.comm.rank} of {self.comm.size}): they can no longer "
            "arrive. Wait for every handle before destroying its group"
        )
        raise self.failed

    def is_completed(self) -> bool:
        if self.failed is not None:
            raise self.failed
        self._check_world()
        if any(not all(w.is_completed() for w in works) for _, works in self.sent):
            return False
        return all(
            r.work.is_completed() if isinstance(r, _Quick) else done(r, self.public)
            for r in self.received.values()
        )

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        self.waited = True
        if self.failed is not None:
            raise self.failed
        self._check_world()
        try:
            return self._wait(timeout)
        except Exception as exc:
            self.failed = exc
            raise

    def _wait(self, timeout: Optional[timedelta]) -> bool:
        comm, public = self.comm, self.public
        with pairs.waiting(comm, public, self.ops):
            if not self.checked:  # posted in debug mode: checked at the first wait
                self.checked = True
                try:
                    pairs.await_ops(comm, public, self.ops, self.fields, self.site)
                except Exception:
                    if comm._facts is not None:  # its messages are posted: out of step
                        comm._facts.broken = f"{public} was refused after it was posted"
                    raise
            # receives first: a peer's send (a blocking one, or the rest of a frame) may
            # wait for this rank to post its receive, while this rank's own sends are out
            # already and complete as their peers receive
            for src, rcv in self.received.items():
                if src in self.results:
                    continue
                if isinstance(rcv, _Quick):
                    _wait(comm, public, rcv.op, [rcv.work], timeout)
                    self.results[src] = _quick_result(rcv, public)
                else:
                    self.results[src] = finish(rcv, public, timeout)
            for op, works in self.sent:
                _wait(comm, public, op, works, timeout)
        for error in self.errors:  # a send whose object could not be encoded
            raise error
        return True


def _tentative(comm: Comm, way: str, peer: int, tag: int) -> int:
    return channel(comm, way, peer, tag).count + 1


def start(
    comm: Comm,
    public: str,
    sends: dict[int, Any],
    recv_from: list[int],
    tag: int,
    call: ObjectCall,
    block: bool,
) -> _Waiter:
    """Post ``sends`` (peer -> data) and the receives from ``recv_from``; in debug mode,
    a blocking call first meets its peers' ends (and sends nothing when refused)."""
    sends = {dst: data for dst, data in sends.items() if dst != comm.rank}
    recv_from = [src for src in recv_from if src != comm.rank]
    ops = [Op("send", dst, tag, _tentative(comm, "send", dst, tag)) for dst in sends]
    ops += [Op("recv", src, tag, _tentative(comm, "recv", src, tag)) for src in recv_from]
    checked, fields, site = True, {}, ""
    if ops and pairs.debugging():  # what the peers' posts are checked against
        site = debugmode.call_site()
        if len(ops) == 1:
            fields = _fields(ops[0].kind, ops[0].peer, tag, sends.get(ops[0].peer))
        else:
            fields = {"sends": sorted(sends), "recv_from": list(recv_from), "tag": tag}
        pairs.post(comm, public, ops, fields, site)
        checked = False
        # a blocking call of one message is checked before it sends anything; an
        # exchange of several is checked at its wait, once all of them are posted (its
        # peers may serve them one at a time: a blocking send, then a recv)
        if block and len(ops) == 1:
            try:
                with pairs.waiting(comm, public, ops):
                    pairs.await_ops(comm, public, ops, fields, site)
            except Exception:
                pairs.withdraw(comm, ops)  # refused before anything was sent
                raise
            checked = True
    waiter = _Waiter(comm, public, ops, fields, site, [], {}, checked)
    current: Optional[Op] = None  # the message being posted (gloo refuses one to or
    # from a rank that exited: said as waiting for it is, see _refused)
    try:
        batched = exact(comm) and len(ops) > 1
        quick = block and not batched and _fast(comm)  # a blocking call: the fast path
        outgoing: dict[int, tuple[Op, Outgoing]] = {}
        for op in ops[: len(sends)]:
            current = op
            posted = _quick_send(comm, sends[op.peer], op.peer, tag) if quick else None
            if posted is not None:
                waiter.sent.append((op, posted[1]))
                continue
            ch = channel(comm, "send", op.peer, tag)
            named = call._replace(name=f"sends[{op.peer}]") if public == "exchange" else call
            out = build(comm, sends[op.peer], ch, op.number, named)
            ch.count = op.number
            ch.history.append(out.frame_bytes)
            outgoing[op.peer] = (op, out)
        sent_works: dict[int, list[Any]] = {dst: [] for dst in outgoing}
        if not batched:  # every message of every send now; receives post their frames
            for dst, (op, out) in outgoing.items():
                current = op
                messages = [(t, dst) for part in out.rounds for t in part]
                sent_works[dst] = _post(comm, messages, [], tag)
            # (sends first: a receive posted first makes gloo write a send to the same peer
            # inside its send call, holding the pair: a ring of 1 MiB took 1.4x as long)
            for src in recv_from:
                number = _tentative(comm, "recv", src, tag)
                current = Op("recv", src, tag, number)
                fast = _quick_recv(comm, src, tag, call) if quick else None
                rcv = fast or receive(comm, src, tag, number, call)
                waiter.received[src] = rcv
                if not block and isinstance(rcv, Receive) and comm.cpu_home:
                    progress(rcv)  # its messages after the frame, posted without this thread
        else:  # NCCL: each round batched, on every rank alike (see the module docstring)
            current = None  # (its waits say their own failures)
            rounds: dict[int, Receive] = {}
            for src in recv_from:
                rcv = Receive(comm, src, tag, _tentative(comm, "recv", src, tag), call)
                rcv.ch.count = rcv.number
                _settle(rcv, public)  # what was queued before it, posted
                waiter.received[src] = rounds[src] = rcv
            for k in range(3):
                mine = [(t, dst) for dst, (_, out) in outgoing.items() for t in out.rounds[k]]
                theirs = []
                for src, rcv in rounds.items():
                    if rcv.works:
                        _wait(comm, public, rcv.op, rcv.works)
                        rcv.works = []
                    theirs += [(b, src) for b in rcv.next_buffers()]
                works = _post(comm, mine, theirs, tag)
                for w, (_, dst) in zip(works, mine):
                    sent_works[dst].append(w)
                recv_works = works[len(mine) :]
                for (_, src), w in zip(theirs, recv_works):
                    rounds[src].works.append(w)
    except Exception as exc:
        if current is not None:
            _raise_failure(comm, public, current, exc)
        raise
    for dst, (op, out) in outgoing.items():
        waiter.sent.append((op, sent_works[dst]))
        if out.error is not None:
            waiter.errors.append(out.error)
        stage = channel(comm, "send", dst, tag).stage
        if stage is not None:  # its buffer may be reused once its frame is out
            stage.works = sent_works[dst][:2]
    return waiter


def _settle(rcv: Receive, public: str) -> None:
    """Post every message of the receives queued on ``rcv``'s channel before it (batched
    rounds take ``rcv`` from there)."""
    ch = rcv.ch
    with ch.lock:
        while ch.queue:
            first = ch.queue[0]
            if first.stage >= PARTS:
                ch.queue.popleft()
                continue
            _advance(first, True, public)


def result(waiter: _Waiter, async_op: bool, value: Any) -> Any:
    """The call's result, or a handle to it."""
    if async_op:
        handle = Handle([waiter], value)
        if waiter.sent:  # a send's handle dropped unwaited: said at once (see _dropped)
            weakref.finalize(handle, _dropped, waiter, waiter.site or debugmode.call_site())
        return handle
    waiter.wait()
    return value()


def _dropped(waiter: _Waiter, site: str) -> None:
    """A handle with sends was dropped before its ``wait()``: gloo frees a send whose work
    is freed, so its message may never arrive, and the receiver would wait for it until the
    group's timeout (torch's own ``isend`` does the same, silently)."""
    if waiter.waited or waiter.failed is not None:
        return
    peers = ", ".join(str(op.peer) for op, _ in waiter.sent)
    warnings.warn(
        f"{waiter.public} at {site}: its handle was dropped before wait(), so its "
        f"send to rank {peers} may never arrive (the send is freed with its handle) and the "
        "receiver waits for it until the group's timeout. Keep the handle and call "
        "wait() on it, or use send()",
        RuntimeWarning,
        stacklevel=2,
    )
