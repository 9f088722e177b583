"""The protocol under :func:`distkit.dist.iter_results`: a plan, a verdict, then rounds.

**Opening** (the call itself, on every rank). Each rank sends ``dst`` its *plan*: its
result count, the encoded size of each result, its dataset indices, or what failed
(reading a result, pickling one, an index out of range, another stream still open). A
rank whose results are small (at most ``inline_bytes`` encoded) puts them all in its
plan. The plans travel in one gather of fixed ``SLOT_BYTES`` slots, the rest of a
larger plan point to point right after. ``dst`` checks them, lays out the outputs and
gives every rank its *verdict* in one broadcast: FAILED (raise this), or per rank GO
(the stream's id and tag, and how many positions it will ask the rank for: 0, 1, 2, ...
or a list that follows point to point) or DONE (nothing left to serve: the rank's
results came in its plan, or none is needed). So whatever any rank finds while opening
raises on every rank, from the call; a stream of small results costs the gather and the
broadcast, as :func:`~distkit.dist.collect_results` costs a gather and a status.

**Rounds** (``dst`` iterating). ``dst`` asks for the results of the next stretch of the
dataset: it posts each rank holding some of them a REQUEST (how many of its next
positions) in the world's store, never in a collective. A serving rank polls the store
for its next message, *claims* the request (an atomic ``add`` on the request's claim
key) and sends its answer point to point on the stream's own tag: *packs*, consecutive
results encoded together (:mod:`distkit.dist.codec.wire`), each at most about ``pack_bytes``
unless one result alone is larger, each preceded by ``int64[2]`` (bytes, results); a
rank that cannot read or encode a result sends ``int64[2]`` (-1, n) and n bytes saying
what failed, then raises. ``dst`` receives an answer only once it is claimed, so no rank
ever waits in the backend for a rank that is not serving: a consumer slower than the
group's timeout harms nothing, and a rank that never serves is found by ``dst`` after
the group's timeout (the claim never comes) and named, with what it is doing. When
``dst`` gives up on a request (an error elsewhere, a timeout) it claims the request
itself: whoever claims first wins, so either the rank never answers it or ``dst``
receives the answer anyway. DONE ends a rank's serving, FAILED makes it raise the error
``dst`` found.

Several streams may be open at once when they all go to one ``dst``
(``zip(iter_results(preds, n), iter_results(targets, n))``): a rank serving one stream
answers the requests of every stream open in its process. A stream to another ``dst``
while one is open is refused on every rank (two ranks each serving the other would wait
for each other forever).
"""

from __future__ import annotations

import json
import os
import re
import time
import weakref
from collections.abc import Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, Optional

import torch
import torch.distributed as td
from torch import Tensor

from distkit import _settings
from distkit._compat import default_store, group_timeout
from distkit.dist.backends.objects import _channels
from distkit.dist.codec import wire as _wire
from distkit.dist.core import args as _args
from distkit.dist.core import layouts
from distkit.dist.errors import CollectiveTimeoutError, UnsafeObjectError
from distkit.dist.guard import diagnose
from distkit.dist.guard.debugmode import call_site, group_label

if TYPE_CHECKING:
    from distkit.dist.backends.base import ObjectCall
    from distkit.dist.core.comm import Comm

REQUEST, DONE, FAILED, GO = 0, 1, 2, 3
#: Point-to-point tags: one for opening (opening is a collective, so in order on every
#: rank), and one per stream open at once on ``dst``. No other message of a group has them.
SETUP_TAG = 0x5EA
STREAM_TAG = 0x5EB
#: Bytes per rank in the plan gather; a larger plan sends the rest point to point.
SLOT_BYTES = layouts.PLAN_SLOT_BYTES
#: Error codes past ``_args.REMOTE_ERRORS``: errors that keep their class on every rank.
UNSAFE, TIMEOUT = 100, 101
#: How often a rank waiting for ``dst`` looks whether ``dst`` is stuck in another
#: collective (seconds; well under the hang reports' grace).
LOOK_EVERY = 0.25


# -- errors that reach every rank --------------------------------------------------


#: Where an error says it was raised: `` (on rank r of n)``.
_WHERE = re.compile(r" \(on rank \d+ of \d+\)")


