"""The default cross-rank check: the first calls at every call site, then a sample.

Debug mode (:mod:`distkit.dist.debug`) checks every collective and costs a round of
communication each time. Without it, a dtype or length mismatch would garble data or
abort gloo, and a skipped collective would hang silently. So, by default, distkit checks
the calls such bugs show up in: the first :data:`VISITS` calls at each call site
(``file:line``) of each group, and after that one call in :data:`SAMPLE`, chosen by the
group's call number (the same calls on every rank).

At a checked call every rank meets on the world's store (:mod:`distkit.dist.guard.board`),
never in a collective, so a check can never be paired with another rank's real call. It
adds a digest of what must match (the collective, the op, dtypes, shapes where they must
match, ``src``/``dst``; for ``all_to_all_single``, the rows each rank sends every other
against the rows that one expects) to one counter, and the last rank to arrive publishes
the total. When the digests differ, every rank posts its call and call site and raises
:class:`CollectiveMismatchError` naming them all, before the backend runs. A call refused
this way takes no call number, so ranks stay in step whichever of them go on. A rank
whose own checks refused its arguments to the call takes its part too, with a part no
valid call agrees with (:func:`distkit.dist.guard.watch.refused`): the others raise,
naming it, instead of pairing the call with that rank's next one.

The ranks' counts of call sites agree while they run the same code, and the sample is
keyed by call number; when they do not (one rank at a new line, another at an old one),
a rank may check a call the others run unchecked, blocked in the backend. Such a rank
does not wait forever: after :data:`ASK_AFTER` seconds one waiting rank posts a roll call,
the watchdog (:mod:`distkit.dist.guard.watchdog`) of every rank of the group says where its
rank is, and the watchdog of a rank in that very call (blocked in it, or with it in flight
through ``async_op=True``) takes its part in the check. A mismatch found that way raises on
the checking ranks and is printed at once by the others (which raise it if their blocked
call then fails). Where the answers show a deadlock (this rank waits for rank 1 here,
rank 1 waits for this rank in a collective of another group, or in a send or recv with
this rank on this group whose other end this rank never posted), the checking rank
raises instead of waiting for the timeout. A peer waiting in a send whose receive this
rank did post (an ``irecv``: its messages after the frame wait for this rank's next
call on the pair) is served: the check posts them, and the peer comes.

Not checked: a call that is not in the sample (a call site seen more than
:data:`VISITS` times), for example a last batch of another length on one rank; and every
collective of a group that ``torch.compile`` traced (traced collectives run without
Python, so ranks' call numbers cannot be kept in step). Debug mode checks every eager call.
"""

from __future__ import annotations

import hashlib
import json
import time
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Optional

from distkit import _settings
from distkit._compat import group_timeout
from distkit.dist import errors
from distkit.dist.core.comm import _FACTS
from distkit.dist.guard import board as _board
from distkit.dist.guard import debugmode, diagnose

if TYPE_CHECKING:
    from distkit.dist.core.comm import Comm, _GroupFacts
    from distkit.dist.guard.board import Board

#: What this rank did of a peer's point-to-point message, asked while this rank waits in
#: a check for that peer: ``serve_p2p(gid, group, kind, peer, tag, number)``, where
#: ``kind`` is the peer's side ("send": it sends message ``number`` of ``tag`` to this
#: rank) on the group ``gid`` of global ranks ``group``.
#: Set by the point-to-point backend (:func:`distkit.dist.backends.p2p.serve`).
serve_p2p: Optional[Callable[..., str]] = None

#: Calls checked at each call site of each group.
VISITS = 3
#: After that, one call in this many is checked (a power of two), chosen by call number.
SAMPLE = 1024
_MIX = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads call numbers (Fibonacci hashing)
_SHIFT = 64 - (SAMPLE.bit_length() - 1)
_MASK64 = (1 << 64) - 1
#: Seconds a rank waits for the others at a check before it asks the watchdogs for help
#: (a quarter of the group's timeout when that is shorter).
ASK_AFTER = 0.5
#: Seconds between two looks for ranks that left, while a check waits (roll calls come
#: less and less often).
EXITS_EVERY = 1.0
_INSIDE = ("distkit.", "torch.")


