"""Point-to-point calls, watched: debug mode's pairing, and errors that name the peer.

A point-to-point call involves two ranks, not the group, so it takes no call number on
the group (the numbers of the ranks that take part would drift from the others'). Each
*channel* (sender, receiver, tag) numbers its own messages from 1, at both ends: the
sender's k-th message to a rank on a tag is that rank's k-th receive from it on that tag,
since messages between a pair arrive in the order sent.

**Debug mode** pairs every point-to-point call with its peer's on the world's store
(:mod:`distkit.dist.guard.board`), never through the backend:

- a rank posts each op of a call at the key of its message when it makes the call
  (``p2p/<group>/<src>><dst>/<tag>/<k>/send``, or ``.../recv``);
- a rank about to wait (a blocking call, ``Handle.wait``, ``exchange``) publishes what it
  waits for (its *now* marker) and polls for its peers' posts of the other end of each
  op. While it waits it reads the markers of the peers it waits for: a peer that itself
  waits for an op of this rank that this rank never posted (both ranks send to each
  other, both receive, or they use different tags) can never be served, and neither can
  a peer that waits in a collective of a group this rank belongs to (debug mode
  publishes a marker around each collective's check too). Both ranks then raise
  :class:`~distkit.dist.CollectiveMismatchError` naming both calls and call sites: the rank
  that finds it first leaves the other a note, and joins a peer's collective check
  (an all-gather of every rank's call) with its own call, so that the collective raises
  it as well.

A blocking call refused this way sent nothing, so the ranks may go on (its numbers are
given back). An ``isend``/``irecv`` is checked when it is waited for, after its messages
were posted: then the pair is out of step, and the group is marked unusable.

**Failures** (always): a point-to-point wait that passes the group's timeout raises
:class:`~distkit.dist.CollectiveTimeoutError` naming the peer and where it is (its
watchdog answers a roll call: the point-to-point call it waits in, the collective, or
the line it runs), and one whose peer went away raises
:class:`~distkit.dist.RankGoneError` naming it, as collectives do
(:mod:`distkit.dist.guard.diagnose`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterator
from threading import get_ident
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

from distkit import _settings
from distkit._compat import group_timeout
from distkit.dist.core.comm import _FACTS, Comm
from distkit.dist.errors import CollectiveMismatchError, CollectiveTimeoutError, RankGoneError
from distkit.dist.guard import board as _board
from distkit.dist.guard import debugmode, diagnose
from distkit.dist.guard import record as _record
from distkit.dist.handle import Handle

if TYPE_CHECKING:
    from distkit.dist.guard.board import Board

_DEBUG_DEFAULT = _settings.default("debug")


class Op(NamedTuple):
    """One message of a point-to-point call, as this rank sees it."""

    kind: str  # "send" or "recv"
    peer: int  # the other rank, within the group
    tag: int  # the caller's tag
    number: int  # the message's number on its channel (from 1)


def debugging() -> bool:
    return bool(_settings.values.get("debug", _DEBUG_DEFAULT))


def describe(op: Op) -> str:
    """``send to rank 1 (tag 0, message #3)``, with global ranks named by the caller."""
    way = "to" if op.kind == "send" else "from"
    return f"{op.kind} {way} rank {op.peer} (tag {op.tag}, message #{op.number})"


# -- the calls threads wait in, for the watchdog --------------------------------------


class waiting:
    """Note, for the watchdog's answers, that this thread waits in ``public`` for ``ops``
    (a context manager; cheap, as it wraps every blocking point-to-point call)."""

    __slots__ = ("facts", "key", "note")

    def __init__(self, comm: Comm, public: str, ops: list[Op]) -> None:
        self.facts = comm._facts
        self.key = next(tokens)
        peers = tuple({op.peer for op in ops})
        self.note = (public, peers, ops[0].tag if ops else 0, get_ident(), tuple(ops))

    def __enter__(self) -> None:
        if self.facts is not None:
            self.facts.p2p[self.key] = self.note

    def __exit__(self, *exc: Any) -> None:
        if self.facts is not None:
            self.facts.p2p.pop(self.key, None)


#: Keys of the notes in ``_GroupFacts.p2p``: ``(public, peers, tag, thread, ops)``
tokens = itertools.count()


# -- keys on the store ------------------------------------------------------------------


def _ends(comm: Comm, op: Op) -> tuple[int, int]:
    me, peer = comm.global_rank(comm.rank), comm.global_rank(op.peer)
    return (me, peer) if op.kind == "send" else (peer, me)


def _key(board: Board, gid: str, src: int, dst: int, tag: int, number: int, kind: str) -> str:
    return board.key("p2p", gid, f"{src}>{dst}", tag, number, kind)


def _mine(board: Board, comm: Comm, op: Op) -> str:
    assert comm._facts is not None
    return _key(board, comm._facts.gid, *_ends(comm, op), op.tag, op.number, op.kind)


def _theirs(board: Board, comm: Comm, op: Op) -> str:
    """Where the peer posts the other end of ``op``."""
    assert comm._facts is not None
    other = "recv" if op.kind == "send" else "send"
    return _key(board, comm._facts.gid, *_ends(comm, op), op.tag, op.number, other)


def _now(board: Board, global_rank: int) -> str:
    return board.key("p2p-now", global_rank)


#: A rank's wait marker once it stops waiting: written over, never deleted (a peer that
#: found the key and then read it would wait for the store's timeout on a deleted one)
_IDLE = {"kind": "idle"}


def _told(board: Board, global_rank: int, wait: str) -> str:
    """Where a peer leaves rank ``global_rank`` a note about its wait ``wait`` (an id of
    its own: a late note never reaches a later wait)."""
    return board.key("p2p-told", global_rank, wait)


def _board_of(comm: Comm) -> Optional[Board]:
    found = _board.board()
    if found is None or found.dead or comm._facts is None:
        return None
    return found


def call(public: str, fields: dict, site: str) -> dict:
    """A call as debug mode shows it (see :func:`debugmode.format_call`)."""
    return {"call": public, "fields": fields, "must": {"point_to_point": True}, "site": site}


# -- debug mode: posting --------------------------------------------------------------------


def post(comm: Comm, public: str, ops: list[Op], fields: dict, site: str) -> None:
    """Debug mode: post each of ``ops`` (made by call ``public`` at ``site``)."""
    board = _board_of(comm)
    if board is None:
        return
    mine = call(public, fields, site)
    for op in ops:
        board.post(_mine(board, comm, op), {**mine, "op": op.kind})


def withdraw(comm: Comm, ops: list[Op]) -> None:
    """Take back the posts of ``ops`` (a call refused before it sent anything)."""
    board = _board_of(comm)
    if board is None:
        return
    for op in ops:
        with contextlib.suppress(Exception):
            board.store.delete_key(_mine(board, comm, op))


def _forget(board: Board, comm: Comm, ops: list[Op]) -> None:
    """Both ends of ``ops`` met: their posts are not needed any more (each end deletes
    the other's post, which it read last)."""
    for op in ops:
        with contextlib.suppress(Exception):
            board.store.delete_key(_theirs(board, comm, op))


# -- debug mode: a collective's marker --------------------------------------------------------


@contextlib.contextmanager
def in_collective(comm: Comm, public: str, fields: dict, seq: int) -> Iterator[None]:
    """Debug mode: publish, while this rank checks collective ``public`` with its group,
    that it waits there (a peer blocked in a point-to-point call toward this rank then
    knows it cannot be served, and joins the check: see :func:`await_ops`)."""
    board = _board_of(comm)
    if board is None:
        yield
        return
    assert comm._facts is not None
    me = comm.global_rank(comm.rank)
    marker = {
        "kind": "collective",
        "call": public,
        "fields": fields,
        "site": debugmode.call_site(),
        "gid": comm._facts.gid,
        "group": comm.global_ranks(),
        "label": debugmode.group_label(comm),
        "seq": seq,
    }
    board.post(_now(board, me), marker)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            board.post(_now(board, me), _IDLE)


# -- debug mode: waiting --------------------------------------------------------------------


def await_ops(comm: Comm, public: str, ops: list[Op], fields: dict, site: str) -> None:
    """Debug mode: wait until the peer of each of ``ops`` posted its end; raise when a
    peer waits for this rank in a way this rank can never serve (see the module's
    docstring), or at the group's timeout.

    Raises:
        CollectiveMismatchError: A peer waits for an op of this rank that this rank never
            posted, or waits in a collective of a group this rank belongs to.
        CollectiveTimeoutError: A peer did not post its end within the group's timeout.
        RankGoneError: A peer exited meanwhile.
    """
    board = _board_of(comm)
    if board is None or not ops:
        return
    me = comm.global_rank(comm.rank)
    gid = comm._facts.gid if comm._facts is not None else ""
    theirs = {op: _theirs(board, comm, op) for op in ops}
    mine = call(public, fields, site)
    listed = [[op.kind, comm.global_rank(op.peer), op.tag, op.number] for op in ops]
    wait = f"{os.getpid()}.{next(tokens)}"
    told = _told(board, me, wait)
    board.post(_now(board, me), {"kind": "p2p", **mine, "gid": gid, "ops": listed, "id": wait})
    timeout = group_timeout(comm.pg)
    start = time.monotonic()
    deadline = start + (timeout.total_seconds() if timeout is not None else 1800.0)
    pause, exits_at = 2e-5, start + 1.0
    pending = dict(theirs)
    try:
        while True:
            for op, key in list(pending.items()):
                if board.has(key):
                    del pending[op]
            if not pending:
                # this rank's marker goes first: a peer that still sees it then still
                # finds its own posts (which _forget deletes), and sees no conflict
                with contextlib.suppress(Exception):
                    board.post(_now(board, me), _IDLE)
                _forget(board, comm, ops)
                return
            note = board.read(told)
            if note is not None:
                with contextlib.suppress(Exception):
                    board.store.delete_key(told)
                raise _from_note(comm, public, note)
            for peer in sorted({op.peer for op in pending}):
                _look_at(board, comm, public, mine, listed, pending, peer)
            now = time.monotonic()
            if now >= exits_at:
                exits_at = now + 1.0
                peers = sorted({comm.global_rank(op.peer) for op in pending})
                gone = board.exits(peers)
                if gone:
                    op = next(o for o in pending if comm.global_rank(o.peer) in gone)
                    raise _gone(comm, public, op, gone, None)
            if now >= deadline:
                op = next(iter(pending))
                waited = TimeoutError(
                    f"distkit's debug mode waited {now - start:.0f} s for rank "
                    f"{comm.global_rank(op.peer)} to make the other end of this {op.kind}"
                )
                raise timed_out(comm, public, op, waited)
            time.sleep(pause)
            pause = min(pause * 2, _board.POLL)
    finally:
        with contextlib.suppress(Exception):
            board.post(_now(board, me), _IDLE)


def _look_at(
    board: Board,
    comm: Comm,
    public: str,
    mine: dict,
    listed: list,
    pending: dict[Op, str],
    peer: int,
) -> None:
    """Raise if ``peer`` (a group rank this rank waits for) waits for this rank in a way
    this rank cannot serve."""
    me, them = comm.global_rank(comm.rank), comm.global_rank(peer)
    marker = board.read(_now(board, them))
    if marker is None or marker.get("kind") == "idle":
        return  # not waiting in a distkit call (busy): it may still come
    waited = next(op for op in pending if op.peer == peer)
    if board.has(pending[waited]):
        return  # it posted its end of this rank's wait since this rank last looked
    if marker.get("kind") == "collective":
        if me in marker.get("group", ()):
            raise _join(comm, public, mine, marker, waited, them)
        return
    stuck = []
    for kind, target, tag, number in marker.get("ops", ()):
        if target != me:
            continue
        src, dst = (them, me) if kind == "send" else (me, them)
        other = "recv" if kind == "send" else "send"
        if not board.has(_key(board, marker["gid"], src, dst, tag, number, other)):
            stuck.append((kind, tag, number))
    if not stuck:
        return  # what it waits for from this rank was posted: it will be served
    again = board.read(_now(board, them))
    if again is None or again.get("id") != marker.get("id"):
        return  # it stopped waiting meanwhile (served: it deletes this rank's posts)
    if board.has(pending[waited]):
        return  # it posted its end of this rank's wait since this rank last looked
    kind, tag, number = stuck[0]
    what = _conflict(comm, waited, them, kind, tag)
    theirs_call = {k: marker[k] for k in ("call", "fields", "site")}
    calls = {me: {k: mine[k] for k in ("call", "fields", "site")}, them: theirs_call}
    note = {"from": me, "ops": marker["ops"], "what": what, "calls": calls, "public": public}
    board.post(_told(board, them, marker.get("id", "")), note)
    raise _mismatch(comm, public, what, calls)


def _conflict(comm: Comm, waited: Op, them: int, kind: str, tag: int) -> str:
    """What is wrong when this rank waits for ``waited`` and rank ``them`` waits for this
    rank's end of a ``kind`` on ``tag`` that this rank never posted."""
    me = comm.global_rank(comm.rank)
    if waited.kind == "send" and kind == "send":
        return (
            f"rank {me} and rank {them} both send to each other and wait, and neither "
            "receives: a send waits for its peer's recv (receive first on one of them, "
            "or post both with dist.exchange)"
        )
    if waited.kind == "recv" and kind == "recv":
        return f"rank {me} and rank {them} both wait to receive from each other, and neither sends"
    if waited.tag != tag:
        return (
            f"rank {me} waits for a {waited.kind} on tag {waited.tag} with rank {them}, "
            f"which waits for a {kind} on tag {tag} with rank {me}: the tags differ"
        )
    return (
        f"rank {me} and rank {them} are out of step: rank {me} waits for message "
        f"#{waited.number} on tag {waited.tag}, rank {them} for a {kind} of another "
        "message"
    )


def _mismatch(comm: Comm, public: str, what: str, calls: dict[int, dict]) -> Exception:
    lines = [f"{public}: {what} (debug mode; on rank {comm.rank} of {comm.size}):"]
    for r in sorted(calls):
        lines.append(f"  rank {r}: {debugmode.format_call(calls[r])}")
    ordered = [calls[r] for r in sorted(calls)]
    return CollectiveMismatchError("\n".join(lines), ordered)


def _from_note(comm: Comm, public: str, note: dict) -> Exception:
    """The error a peer found for both ranks, from this rank's side."""
    calls = {int(r): c for r, c in note["calls"].items()}
    return _mismatch(comm, public, note["what"], calls)


def _join(comm: Comm, public: str, mine: dict, marker: dict, waited: Op, them: int) -> Exception:
    """Rank ``them`` waits in a collective that needs this rank, while this rank waits for
    it here: take part in that collective's debug-mode check with this rank's own call
    (so the collective raises too, listing it), and return the error to raise here."""
    me = comm.global_rank(comm.rank)
    what = (
        f"rank {me} waits in {public} for rank {them}, which waits in {marker['call']} on "
        f"{marker.get('label', 'its group')}, a collective that needs rank {me}"
    )
    facts = comm._facts if comm._facts is not None and comm._facts.gid == marker["gid"] else None
    if facts is None:
        facts = next((f for f in list(_FACTS.values()) if f.gid == marker["gid"]), None)
    pg = facts.ref() if facts is not None else None
    if facts is None or pg is None:  # a group this process never used: say it alone
        theirs = {k: marker[k] for k in ("call", "fields", "site")}
        return _mismatch(comm, public, what, {me: mine, them: theirs})
    there = Comm(pg, facts.rank, facts.size, facts.backend, facts)
    calls = debugmode.exchange(there, {**mine, "seq": 0})
    ranks = facts.ranks or there.global_ranks()
    lines = [f"{public}: {what} (debug mode; on rank {comm.rank} of {comm.size}):"]
    for r, c in zip(ranks, calls):
        lines.append(f"  rank {r}: {debugmode.format_call(c)}")
    return CollectiveMismatchError("\n".join(lines), calls)


# -- a profile's entry ----------------------------------------------------------------------


def recorded(comm: Comm, name: str, args: tuple, result: Any) -> tuple[str, list[int], tuple]:
    """What a profile records of point-to-point call ``name`` (a backend method, called
    with ``args``, that returned ``result``): the entry's ``gid`` (:data:`record.PAIRS`
    and the keys of the messages it made, the same at their other ends), the global ranks
    it involved, and the tensors whose bytes count (what it sent; a recv: what came)."""
    facts = comm._facts
    assert facts is not None
    me = comm.rank
    counted: tuple
    if name == "send":
        data, dst, tag = args[:3]
        ways, counted = [("send", dst)], (data,)
    elif name == "recv":
        src, tag = args[:2]
        ways, counted = [("recv", src)], (() if isinstance(result, Handle) else (result,))
    else:  # exchange
        sends, recv_from, tag = args[:3]
        ways = [("send", d) for d in sends if d != me] + [("recv", s) for s in recv_from if s != me]
        counted = ([v for d, v in sends.items() if d != me],)
    keys = []
    for way, peer in ways:
        number = facts.pairs[(way, peer, tag)].count  # its channel's: this call's message
        src, dst = (me, peer) if way == "send" else (peer, me)
        keys.append(f"{facts.gid}/{comm.global_rank(src)}>{comm.global_rank(dst)}/{tag}/{number}")
    ranks = sorted({comm.global_rank(me)} | {comm.global_rank(peer) for _, peer in ways})
    return _record.PAIRS + ";".join(keys), ranks, counted


# -- failures -----------------------------------------------------------------------------


def failure(comm: Comm, public: str, op: Op, exc: BaseException) -> Optional[BaseException]:
    """What to raise instead of a backend error while waiting for ``op`` (``None``: the
    error itself)."""
    if isinstance(exc, (CollectiveTimeoutError, RankGoneError, CollectiveMismatchError)):
        return None
    if diagnose.is_timeout(exc):
        return timed_out(comm, public, op, exc)
    if diagnose.is_peer_lost(exc):
        return peer_gone(comm, public, op, exc)
    return None


def _where(answer: dict, me: int) -> str:
    """Where a rank is, from its answer to a roll call."""
    for call_ in answer.get("p2p", ()):
        peers = ", ".join(f"rank {p}" for p in call_["peers"])
        who = f"this rank ({peers})" if call_["peers"] == [me] else peers
        return f"is waiting in {call_['call']} with {who}, tag {call_['tag']}, at {call_['site']}"
    for call_ in answer.get("in", ()):
        group = "the default group" if call_["gid"] == "0" else f"group {call_['group']}"
        seq = call_["seq"]
        return f"is waiting in {call_['call']} (its call #{seq} on {group}) at {call_['site']}"
    if answer.get("at"):
        return f"is at {answer['at']}, not in a distkit call"
    return "answered, but not from its main thread"


def _ask(comm: Comm, peer: int) -> tuple[Optional[dict], dict, str]:
    """Where rank ``peer`` (global) is: its answer to a roll call (or ``None``), its exit
    note if it answered none, and what went wrong asking."""
    grace = min(float(_settings.get("hang_grace")), 3.0)
    try:
        board = _board.board()
        if board is None or board.dead:
            return None, {}, ""
        answers, exits = board.where([peer], [peer], grace)
        return answers.get(peer), exits, ""
    except Exception as store_error:  # the store may be gone too
        return None, {}, f" (could not ask rank {peer} through the store: {store_error})"


def timed_out(
    comm: Comm, public: str, op: Op, exc: BaseException, closed: bool = False
) -> RuntimeError:
    """The error for ``op`` waiting past the group's timeout (or, ``closed``, for its
    peer closing the connection while alive: its own wait timed out first): where its
    peer is. A peer that left an exit note is gone (:class:`RankGoneError`): gloo may
    not tell a receive posted as its sender died, and it waits out the timeout."""
    me, peer = comm.global_rank(comm.rank), comm.global_rank(op.peer)
    answer, exits, note = _ask(comm, peer)
    if answer is None and peer in exits:
        return _gone(comm, public, op, exits, exc)
    label = debugmode.group_label(comm)
    way = "to" if op.kind == "send" else "from"
    waiting = (
        f"waiting to {op.kind} message #{op.number} {way} rank {peer} (tag {op.tag}, on "
        f"{label}) at {debugmode.call_site()}{note}"
    )
    if closed:
        first = (
            f"{public} failed on rank {me}: rank {peer} closed the connection while this rank "
            f"was {waiting} (its own wait timed out first, or it left the pair out of step)."
        )
    else:
        first = f"{public} timed out on rank {me}, {waiting}."
    lines = [first]
    if answer is not None:
        lines.append(f"Rank {peer} {_where(answer, me)}.")
    elif peer in exits:
        lines.append(f"{_board.describe_exit(peer, exits[peer])}.")
    else:
        lines.append(
            f"Rank {peer} did not answer: it is gone, or busy in code that holds Python's lock."
        )
    lines.append(f"The backend said: {exc}")
    return CollectiveTimeoutError("\n".join(lines), [peer], {peer: answer} if answer else {})


def peer_gone(comm: Comm, public: str, op: Op, exc: BaseException) -> BaseException:
    """The error for ``op`` failing because its peer closed the connection: how it left
    (:class:`RankGoneError`), or, when it is still there, where it is (a
    :class:`CollectiveTimeoutError`: gloo closes a pair whose wait timed out)."""
    peer = comm.global_rank(op.peer)
    found: dict[int, Any] = {}
    try:
        board = _board.board()
        if board is not None:
            deadline = time.monotonic() + 1.0  # the launcher's exit code follows the note
            while True:
                found = board.exits([peer])
                if (found and _board.final(found[peer])) or time.monotonic() >= deadline:
                    break
                time.sleep(_board.POLL)
    except Exception:  # the store went away too
        pass
    if not found:
        answer, exits, _ = _ask(comm, peer)
        if answer is not None:
            return timed_out(comm, public, op, exc, closed=True)
        found = exits or {
            peer: "did not answer a roll call (killed, crashed, or stuck outside Python)"
        }
    return _gone(comm, public, op, found, exc)


def _gone(
    comm: Comm, public: str, op: Op, found: dict, exc: Optional[BaseException]
) -> RankGoneError:
    me, peer = comm.global_rank(comm.rank), comm.global_rank(op.peer)
    note = found.get(peer)
    if isinstance(note, dict):
        told = _board.describe_exit(peer, note)
    else:
        told = f"rank {peer} {note or 'went away'}"
    way = "to" if op.kind == "send" else "from"
    text = (
        f"{public}: {told} while rank {me} waited to {op.kind} message #{op.number} {way} it "
        f"(tag {op.tag}) at {debugmode.call_site()}"
    )
    if exc is not None:
        text += f". The backend said: {exc}"
    return RankGoneError(text, {peer: note if isinstance(note, dict) else {}})