class Failure(NamedTuple):
    """An error, as another rank raises it: the class (a code), and what to say."""

    code: int  # an index in _args.REMOTE_ERRORS, UNSAFE or TIMEOUT
    text: str  # the message, without its "fn: " prefix
    culprit: int = -1  # the rank that sent a refused object (UNSAFE) or did not answer
    name: str = ""  # the global the safe serializer refused (UNSAFE)

    @classmethod
    def of(cls, exc: BaseException, fn: str) -> Failure:
        # without the rank it was raised on: the rank that raises it again says its own
        text = _WHERE.sub("", str(exc).removeprefix(f"{fn}: "), count=1)
        if isinstance(exc, UnsafeObjectError):
            return cls(UNSAFE, text, exc.rank, exc.global_name)
        if isinstance(exc, CollectiveTimeoutError):
            return cls(TIMEOUT, text, exc.missing[0] if exc.missing else -1)
        return cls(_args.error_code(exc), text)

    def encode(self, limit: int = 0) -> bytes:
        """The failure as JSON, its text cut to fit in ``limit`` bytes if given."""
        raw = json.dumps(list(self)).encode()
        text = self.text
        while limit and len(raw) > limit and text:
            text = text[: len(text) // 2]
            raw = json.dumps(list(self._replace(text=text + " ..."))).encode()
        return raw[:limit] if limit else raw

    @classmethod
    def decode(cls, raw: bytes) -> Failure:
        try:
            code, text, culprit, name = json.loads(raw.decode(errors="replace"))
            return cls(int(code), str(text), int(culprit), str(name))
        except (ValueError, TypeError):
            return cls(len(_args.REMOTE_ERRORS) - 1, f"a malformed error report {raw[:200]!r}")

    def raise_as(self, fn: str, comm: Comm, what: str) -> NoReturn:
        """Raise ``what`` here, as an error of this failure's class."""
        message = f"{fn}: {what} (on {_args.where(comm)})"
        if self.code == UNSAFE:
            raise UnsafeObjectError(message, self.culprit, self.name)
        if self.code == TIMEOUT:
            raise CollectiveTimeoutError(message, [self.culprit], {})
        _args.remote_failure(self.code, fn, comm, what)


def read_error(position: int, exc: BaseException) -> Failure:
    """What the other ranks are told when ``results[position]`` could not be read."""
    return Failure(
        _args.error_code(exc), f"could not read results[{position}]: {type(exc).__name__}: {exc}"
    )


class ReadFailed(Exception):
    """``results[position]`` raised ``error`` (never reaches users: the original does)."""

    def __init__(self, position: int, error: BaseException) -> None:
        super().__init__(position, error)
        self.position = position
        self.error = error


def reading(results: Sequence, positions: Any = None) -> Iterator[Any]:
    """``results[p]`` for each position (all by default), read one at a time."""
    for p in range(len(results)) if positions is None else positions:
        try:
            item = results[p]
        except Exception as exc:
            raise ReadFailed(p, exc) from exc
        yield item


# -- point to point, on the group's CPU channel ---------------------------------------


class Link:
    """Point-to-point messages between the ranks of one group, with one tag."""

    def __init__(self, comm: Comm, tag: int) -> None:
        self.comm = comm
        self.tag = tag
        self.ch = _channels(comm)[0]

    def send(self, peer: int, t: Tensor) -> None:
        if t.numel():
            td.send(t.to(self.ch.device), self.ch.src(peer), group=self.ch.pg, tag=self.tag)

    def recv(self, peer: int, n: int, dtype: torch.dtype = torch.int64) -> Tensor:
        buf = torch.empty(n, dtype=dtype, device=self.ch.device)
        if n:
            td.recv(buf, self.ch.src(peer), group=self.ch.pg, tag=self.tag)
        return buf.cpu()

    def send_bytes(self, peer: int, raw: bytes) -> None:
        self.send(peer, _wire.owned_bytes(raw) if raw else _NONE)

    def recv_bytes(self, peer: int, n: int) -> bytes:
        return _wire.bytes_view(self.recv(peer, n, torch.uint8)).tobytes()

    def answer(self, peer: int, count: int, fn: str) -> list[tuple[Tensor, int]]:
        """Receive ``peer``'s packs for ``count`` requested results: (bytes, results) each."""
        packs = []
        got = 0
        while got < count:
            nbytes, items = self.recv(peer, 2).tolist()
            if nbytes < 0:
                failure = Failure.decode(self.recv_bytes(peer, items))
                failure.raise_as(fn, self.comm, f"rank {peer} {failure.text}")
            packs.append((self.recv(peer, nbytes, torch.uint8), items))
            got += items
        return packs


_NONE = torch.empty(0, dtype=torch.uint8, device="cpu")


# -- the plan ------------------------------------------------------------------------


class Plan(NamedTuple):
    """What a rank tells ``dst`` when a stream opens."""

    length: int  # len(results)
    sizes: Optional[Tensor]  # int64: each result's encoded size (None: inline or failed)
    indices: Optional[Tensor]  # int64: the dataset index of each result, if given
    failure: Optional[Failure]  # what went wrong here: then the rank raises its own error
    data: Optional[Tensor]  # uint8: every result, encoded together (small results only)


_HEAD_BYTES = layouts.PLAN_HEAD.size  # count, flags, sizes, indices, failure, data bytes
_INDICES, _INLINE = layouts.PLAN_INDICES, layouts.PLAN_INLINE


def _bytes(t: Optional[Tensor]) -> memoryview:
    return _wire.bytes_view(_wire.uint8_view(t)) if t is not None else memoryview(b"")


def _pack(plan: Plan) -> bytes:
    fail = plan.failure.encode() if plan.failure is not None else b""
    sizes, idx, data = _bytes(plan.sizes), _bytes(plan.indices), _bytes(plan.data)
    flags = _INDICES if plan.indices is not None else 0
    flags |= _INLINE if plan.data is not None else 0
    counts = (len(sizes) // 8, len(idx) // 8, len(fail), len(data))
    head = layouts.PLAN_HEAD.pack(plan.length, flags, *counts)
    return b"".join([head, sizes, idx, fail, data])


def _unpack(buf: Tensor) -> Plan:
    """A plan received from another rank (which may send anything: checked)."""
    n = buf.numel()
    if n < _HEAD_BYTES:
        raise ValueError(f"a plan of {n} bytes")
    head = list(layouts.PLAN_HEAD.unpack_from(_wire.bytes_view(buf[:_HEAD_BYTES])))
    count, flags, n_sizes, n_idx, n_fail, n_data = head
    if min(head) < 0 or n_sizes not in (0, count) or n_idx not in (0, count):
        raise ValueError(f"a plan whose header is {head}")
    if _HEAD_BYTES + 8 * (n_sizes + n_idx) + n_fail + n_data != n:
        raise ValueError(f"a plan of {n} bytes whose header is {head}")
    at = _HEAD_BYTES
    sizes = buf[at : at + 8 * n_sizes].view(torch.int64)
    at += 8 * n_sizes
    idx = buf[at : at + 8 * n_idx].view(torch.int64)
    at += 8 * n_idx
    fail = _wire.bytes_view(buf[at : at + n_fail]).tobytes()
    at += n_fail
    return Plan(
        count,
        sizes if n_sizes == count and not flags & _INLINE else None,
        idx if flags & _INDICES else None,
        Failure.decode(fail) if n_fail else None,
        buf[at:] if flags & _INLINE else None,
    )


def gather_plans(comm: Comm, plan: Plan, dst: int) -> Optional[list[Plan]]:
    """Every rank's plan, on ``dst`` (``None`` elsewhere): one gather of fixed slots,
    what does not fit point to point. A plan that does not parse is a failure of its
    rank."""
    raw = _pack(plan) if comm.rank != dst else b""
    total = len(raw)
    slot = bytearray(SLOT_BYTES)
    inline = min(total, SLOT_BYTES - 8)
    layouts.LENGTH.pack_into(slot, 0, total)
    slot[8 : 8 + inline] = raw[:inline]
    mine = _wire.owned_bytes(slot)
    slots = comm.backend.gather(comm, mine, dst, False, True)  # watched: hang reports
    link = Link(comm, SETUP_TAG)
    if comm.rank != dst:
        if total > inline:
            link.send_bytes(dst, raw[inline:])
        return None
    assert isinstance(slots, list)
    rows = [s.cpu() for s in slots]
    lengths = [layouts.LENGTH.unpack_from(_wire.bytes_view(row[:8]))[0] for row in rows]
    rest = {}
    works = []
    for r, n in enumerate(lengths):
        if r != dst and n > SLOT_BYTES - 8:
            rest[r] = torch.empty(n - (SLOT_BYTES - 8), dtype=torch.uint8, device=link.ch.device)
            works.append(td.irecv(rest[r], link.ch.src(r), group=link.ch.pg, tag=SETUP_TAG))
    for w in works:
        if w is not None:
            w.wait()
    plans = []
    for r, (row, n) in enumerate(zip(rows, lengths)):
        if r == dst:
            plans.append(plan)
            continue
        body = row[8 : 8 + min(max(n, 0), SLOT_BYTES - 8)]
        if r in rest:
            body = torch.cat([body, rest[r].cpu()])
        try:
            plans.append(_unpack(body.clone()))
        except ValueError as exc:
            bad = Failure(len(_args.REMOTE_ERRORS) - 1, f"sent a malformed plan ({exc})")
            plans.append(Plan(0, None, None, bad, None))
    return plans


# -- what is open in this process ----------------------------------------------------

# Streams open in this process, while the user holds them: a stream dropped unfinished
# can make no rank wait (its dst tells the others to stop; here nobody serves it).
_SERVERS: weakref.WeakSet[Server] = weakref.WeakSet()  # served until DONE or FAILED
_RECEIVERS: weakref.WeakSet[Held] = weakref.WeakSet()  # dst of these, until done


class Held:
    """A stream open on its ``dst``, as the other streams opened meanwhile see it."""

    def __init__(self, comm: Comm, tag: int = 0) -> None:
        self.me_global = comm.global_rank(comm.rank)
        self.site = call_site()  # in the call: where the user called iter_results
        self.tag = tag
        self.open = True
        _RECEIVERS.add(self)


def open_elsewhere(dst_global: int) -> str:
    """A stream open in this process to another rank than ``dst_global`` ("" if none)."""
    for server in list(_SERVERS):
        try:  # a DONE waiting for a stream left unread ends it
            server.poll(requests=False)
        except Exception:  # left for when it is read: its error is raised then
            pass
    for server in list(_SERVERS):
        if server.dst_global != dst_global:
            return f"a stream to global rank {server.dst_global} (created at {server.site})"
    for receiver in list(_RECEIVERS):
        if receiver.open and receiver.me_global != dst_global:
            return f"a stream to itself (created at {receiver.site})"
    return ""


def new_tag() -> int:
    """A tag no stream open on this process as its dst uses."""
    used = {r.tag for r in list(_RECEIVERS) if r.open}
    k = 0
    while STREAM_TAG + k in used:
        k += 1
    return STREAM_TAG + k


# -- the world's store ---------------------------------------------------------------


class Mailbox:
    """One stream's control messages, in the world's store.

    ``dst`` numbers its messages to each rank; only that rank reads (and deletes) them,
    in order, so a read never waits for a key that went away. A request's claim key is
    added to by the rank (answering) and by ``dst`` (giving up): the first one wins.
    """

    def __init__(self, nonce: int) -> None:
        self.store = default_store()
        self.prefix = f"distkit/iter_results/{nonce}"

    def _key(self, rank: int, n: int) -> str:
        return f"{self.prefix}/{rank}/{n}"

    def post(self, rank: int, n: int, kind: int, count: int = 0, failure: bytes = b"") -> None:
        value = json.dumps([kind, count, failure.decode(errors="replace")])
        self.store.set(self._key(rank, n), value)

    def peek(self, rank: int, n: int) -> Optional[tuple[int, int, bytes]]:
        key = self._key(rank, n)
        if not self.store.check([key]):
            return None
        kind, count, failure = json.loads(self.store.get(key))
        return int(kind), int(count), str(failure).encode()

    def remove(self, rank: int, n: int) -> None:
        self.store.delete_key(self._key(rank, n))

    def claim(self, rank: int, n: int) -> bool:
        """Claim request ``n`` to ``rank``: whether this caller claimed it first."""
        return int(self.store.add(self._key(rank, n) + "/claim", 1)) == 1

    def claimed(self, rank: int, n: int) -> bool:
        return bool(self.store.check([self._key(rank, n) + "/claim"]))

    def unclaim(self, rank: int, n: int) -> None:
        self.store.delete_key(self._key(rank, n) + "/claim")

    def set_state(self, rank: int, site: str, state: str) -> None:
        self.store.set(f"{self.prefix}/{rank}/state", json.dumps([site, state]))

    def forget_state(self, rank: int) -> None:
        self.store.delete_key(f"{self.prefix}/{rank}/state")

    def state(self, rank: int) -> Optional[tuple[str, str]]:
        key = f"{self.prefix}/{rank}/state"
        if not self.store.check([key]):
            return None
        site, state = json.loads(self.store.get(key))
        return site, state


class Backoff:
    """Sleeps between polls of the store: none at first, growing to a few milliseconds
    (20 ms once idle for a second), reset whenever a message arrives."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.delay = 0.0
        self.since = time.monotonic()

    def sleep(self) -> None:
        if self.delay:
            time.sleep(self.delay)
        cap = 0.002 if time.monotonic() - self.since < 1.0 else 0.02
        self.delay = min(max(2 * self.delay, 2e-5), cap)


class Opened(NamedTuple):
    """One stream, as every rank knows it once it is open."""

    comm: Comm
    fn: str
    seq: int  # this rank's call number on the group (hang reports)
    dst: int


def nonce() -> int:
    """A stream id: random bits (the user's random seeds leave it alone)."""
    return int.from_bytes(os.urandom(8), "little") >> 2


# -- the verdict -----------------------------------------------------------------------

#: Bytes of the verdict for the error that stops the call (a longer message is cut).
FAIL_BYTES = 2048


def _verdict_bytes(size: int) -> int:
    return _verdict_at(size) + FAIL_BYTES


def _verdict_at(rank: int) -> int:
    """Where rank ``rank``'s row of a verdict starts (after the head)."""
    return layouts.VERDICT_HEAD.size + layouts.VERDICT_ROW.size * rank


def announce(
    opened: Opened,
    failure: Optional[Failure] = None,
    stream: int = 0,
    tag: int = 0,
    wanted: Optional[dict[int, Tensor]] = None,
) -> None:
    """``dst`` gives every rank its verdict, in one broadcast: FAILED with ``failure``,
    else GO for the ranks in ``wanted`` (the positions dst will ask each for, which
    follow point to point unless they are 0, 1, 2, ...) and DONE for the others."""
    comm = opened.comm
    raw = bytearray(_verdict_bytes(comm.size))
    fail = failure.encode(FAIL_BYTES) if failure is not None else b""
    layouts.VERDICT_HEAD.pack_into(raw, 0, int(failure is not None), stream, tag, len(fail))
    late = {}
    for r, positions in (wanted or {}).items():
        m = positions.numel()
        ordered = bool(torch.equal(positions, torch.arange(m, device=positions.device)))
        layouts.VERDICT_ROW.pack_into(raw, _verdict_at(r), GO, m, int(ordered))
        if not ordered:
            late[r] = positions
    at = _verdict_at(comm.size)
    raw[at : at + len(fail)] = fail
    comm.backend.broadcast(comm, _wire.owned_bytes(raw), opened.dst, False)
    link = Link(comm, SETUP_TAG)
    for r, positions in late.items():
        link.send(r, positions.to(torch.int64))


def verdict(opened: Opened, own: Optional[BaseException]) -> tuple[int, int, int, list[int]]:
    """A rank's verdict from ``dst``: (kind, stream, tag, positions). Raises this rank's
    own error ``own`` once it has it, or the error ``dst`` stopped the call with."""
    comm, fn, dst = opened.comm, opened.fn, opened.dst
    slot = torch.zeros(_verdict_bytes(comm.size), dtype=torch.uint8, device="cpu")
    got = comm.backend.broadcast(comm, slot, dst, False)
    raw = _wire.bytes_view(got.cpu())
    failed, stream, tag, n_fail = layouts.VERDICT_HEAD.unpack_from(raw, 0)
    kind, m, ordered = layouts.VERDICT_ROW.unpack_from(raw, _verdict_at(comm.rank))
    if own is not None:
        raise own
    if failed:
        at = _verdict_at(comm.size)
        failure = Failure.decode(bytes(raw[at : at + min(max(n_fail, 0), FAIL_BYTES)]))
        failure.raise_as(fn, comm, f"rank {dst} stopped the call: {failure.text}")
    if kind != GO:
        return DONE, stream, tag, []
    positions = list(range(m)) if ordered else Link(comm, SETUP_TAG).recv(dst, m).tolist()
    return GO, stream, tag, positions


# -- serving (the ranks other than dst) --------------------------------------------------


class Server:
    """A rank's side of one stream: answers ``dst``'s requests until DONE or FAILED."""

    def __init__(
        self,
        opened: Opened,
        stream: int,
        tag: int,
        results: Sequence,
        sizes: list[int],
        positions: list[int],
        pack_bytes: int,
    ) -> None:
        self.opened = opened
        self.comm, self.fn, self.dst = opened.comm, opened.fn, opened.dst
        self.dst_global = self.comm.global_rank(self.dst)
        self.site = call_site()  # in the call: where the user called iter_results
        self.mailbox = Mailbox(stream)
        self.link = Link(self.comm, tag)
        self.results = results
        self.sizes = sizes
        self.positions = positions
        self.pack_bytes = pack_bytes
        self.cursor = 0  # positions answered so far
        self.next = 0  # the number of dst's next message
        self.done = False
        self.failure: Optional[Failure] = None
        self.mailbox.set_state(self.comm.rank, self.site, "created")
        _SERVERS.add(self)

    def poll(self, requests: bool = True) -> bool:
        """Handle dst's next message if it is there (not a request, unless ``requests``);
        whether there was one."""
        if self.done:
            return False
        me = self.comm.rank
        message = self.mailbox.peek(me, self.next)
        if message is None or (message[0] == REQUEST and not requests):
            return False
        kind, count, failure = message
        n = self.next
        self.mailbox.remove(me, n)
        self.next += 1
        if kind == REQUEST:
            if self.mailbox.claim(me, n):
                self.answer(count)
            else:  # dst gave up on it: a FAILED follows
                self.mailbox.unclaim(me, n)
        else:  # DONE or FAILED: dst reads nothing of this stream any more
            if kind == FAILED:
                self.failure = Failure.decode(failure)
            self.finish(forget=True)
        return True

    def answer(self, count: int) -> None:
        """Send dst the results at the next ``count`` positions, in packs."""
        wanted = self.positions[self.cursor : self.cursor + count]
        self.cursor += count
        sizes, start = self.sizes, 0
        while start < len(wanted):
            end, total = start + 1, sizes[wanted[start]]
            while end < len(wanted) and total + sizes[wanted[end]] <= self.pack_bytes:
                total += sizes[wanted[end]]
                end += 1
            try:
                items = list(reading(self.results, wanted[start:end]))
                enc = _wire.encode(items, "results", self.fn, self.comm)
            except ReadFailed as failed:
                self.refuse(read_error(failed.position, failed.error))
                raise failed.error from None
            except Exception as exc:  # told as "rank <r> ...": the rank is named there
                text = str(exc).removeprefix(f"{self.fn}: ")
                text = text.replace(f" (on {_args.where(self.comm)})", "", 1)
                self.refuse(Failure(_args.error_code(exc), f"could not send its results: {text}"))
                raise
            self.link.send(self.dst, torch.tensor([enc.cpu.numel(), end - start], device="cpu"))
            self.link.send(self.dst, enc.cpu)
            del enc, items
            start = end

    def refuse(self, failure: Failure) -> None:
        """Tell dst (waiting for an answer) what failed here; serve no more."""
        raw = failure.encode()
        self.link.send(self.dst, torch.tensor([-1, len(raw)], device="cpu"))
        self.link.send_bytes(self.dst, raw)
        self.finish()

    def finish(self, forget: bool = False) -> None:
        """Serve no more; ``forget`` once dst is done (it reads this rank's state only
        while it waits for an answer)."""
        self.done = True
        _SERVERS.discard(self)
        if forget:
            self.mailbox.forget_state(self.comm.rank)
        else:
            self.mailbox.set_state(self.comm.rank, self.site, "finished")

    def stuck_dst(self) -> Optional[dict]:
        """Where ``dst`` waits, when it reports a hang in another collective (it posts
        where it waits to the store, :mod:`distkit.dist.guard.diagnose`)."""
        posts = diagnose.posts_of(self.mailbox.store, self.dst_global)
        # dst reporting a rank of one of its streams that does not answer: FAILED follows
        if not posts or any(post.get("call") == self.fn for post in posts):
            return None
        return posts[0]

    def dst_went_elsewhere(self, post: dict) -> NoReturn:
        """Raise: ``dst`` waits in another collective (``post``) instead of asking.

        This rank posts where it waits, as a rank in a collective does when it times
        out, until ``dst`` has read it, so ``dst``'s report names this stream.
        """
        comm, fn, opened = self.comm, self.fn, self.opened
        self.finish()
        store = self.mailbox.store
        me = comm.global_rank(comm.rank)
        where = {"group": comm.global_ranks(), "call": fn, "seq": opened.seq, "site": self.site}
        diagnose.post(store, me, where)
        try:
            deadline = time.monotonic() + float(_settings.get("hang_grace")) + 1.0
            while diagnose.posts_of(store, self.dst_global) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            diagnose.unpost(store, me)
        group = (
            "this group"
            if post.get("group") == comm.global_ranks()
            else (f"group {post.get('group')}")
        )
        raise CollectiveTimeoutError(
            f"{fn} on rank {comm.rank} of {comm.size} of {group_label(comm)}: dst (rank "
            f"{self.dst}) stopped asking for results of the stream created at {self.site} "
            f"(its call #{opened.seq} on this group): it is waiting in {post.get('call')} "
            f"(its call #{post.get('seq')} on {group}) at {post.get('site')}.\nEvery rank "
            f"must iterate (or close) what {fn} returned before its next collective.",
            [self.dst],
            {self.dst: post},
        )


def serve(server: Server) -> None:
    """Serve every stream open in this process until ``server``'s is done; raise the
    error ``dst`` stopped it with, if any."""
    comm, fn = server.comm, server.fn
    if not server.done:
        server.mailbox.set_state(comm.rank, server.site, "iterating")
    backoff = Backoff()
    looked = time.monotonic()
    while not server.done:
        if any([s.poll() for s in list(_SERVERS)]):
            backoff.reset()
            continue
        if time.monotonic() - looked > LOOK_EVERY:
            looked = time.monotonic()
            post = server.stuck_dst()
            if post is not None:
                server.dst_went_elsewhere(post)
        backoff.sleep()
    failure, server.failure = server.failure, None  # raised once
    if failure is not None:
        failure.raise_as(fn, comm, f"rank {server.dst} stopped the call: {failure.text}")


# -- receiving (dst) ----------------------------------------------------------------


def unpack(packs: list[tuple[Tensor, int]], sender: int, call: ObjectCall, comm: Comm) -> Any:
    """The results of ``packs`` in order; each pack is decoded when its first result is
    due, and its bytes dropped once decoded."""
    packs.reverse()
    while packs:
        buf, _ = packs.pop()
        items = _wire.decode(
            _wire.Encoded(buf, None), call.map_location, call.serializer, sender, call.fn, comm
        )
        del buf
        items.reverse()
        while items:
            yield items.pop()


class Receiver(Held):
    """``dst``'s side of one stream: asks each round's ranks, yields in dataset order."""

    def __init__(
        self,
        opened: Opened,
        stream: int,
        tag: int,
        results: Sequence,
        ranks: Tensor,
        positions: Tensor,
        cost: Tensor,
        budget: int,
        call: ObjectCall,
        inline: dict[int, list],
        serving: list[int],
    ) -> None:
        super().__init__(opened.comm, tag)
        self.opened = opened
        self.comm, self.fn = opened.comm, opened.fn
        self.mailbox = Mailbox(stream)
        self.link = Link(self.comm, tag)
        self.results = results
        self.ranks, self.positions, self.cost = ranks, positions, cost
        self.budget = budget
        self.call = call
        self.inline = inline
        self.waiting = list(serving)  # ranks that wait for dst's messages
        self.sent = dict.fromkeys(serving, 0)  # the number of the next message to each
        self.gone: set[int] = set()  # ranks that failed: they neither answer nor listen
        self.failure: Optional[Failure] = None  # dst's own failure, as the others hear it
        self.round = 0

    def _post(self, rank: int, kind: int, count: int = 0, failure: bytes = b"") -> int:
        n = self.sent[rank]
        self.sent[rank] = n + 1
        self.mailbox.post(rank, n, kind, count, failure)
        return n

    def run(self) -> Generator[Any, None, None]:
        comm, me = self.comm, self.comm.rank
        pending: dict[int, tuple[int, int]] = {}  # rank -> (request, results asked for)
        try:
            for start, end in rounds(self.cost, self.budget):
                self.round += 1
                ranks = self.ranks[start:end]
                positions = self.positions[start:end]
                counts = torch.bincount(ranks, minlength=comm.size).tolist()
                for r, count in enumerate(counts):
                    if count and r in self.sent:  # a rank that serves (not dst, not inline)
                        pending[r] = (self._post(r, REQUEST, count), count)
                queues = {}
                while pending:  # every request is out: the ranks encode meanwhile
                    for r in self._claimed(pending):
                        _, count = pending.pop(r)
                        try:
                            packs = self.link.answer(r, count, self.fn)
                        except Exception:
                            self.gone.add(r)  # it failed: it neither answers nor listens
                            raise
                        queues[r] = unpack(packs, r, self.call, comm)
                        packs = []
                for r, p in zip(ranks.tolist(), positions.tolist()):
                    if r == me:
                        yield self._own(p)
                    elif r in self.inline:
                        yield self.inline[r][p]
                    else:
                        yield next(queues[r])
                del queues
        except Exception as exc:  # the stream itself failed: the waiting ranks raise too
            self._stop(pending, self.failure or Failure.of(exc, self.fn))
            raise
        finally:  # done, or the consumer stopped early (break, close, its own exception)
            self._stop(pending)

    def _own(self, position: int) -> Any:
        try:
            return self.results[position]
        except Exception as exc:
            failure = read_error(position, exc)
            self.failure = failure._replace(text=f"rank {self.comm.rank} {failure.text}")
            raise

    def _claimed(self, pending: dict[int, tuple[int, int]]) -> list[int]:
        """The ranks of ``pending`` that claimed their requests (one look at each),
        waiting at most the group's timeout for one; then the requests are withdrawn (or
        drained, from a rank that claimed its own meanwhile) and :meth:`_stalled`
        raises."""
        timeout = group_timeout(self.comm.pg)
        limit = timeout.total_seconds() if timeout is not None else 1800.0
        deadline = time.monotonic() + limit
        backoff = Backoff()
        while True:
            claimed = [r for r, (n, _) in pending.items() if self.mailbox.claimed(r, n)]
            for r in claimed:
                self.mailbox.unclaim(r, pending[r][0])
            if claimed:
                return claimed
            if time.monotonic() > deadline:
                break
            backoff.sleep()
        stalled = []
        for r, (n, count) in list(pending.items()):
            del pending[r]
            if self.mailbox.claim(r, n):
                stalled.append(r)  # withdrawn: r skips it if it ever looks
                continue
            self.mailbox.unclaim(r, n)  # r claimed it at the last moment: drain it
            try:
                self.link.answer(r, count, self.fn)
            except Exception:
                self.gone.add(r)
        self._stalled(stalled, limit)

    def _stalled(self, ranks: list[int], waited: float) -> NoReturn:
        """Raise the error for ``ranks``, which did not claim their requests in time."""
        comm, fn, opened = self.comm, self.fn, self.opened
        stalled = RuntimeError(f"rank(s) {ranks} did not answer within {waited:g} s")
        reports: dict[int, dict] = {}
        try:  # where the others wait, and telling them where dst waits
            reports = diagnose.diagnose(comm, fn, opened.seq, stalled).reports
        except Exception:
            pass
        lines = []
        for rank in ranks:
            state = self.mailbox.state(rank)
            site, doing = state if state is not None else ("?", "created")
            what = {
                "created": f"rank {rank} created {fn} at {site} but has not iterated it",
                "iterating": f"rank {rank} iterates it (created at {site}) but did not answer",
            }.get(doing, f"rank {rank} stopped serving it (created at {site})")
            report = reports.get(rank)
            if report:
                here = report.get("group") == comm.global_ranks()
                group = "this group" if here else f"group {report.get('group')}"
                what += (
                    f"; it is waiting in {report.get('call')} (its call #{report.get('seq')} "
                    f"on {group}) at {report.get('site')}"
                )
            else:
                what += (
                    "; it is not waiting in a distkit collective (busy, blocked elsewhere, or dead)"
                )
            lines.append(f"  {what}")
        who = ", ".join(map(str, ranks))
        message = (
            f"{fn} timed out on rank {comm.rank} of {comm.size} of {group_label(comm)}: "
            f"rank(s) {who} did not answer dst's request for round {self.round} of the stream "
            f"created at {self.site} (its call #{opened.seq} on this group) within "
            f"{waited:g} s.\n" + "\n".join(lines) + f"\nEvery rank must iterate or close "
            f"what {fn} returned: the ranks other than dst serve dst while they iterate."
        )
        raise CollectiveTimeoutError(message, ranks, reports)

    def _stop(self, pending: dict[int, tuple[int, int]], failure: Optional[Failure] = None) -> None:
        """Tell every rank still waiting to stop: done, or failed with ``failure``. A
        request still out is withdrawn, or its answer drained if its rank got there
        first. Posts to the store only (and drains): never waits for a rank that does
        not serve, so this may run from ``__del__``."""
        waiting = self.waiting
        self.waiting = []
        self.open = False
        for r, (n, count) in list(pending.items()):
            del pending[r]
            if self.mailbox.claim(r, n):
                continue  # withdrawn before r saw it: r skips it, then reads the FAILED
            self.mailbox.unclaim(r, n)
            try:
                self.link.answer(r, count, self.fn)
            except Exception:
                self.gone.add(r)
        raw = failure.encode() if failure is not None else b""
        for r in waiting:
            if r not in self.gone:
                self._post(r, FAILED if failure is not None else DONE, 0, raw)

    def stop(self) -> None:
        self._stop({})


def rounds(cost: Tensor, budget: int) -> Iterator[tuple[int, int]]:
    """Split outputs with byte costs ``cost`` into consecutive ``(start, end)`` rounds of
    at most ``budget`` bytes (at least one output each)."""
    total = torch.cumsum(cost, 0)
    start, base, n = 0, 0, len(cost)
    while start < n:
        end = int(torch.searchsorted(total, base + budget, right=True))
        end = max(end, start + 1)
        yield start, end
        base, start = int(total[end - 1]), end