def site_key(frame: Optional[FrameType]) -> tuple[str, int]:
    """The user's call site above ``frame``: its file and line."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_INSIDE):
        frame = frame.f_back
    if frame is None:
        return ("", 0)
    return (frame.f_code.co_filename, frame.f_lineno)


def sampled(seq: int) -> bool:
    """Whether call number ``seq`` of a group is in the sample (the same on every rank)."""
    return ((seq * _MIX) & _MASK64) >> _SHIFT == 0


def peek(facts: _GroupFacts, seq: int, frame: Optional[FrameType]) -> bool:
    """Whether call ``seq``, made from above ``frame``, will be checked (counting nothing:
    for the lean lane, which steps aside to the checked path when it will)."""
    if facts.traced:
        return False
    return facts.sites.get(site_key(frame), 0) < VISITS or sampled(seq)


def due(facts: _GroupFacts, seq: int, frame: Optional[FrameType]) -> bool:
    """Whether to check call ``seq``, made from above ``frame``; counts the visit."""
    key = site_key(frame)
    visits = facts.sites.get(key, 0)
    if visits < VISITS:
        facts.sites[key] = visits + 1
        return True
    return sampled(seq)


def key_of(board: Board, facts: _GroupFacts, seq: int) -> str:
    """Store key of this rank's check of call ``seq`` of the group.

    A refused call's number is taken again by the next call, so a number can be checked
    more than once: each attempt has a key of its own, and a rank takes the first one
    without a verdict (one with a verdict is an earlier attempt this rank took part in,
    since a verdict needs every rank's part). The attempts of a number stay in the store
    until a later number is checked, so every rank counts them alike.
    """
    attempt = 0
    while board.has(board.key("check", facts.gid, f"{seq}.{attempt}", "done")):
        attempt += 1
    return board.key("check", facts.gid, f"{seq}.{attempt}")


# -- what a rank adds -----------------------------------------------------------------

#: What ``key/done`` holds when the check cannot tell (not a number): go on unchecked.
_SKIP = "skip"
#: What ``key/done`` holds when a rank of the group exited: read ``key/gone``.
_GONE = "gone"


def _plan(size: int) -> tuple[int, int, int]:
    """Bits of the counter, of a digest, and of a row term, so that ``size`` digests and
    ``size * size`` row terms fit in a 62-bit sum."""
    count_bits = (2 * size).bit_length() + 1
    digest_bits = 62 - count_bits - size.bit_length() - 1
    return count_bits, digest_bits, digest_bits - 2 * size.bit_length()


def _hash(value: Any, bits: int) -> int:
    text = json.dumps(value, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> (64 - bits)


def contribution(public: str, fields: dict, must: dict, rank: int, size: int) -> tuple[int, int]:
    """``(digest, term)``: what group rank ``rank`` adds to a check of its call.

    The digest of what must match is the same on every rank that makes the same call.
    For ``all_to_all_single``, the term adds a hash for each count of rows this rank
    sends another and subtracts one for each count it expects from another: over the
    group the terms cancel exactly when every rank expects what is sent to it.
    """
    _, digest_bits, term_bits = _plan(size)
    digest = _hash([public, must], digest_bits)
    term = 0
    if public == "all_to_all_single" and isinstance(fields.get("data"), dict):
        sent, expected = debugmode.splits(fields, size)
        if expected is not None:  # else the sizes travel in headers: nothing to promise
            for other in range(size):
                term += _hash([rank, other, sent[other]], term_bits)
                term -= _hash([other, rank, expected[other]], term_bits)
    return digest, term


def add(board: Board, key: str, digest: int, term: int, size: int) -> Optional[str]:
    """Add a rank's part; return the verdict if this rank was the last (it publishes it at
    ``key/done``, unless a waiting rank published a verdict first), else None."""
    count_bits, _, _ = _plan(size)
    total = board.add(key, ((digest + term) << count_bits) + 1)
    count = total & ((1 << count_bits) - 1)
    if count > size:  # keys of another world on a reused store, or a rank's second part
        return _SKIP
    if count < size:
        return None
    return board.publish(key + "/done", str(total))


def agrees(total: str, digest: int, size: int) -> bool:
    """Whether the published ``total`` says every rank made this rank's call."""
    if not total.lstrip("-").isdigit():
        return True  # _SKIP: no verdict
    count_bits, _, _ = _plan(size)
    return int(total) >> count_bits == digest * size


# -- a rank's own check ---------------------------------------------------------------


def run(comm: Comm, public: str, fields: dict, must: dict, seq: int) -> None:
    """Check call ``seq`` with every rank of ``comm``'s group; raise on a mismatch.

    Raises:
        CollectiveMismatchError: The ranks are not in the same collective, disagree on
            what must match, or wait for each other in collectives of different groups.
        RankGoneError: A rank of the group exited while this one waited here.
        CollectiveTimeoutError: The others did not come within the group's timeout.
    """
    board = _board.board()
    facts = comm._facts
    if board is None or facts is None or board.dead:
        return
    size = comm.size
    digest, term = contribution(public, fields, must, comm.rank, size)
    key = key_of(board, facts, seq)
    facts.checking = True
    try:
        try:
            total = add(board, key, digest, term, size)
            if total is None:
                total = _await(board, key, comm, facts, public, seq)
            elif facts.last_check is not None and facts.last_check[0] != seq:
                # every rank reached this check, so every rank has left those of earlier
                # numbers (not the earlier attempts of this one: key_of reads their
                # verdicts, and a rank that forgot one would take another key)
                for earlier in facts.last_check[1]:
                    _forget(board, earlier)
        except (
            errors.CollectiveTimeoutError,
            errors.RankGoneError,
            errors.CollectiveMismatchError,
        ):
            raise
        except RuntimeError:  # the store failed (what torch raises for it: its host went
            # away): go on unchecked (anything else, as an error a signal handler raises
            # while this rank waits, is the caller's)
            board.dead = True
            return
        if facts.last_check is not None and facts.last_check[0] == seq:
            facts.last_check[1].append(key)
        else:
            facts.last_check = (seq, [key])
    finally:
        facts.checking = False
    if total == _GONE:
        gone = board.read(key + "/gone") or {}
        raise diagnose.gone_error(comm, public, seq, gone, None)
    if agrees(total, digest, size):
        return
    mine = {"call": public, "fields": fields, "must": must, "site": debugmode.call_site()}
    ranks = comm.global_ranks()
    raise mismatch(board, key, ranks, public, mine, seq, debugmode.group_label(comm))


def _forget(board: Board, key: Optional[str]) -> None:
    if key is not None:
        for name in (key, key + "/done", key + "/asked", key + "/roll"):
            try:
                board.store.delete_key(name)
            except Exception:  # already gone, or a store without deletion
                pass


def _await(board: Board, key: str, comm: Comm, facts: _GroupFacts, public: str, seq: int) -> str:
    """Wait for the verdict. After :data:`ASK_AFTER` s the first rank to ask posts a roll
    call (again, less and less often): the watchdogs of ranks blocked in this call take
    their part, and every rank says where it is, which tells exits and deadlocks."""
    timeout = group_timeout(comm.pg)
    limit = timeout.total_seconds() if timeout is not None else 1800.0
    start = time.monotonic()
    deadline = start + limit
    ranks = comm.global_ranks()
    me = ranks[comm.rank]
    others = [r for r in ranks if r != me]
    request = {
        "kind": "check",
        "gid": facts.gid,
        "seq": seq,
        "group": ranks,
        "key": key,
        "from": me,
        "label": debugmode.group_label(comm),
    }
    first = min(ASK_AFTER, limit / 4)
    state: dict[str, Any] = {"at": start + first, "every": first, "asker": None, "roll": None}
    state["exits_at"] = state["at"]

    def left(now: float) -> bool:
        """Whether a rank of the group has left (published); looked for every
        :data:`EXITS_EVERY` seconds whatever the pace of the roll calls."""
        state["exits_at"] = now + EXITS_EVERY
        gone = board.exits(others)
        if gone:
            board.post(key + "/gone", {str(r): note for r, note in gone.items()})
            board.publish(key + "/done", _GONE)
        return bool(gone)

    def on_pause(now: float) -> None:
        roll = state["roll"]
        if roll is not None:  # what the ranks answered the last roll call
            verdict = _blocked(board, roll, others, facts, me)
            if verdict is not None and verdict.get("served"):
                state["every"], state["at"] = first, now + first  # the peer's next, soon
            elif verdict is not None:
                board.post(key + "/stop", verdict)
                board.publish(key + "/done", _GONE if verdict["gone"] else _SKIP)
                return
        if state["asker"] is None and now >= state["at"]:
            state["asker"] = board.add(key + "/asked", 1) == 1
        if state["asker"] and now >= state["exits_at"] and left(now):
            return  # at the first roll call, then every EXITS_EVERY seconds
        if now < state["at"]:
            return
        if state["asker"]:
            state["roll"] = board.ask(request)
            board.post(key + "/roll", state["roll"])  # every waiting rank reads the answers
        else:
            state["roll"] = board.read(key + "/roll")
        state["every"] = min(state["every"] * 2, 8.0)
        state["at"] = now + state["every"]

    total = _wait(board, key + "/done", deadline, on_pause)
    if total is None:
        raise diagnose.diagnose(
            comm,
            public,
            seq,
            TimeoutError(f"distkit's default check waited {limit:g} s for the other ranks"),
        )
    if total in (_SKIP, _GONE) and board.has(key + "/stop"):
        stop = board.read(key + "/stop") or {}
        if stop.get("deadlock"):
            raise errors.CollectiveMismatchError(
                f"{public}: {stop['deadlock']} (found by distkit's default check, at call "
                f"#{seq} on {debugmode.group_label(comm)}; on rank {me}). "
                + stop.get("advice", _ORDER),
                [],
            )
    return total


_ORDER = "Every rank must call the collectives of overlapping groups in the same order."


def entered(gid: str, seq: int) -> bool:
    """Whether this rank has entered call ``seq`` of the group ``gid`` (or a later one):
    a rank said to be "in" that call (still decoding its result, or making it in another
    thread) does not wait for this rank there."""
    for facts in list(_FACTS.values()):
        if facts.gid == gid:
            return facts.seq >= seq
    return False


def _blocked(
    board: Board, roll: int, others: list[int], facts: _GroupFacts, me: int
) -> Optional[dict]:
    """From the answers to a roll call: a deadlock (a rank this check waits for waits, in
    a collective of another group or in a point-to-point call of this one, for this
    rank), ``{"served": True}`` when this rank posted what a peer's send waited for, or
    ``None``.

    A peer waiting in a send for a message this rank did post the receive of is served,
    on any group: a receive's messages after its frame are posted by the receiving rank's
    next call on the pair (an ``irecv`` waited for after a collective), so this rank
    posts them here, and the peer comes. A peer whose main thread waits for a message
    this rank has not posted its side of (a send nobody receives) waits for ever when the
    call is on this group, which no other thread of this rank can use while this one is
    in the check; on another group, or in another thread of the peer (whose main thread
    may still come to this check), it is left to the stuck report."""
    answers = board.answers(roll, others, 0.0)
    for r, answer in sorted(answers.items()):
        for there in answer.get("p2p", ()):
            if me not in there["peers"] or r not in there["group"]:
                continue
            mine = [(kind, number) for kind, peer, number in there.get("ops", ()) if peer == me]
            serve = serve_p2p
            if serve is None or not mine:
                continue
            group, tag = there["group"], there["tag"]
            held = [serve(there["gid"], group, kind, r, tag, n) for kind, n in mine]
            if "served" in held:
                return {"served": True}
            if "missing" not in held or not there.get("main") or there["gid"] != facts.gid:
                continue  # posted; or another thread of this rank or that one may serve it
            return {
                "gone": False,
                "deadlock": (
                    f"rank {r} waits in {there['call']} with rank {me} (tag {there['tag']}) "
                    f"at {there['site']}, while this rank waits for rank {r} here: a "
                    "point-to-point call met a collective"
                ),
                "advice": "Each send needs its receive before the two ranks' next collective.",
            }
        for there in answer.get("in", ()):
            if there["gid"] == facts.gid or me not in there["group"]:
                continue
            if entered(there["gid"], there["seq"]) or not there.get("main", True):
                continue  # this rank was there, or another thread of that rank waits
            return {
                "gone": False,
                "deadlock": (
                    f"rank {r} waits in {there['call']} on group {there['group']} at "
                    f"{there['site']}, which needs this rank, while this rank waits for rank "
                    f"{r} here: a collective was skipped, or the groups are called in "
                    "different orders"
                ),
            }
    return None


def _wait(board: Board, done: str, deadline: float, on_pause: Any = None) -> Optional[str]:
    """Poll for ``done`` until ``deadline``; ``on_pause(now)`` runs between looks."""
    pause = 2e-5
    while True:
        if board.has(done):
            return board.get(done)
        now = time.monotonic()
        if now >= deadline:
            return None
        if on_pause is not None:
            on_pause(now)
        time.sleep(pause)
        pause = min(pause * 2, _board.POLL)


def mismatch(
    board: Board,
    key: str,
    ranks: list[int],
    public: str,
    mine: dict,
    seq: int,
    label: str,
    wait: bool = True,
    by: str = "distkit's default check",
    members: Optional[list[int]] = None,
    note: str = "",
) -> errors.CollectiveMismatchError:
    """Post this rank's call, read every rank's (waiting for them up to the grace unless
    ``wait`` is false), and build the error (found ``by``; ``note``: a line it adds).
    ``members``: the group's global ranks, when ``ranks`` are some of them."""
    board.post(f"{key}/call/{board.rank}", mine)
    grace = float(_settings.get("hang_grace"))
    calls = board.collect({r: f"{key}/call/{r}" for r in ranks}, grace if wait else 0.0)
    rows = []
    for r in ranks:
        call = calls.get(r)
        group_rank = (members or ranks).index(r)
        name = f"rank {r}" if label == "the default group" else f"rank {r} (rank {group_rank})"
        if call is None:
            rows.append(f"  {name}: did not answer within {grace:g} s")
        else:
            rows.append(f"  {name}: {debugmode.format_call(call)}")
    known = [calls[r] for r in ranks if r in calls]  # in rank order
    lines = [
        f"{public}: the ranks of {label} disagree on this collective (found by {by}, at "
        f"call #{seq} on the group; on rank {board.rank}):",
        *rows,
    ]
    refused = debugmode.refusing([f"rank {r}" for r in ranks], [calls.get(r) for r in ranks])
    if refused is not None:
        lines.append(refused)
    elif len({c["call"] for c in known}) > 1:
        lines.append(
            "Every rank must call the same collectives in the same order; a rank that "
            "skips one (a branch on the rank, an early return) shows up here in its next "
            "collective."
        )
    elif known:
        first = known[0]
        diff = sorted(
            k for k in first["must"] if len({json.dumps(c["must"].get(k)) for c in known}) > 1
        )
        if diff:
            lines.append(f"They must agree on: {', '.join(diff)}.")
        elif len(known) == len(ranks):
            lines += [f"  {p}" for p in debugmode.inconsistent(public, known)]
    if note:
        lines.append(note)
    lines.append(
        "(DISTKIT_CHECK=0 turns the default check off; DISTKIT_DEBUG=1 checks every call.)"
    )
    ordered = [calls.get(r, {}) for r in ranks]
    return errors.CollectiveMismatchError("\n".join(lines), ordered)


# -- a check another rank makes of a call this rank runs unchecked ---------------------


class Joined:
    """This rank's part in another rank's check of a call it runs unchecked, added by the
    watchdog while the call is blocked or in flight; :meth:`verdict` is polled."""

    def __init__(self, facts: Any, request: dict, call: tuple, site: str, rank: int) -> None:
        self.facts = facts
        self.request = request
        self.call = call
        self.site = site
        self.posted = 0.0  # when this rank's call was posted (a mismatch), 0: not yet
        public, name, params, args = call
        _, self.fields, self.must = debugmode.signature(name, dict(zip(params, args)))
        ranks = request["group"]
        self.size = len(ranks)
        self.digest, self.term = contribution(
            public, self.fields, self.must, ranks.index(rank), self.size
        )

    def add(self, board: Board) -> None:
        add(board, self.request["key"], self.digest, self.term, self.size)

    def verdict(self, board: Board) -> tuple[bool, Any]:
        """``(finished, error)``: whether the check is over for this rank, and the
        :class:`CollectiveMismatchError` it found (``None``: the ranks agree)."""
        key = self.request["key"]
        if not self.posted:
            if not board.has(key + "/done"):
                return False, None
            total = board.get(key + "/done")
            if agrees(total, self.digest, self.size) or total == _GONE:
                return True, None
            public = self.call[0]
            mine = {"call": public, "fields": self.fields, "must": self.must, "site": self.site}
            board.post(f"{key}/call/{board.rank}", mine)
            self.posted = time.monotonic()
        ranks = self.request["group"]
        calls = {r: f"{key}/call/{r}" for r in ranks}
        seen = board.collect(calls, 0.0)
        if len(seen) < len(ranks) and time.monotonic() - self.posted < float(
            _settings.get("hang_grace")
        ):
            return False, None
        error = mismatch(
            board,
            key,
            ranks,
            self.call[0],
            {"call": self.call[0], "fields": self.fields, "must": self.must, "site": self.site},
            self.request["seq"],
            self.request["label"],
            wait=False,
            by=self.request.get("by", "distkit's default check"),
            members=self.request.get("members"),
            note=self.request.get("note", ""),
        )
        return True, error
