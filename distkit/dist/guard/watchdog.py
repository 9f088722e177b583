"""A thread per process that watches its collectives and answers for its rank.

Started with the first collective on a group of several ranks, it wakes every
:data:`TICK` seconds and

- answers roll calls on the world's store (:mod:`distkit.dist.guard.board`): where this rank
  is (the collective it waits in, or the line its main thread runs), and, when another
  rank checks a call that this rank runs unchecked (see :mod:`distkit.dist.guard.check`),
  takes this rank's part in that check;
- reports a stuck collective, once: when this rank has waited in one collective for
  ``DISTKIT_STUCK_AFTER`` seconds (60 by default; 0 turns it off), it prints which ranks
  have not arrived and where every rank of the group is, and keeps waiting: if the slow
  rank arrives, the run goes on. When every rank is in that call, it checks the call
  with them (as the default check would: another ``dst`` on one rank, at a call the
  check skipped) and prints the mismatch, which each rank raises when the call fails.

It reads what the collectives note in their group's facts (:class:`~distkit.dist.core.comm.
_GroupFacts`: the thread in a collective, its call number, the call), and other threads'
stacks through ``sys._current_frames()``: none of it costs the collectives anything.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any, Optional

from distkit import _registry, _settings
from distkit.dist.guard import board as _board
from distkit.dist.guard import check as _check
from distkit.dist.guard import debugmode
from distkit.utils.groups import group_ranks

#: Seconds between two rounds of the watchdog.
TICK = 0.5

#: Seconds a stuck report waits for the ranks' answers to its roll call. A rank answers
#: within a round of its watchdog, unless the machine is so loaded that the thread waits
#: for a core (2 s were once too few, with two CPU burners beside the test suite): only
#: a report naming a rank that does not answer (gone, or holding Python's lock) waits it
#: out, and it comes after DISTKIT_STUCK_AFTER seconds anyway.
ANSWERS_WITHIN = 10 * TICK


class _Watchdog:
    def __init__(self) -> None:
        self.next_call = 0  # the next roll call to answer (0: not known yet)
        self.board: Optional[weakref.ref] = None
        self.seen: dict[tuple[int, str, int], float] = {}  # (facts, group, call) -> since
        self.reported: set[tuple[int, str, int]] = set()
        self.joined: dict[str, _check.Joined] = {}  # checks this rank takes part in
        self.lock = threading.Lock()
        self.finished: deque[str] = deque(maxlen=256)  # ... and the last ones it finished
        self.wake = threading.Event()
        self.stop = False

    def run(self) -> None:
        """Rounds until no world is left (the thread ends; the next world starts one),
        or until the interpreter begins to exit."""
        global _started
        while True:
            self.wake.wait(tick())
            with _start_lock:
                if self.stop or _registry.current._default_pg is None:
                    _started = None
                    return
            try:
                self.round()
            except Exception:  # the world went away under it: try again next round
                pass

    def round(self) -> None:
        board = _board.board()
        if board is None or board.dead:
            self.board = None
            return
        try:
            self.round_on(board)
        except Exception:  # the store failed (its host went away): stop asking it
            try:  # ... unless it still answers: then the next round tries again
                board.has(board.key("roll"))
            except Exception:
                board.dead = True

    def round_on(self, board: _board.Board) -> None:
        if self.board is None or self.board() is not board:  # a new world
            self.board = weakref.ref(board)
            self.next_call = board.add(board.key("roll"), 0) + 1
            self.seen.clear()
            self.reported.clear()
            self.joined.clear()
        if board.host is not None and board.host != board.rank:
            if board.has(board.key("host-leaving")):  # the store goes with its host
                board.add(board.key("host-left-heard"), 1)
                board.dead = True
                return
        while board.has(board.key("roll", self.next_call)):
            request = board.read(board.key("roll", self.next_call))
            self.next_call += 1
            if request is not None:
                self.answer(board, request, self.next_call - 1)
        self.settle(board)
        self.watch(board)

    # -- roll calls -------------------------------------------------------------------

    def answer(self, board: _board.Board, request: dict, k: int) -> None:
        me = board.rank
        if me not in request.get("group", ()) or request.get("from") == me:
            return
        board.post(board.key("roll", k, me), state(board))
        if request.get("kind") == "check":
            self.join(board, request)

    def join(self, board: _board.Board, request: dict) -> None:
        """Take this rank's part in a check of a call it runs unchecked: blocked in it,
        or with it in flight (``async_op=True``). Once per check."""
        key = request["key"]
        if key in self.joined or key in self.finished:
            return
        joined = _part(board, request)
        if joined is not None:
            self.joined[key] = joined
            joined.add(board)

    def settle(self, board: _board.Board, only: Any = None) -> Optional[BaseException]:
        """Follow the checks this rank took part in for its blocked calls, to their
        verdict; a mismatch is printed at once, and raised if the blocked call fails.

        ``only``: ``(facts, seq)`` of one blocked call, whose error (if any) is returned.
        """
        found = None
        with self.lock:  # the watchdog and a failing call may both settle a check
            for key, joined in list(self.joined.items()):
                if only is not None and (joined.facts, joined.request["seq"]) != only:
                    continue
                finished, error = joined.verdict(board)
                if finished:
                    del self.joined[key]
                    self.finished.append(key)
                    if error is not None:
                        self.tell(board, joined, error)
                        found = error
        return found

    def tell(self, board: _board.Board, joined: _check.Joined, error: BaseException) -> None:
        """Record ``error`` for the blocked call (raised if it fails), and print it now."""
        facts, seq = joined.facts, joined.request["seq"]
        if _in_progress(facts, seq):
            facts.failed = (seq, error)
        if joined.request.get("stuck"):
            return  # the rank that reports the stuck call prints it, once
        print(
            f"distkit: rank {board.rank} is in {joined.call[0]} (its call #{seq} on "
            f"{joined.request['label']}) at {joined.site}, and rank "
            f"{joined.request['from']} checked that call: they disagree. The checking "
            "ranks raise; this rank raises the same error if its call fails.\n"
            f"{error}",
            file=sys.stderr,
            flush=True,
        )

    # -- stuck collectives ------------------------------------------------------------

    def watch(self, board: _board.Board) -> None:
        after = float(_settings.get("stuck_after"))
        if after <= 0:
            return
        now = time.monotonic()
        current = set()
        for facts in _facts():
            if not facts.thread or facts.call is None or facts.size < 2:
                continue
            mark = (id(facts), facts.gid, facts.seq)
            current.add(mark)
            since = self.seen.setdefault(mark, now)
            if now - since >= after and mark not in self.reported:
                self.reported.add(mark)
                call = facts.call[0]
                _start_report(_report, (board, facts, call, facts.seq, now - since))
        for facts in _facts():  # async_op=True calls whose handle a thread waits for
            for seq, (call, ref) in list(facts.pending.items()):
                handle = ref()
                if handle is None or not handle._waiting or facts.size < 2:
                    continue
                mark = (id(facts), facts.gid, seq)
                current.add(mark)
                since = self.seen.setdefault(mark, now)
                if now - since >= after and mark not in self.reported:
                    self.reported.add(mark)
                    _start_report(_report, (board, facts, call[0], seq, now - since))
        for facts in _facts():  # point-to-point waits: each waiting rank reports its own
            for key, note in list(facts.p2p.items()):
                mark = (id(facts), "p2p", key)
                current.add(mark)
                since = self.seen.setdefault(mark, now)
                if now - since >= after and mark not in self.reported:
                    self.reported.add(mark)
                    _start_report(_report_p2p, (board, facts, note, now - since))
        for mark in list(self.seen):
            if mark not in current:
                del self.seen[mark]
                self.reported.discard(mark)


_table: dict[int, Any] = {}  # the group facts of distkit.dist._comm (see ensure)


def _part(board: _board.Board, request: dict) -> Optional[_check.Joined]:
    """This rank's part in the check ``request`` asks for, of the call it is blocked in
    (or has in flight, ``async_op=True``) on that group with that number; ``None`` when
    it is in no such call."""
    frames = sys._current_frames()
    seq = request["seq"]
    for facts in _facts():
        if facts.gid != request["gid"]:
            continue
        if facts.thread and facts.seq == seq and not facts.checking and facts.call:
            call, frame = facts.call, frames.get(facts.thread)
        elif seq in facts.pending and facts.pending[seq][1]() is not None:
            call, handle = facts.pending[seq][0], facts.pending[seq][1]()
            frame = frames.get(handle._waiting) if handle is not None else None
        else:
            continue
        site = debugmode.call_site(frame) if frame is not None else "(in flight: async_op=True)"
        return _check.Joined(facts, request, call, site, board.rank)
    return None


def _in_progress(facts: Any, seq: int) -> bool:
    """Whether call ``seq`` of the group is still running here: blocked in, or in flight
    (``async_op=True``, its handle not yet waited for or still waiting)."""
    return bool(facts.thread and facts.seq == seq) or seq in facts.pending


def tick() -> float:
    """Seconds between rounds: :data:`TICK`, or less for groups with short timeouts (a
    check one rank makes alone must end well within them)."""
    shortest = min((f.timeout for f in _facts() if f.timeout), default=None)
    return TICK if shortest is None else max(0.05, min(TICK, shortest / 8))


def _facts() -> list[Any]:
    return list(_table.values())


def _ranks_of(facts: Any) -> list[int]:
    """The group's global ranks; ``[]`` once it is gone (collected, or destroyed before
    its ranks were read: torch forgets them, and a roll call must still be answered)."""
    if facts.ranks is None:
        pg = facts.ref()
        if pg is None:
            return []
        try:
            facts.ranks = group_ranks(pg)
        except Exception:  # destroyed (KeyError in torch's table, or another on others)
            return []
    return list(facts.ranks)


def state(board: _board.Board) -> dict:
    """Where this rank is: the collectives it waits in (``in``), those it has in flight
    (``flight``, ``async_op=True``), the point-to-point calls it waits in (``p2p``), and
    its main thread's line (``at``)."""
    frames = sys._current_frames()
    inside, flight, pairs = [], [], []
    busy = set()
    for facts in _facts():
        call, thread = facts.call, facts.thread
        ranks = _ranks_of(facts)
        if not ranks:  # a group that is gone: nothing of it to tell
            continue
        if thread and call is not None:
            busy.add(thread)
            inside.append(
                {
                    "group": ranks,
                    "gid": facts.gid,
                    "seq": facts.seq,
                    "call": call[0],
                    "checking": facts.checking,
                    "site": debugmode.call_site(frames.get(thread)),
                    "main": thread == threading.main_thread().ident,
                }
            )
        for seq, (pending, ref) in list(facts.pending.items()):
            handle = ref()
            if handle is None:
                continue
            flight.append({"group": ranks, "gid": facts.gid, "seq": seq, "call": pending[0]})
            waiting = handle._waiting
            if waiting:  # a thread waits for it: it is in that call, as a blocking one
                busy.add(waiting)
                inside.append(
                    {
                        "group": ranks,
                        "gid": facts.gid,
                        "seq": seq,
                        "call": pending[0],
                        "checking": False,
                        "site": debugmode.call_site(frames.get(waiting)),
                        "main": waiting == threading.main_thread().ident,
                    }
                )
        for public, peers, tag, ident, ops in list(facts.p2p.values()):
            busy.add(ident)
            pairs.append(
                {
                    "group": ranks,
                    "gid": facts.gid,
                    "call": public,
                    "peers": [ranks[p] for p in peers if 0 <= p < len(ranks)],
                    "tag": tag,
                    "site": debugmode.call_site(frames.get(ident)),
                    "main": ident == threading.main_thread().ident,
                    # [kind, peer (global), number] of each message it waits for
                    "ops": [
                        [op.kind, ranks[op.peer], op.number]
                        for op in ops
                        if 0 <= op.peer < len(ranks)
                    ],
                }
            )
    main = threading.main_thread().ident
    at = None
    if main not in busy and main in frames:
        at = debugmode.call_site(frames[main])
    return {
        "rank": board.rank,
        "in": inside,
        "flight": flight,
        "p2p": pairs,
        "at": at,
        "pid": os.getpid(),
    }


#: The stuck reports being written (each asks the store for a second or two): joined at
#: exit, as the watchdog is (see :func:`_stop_at_exit`).
_reports: list[threading.Thread] = []


def _start_report(target: Any, args: tuple) -> None:
    _reports[:] = [t for t in _reports if t.is_alive()]
    thread = threading.Thread(target=target, args=args, name="distkit-stuck-report", daemon=True)
    _reports.append(thread)
    thread.start()


def _report(board: _board.Board, facts: Any, call: str, seq: int, waited: float) -> None:
    """Print, once for all the ranks waiting in it, who has not arrived at a stuck call
    and where every rank of the group is."""
    try:
        if board.add(board.key("stuck", facts.gid, seq), 1) != 1:
            return  # another rank waiting in this call reports it
        ranks = _ranks_of(facts)
        me = board.rank
        mine = state(board)
        others = [r for r in ranks if r != me]
        answers, exits = board.where(ranks, others, ANSWERS_WITHIN)
        found = None
        where = {r: _position(answers.get(r), facts.gid, seq, call)[0] for r in others}
        within = [r for r in others if where[r] in ("same", "flight")]
        passed = [r for r in others if where[r] == "ahead"]
        if len(within) + len(passed) < len(others):
            passed = []  # a rank that has not come may be what holds the call: a slow
            # rank, not ranks that disagree (a gather's senders finish before it comes)
        elif within:  # every rank is in the call, or past it (a call some ranks finish
            # first, as a gather's senders do): those in it are checked
            found = _check_stuck(board, facts, seq, ranks, sorted([me, *within]), passed)
        text = _stuck_text(facts, call, seq, waited, me, mine, answers, exits, found, passed)
        print(text, file=sys.stderr)
        sys.stderr.flush()
    except Exception:  # the world went away meanwhile: nothing to report
        pass


def _position(answer: Optional[dict], gid: str, seq: int, call: str) -> tuple[str, dict]:
    """Where a rank is against call ``seq`` of the group, from its answer to a roll call:
    ``("same", c)`` waits in it; ``("flight", c)`` has it in flight (``async_op=True``,
    not waited for yet; ``c``: what it waits in meanwhile, if anything); ``("ahead", c)``
    waits only in later calls of the group (it finished this one); ``("behind", c)``
    waits in an earlier one; ``("other", c)`` in another call of that number; ``("", {})``
    in no call of the group."""
    if answer is None:
        return "", {}
    entries = [c for c in answer["in"] if c["gid"] == gid]
    for c in entries:
        if c["seq"] == seq and c["call"] == call:
            return "same", c
    if any(f["gid"] == gid and f["seq"] == seq for f in answer.get("flight", ())):
        return "flight", entries[0] if entries else {}
    if entries and all(c["seq"] > seq for c in entries):
        return "ahead", min(entries, key=lambda c: c["seq"])
    for c in entries:
        if c["seq"] < seq:
            return "behind", c
    return ("other", entries[0]) if entries else ("", {})


def _ranks_named(ranks: Sequence[int]) -> str:
    """``rank 1``, ``ranks 1, 3``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


_DISAGREE = (
    "Every rank is in this call, and they disagree on it, so it cannot complete; each rank "
    "raises this error when the group's timeout ends the call:\n"
)
_DISAGREE_PASSED = (
    "The ranks still in this call disagree on it, so it cannot complete; each of them "
    "raises this error when the group's timeout ends the call:\n"
)
_PASSED = (
    "{passed} finished this call while the others still wait in it: the ranks disagree "
    "on a call some ranks finish first (gather, reduce or scatter with another dst or "
    "src on some ranks)."
)


def _check_stuck(
    board: _board.Board,
    facts: Any,
    seq: int,
    ranks: list[int],
    among: list[int],
    passed: Sequence[int] = (),
) -> Optional[BaseException]:
    """Check the stuck call ``seq`` of the group of global ``ranks`` among the ranks of
    it that wait in it (``among``; the others, ``passed``, finished it), as the default
    check does (the call was past its sample: a line run many times, with another
    ``dst`` on one rank): the others' watchdogs take their parts. The mismatch found,
    or ``None`` (they agree, or the call ended meanwhile). Every rank still in the call
    raises it when the call fails (the group's timeout) instead of a timeout that says
    the ranks all waited in the same call."""
    label = "the default group" if facts.gid == "0" else f"group {ranks}"
    request = {
        "kind": "check",
        "gid": facts.gid,
        "seq": seq,
        "group": among,
        "key": board.key("stuck", facts.gid, seq, "check"),
        "from": board.rank,
        "label": label,
        "stuck": True,  # see _Watchdog.tell
        "by": "distkit's stuck report",
        "members": ranks,
    }
    if passed:
        request["note"] = _PASSED.format(passed=_ranks_named(passed).capitalize())
    mine = _part(board, request)
    if mine is None:
        return None
    board.ask(request)  # the other ranks' watchdogs take their parts
    mine.add(board)
    deadline = time.monotonic() + ANSWERS_WITHIN + float(_settings.get("hang_grace"))
    while time.monotonic() < deadline:
        finished, error = mine.verdict(board)
        if finished:
            if error is not None and _in_progress(facts, seq):
                facts.failed = (seq, error)  # raised when the call fails (see watch._better)
            return error
        time.sleep(_board.POLL)
    return None


def _report_p2p(board: _board.Board, facts: Any, note: tuple, waited: float) -> None:
    """Print where the peers of a point-to-point call this rank is stuck in are."""
    public, peers, tag, ident, _ = note
    try:
        ranks = _ranks_of(facts)
        me = board.rank
        others = [ranks[p] for p in peers if 0 <= p < len(ranks) and ranks[p] != me]
        site = debugmode.call_site(sys._current_frames().get(ident))
        answers, exits = board.where(ranks, others, ANSWERS_WITHIN)
        who = ", ".join(f"rank {r}" for r in others)
        group = "" if facts.gid == "0" else f" on group {ranks}"
        lines = [
            f"distkit: rank {me} has waited {waited:.0f} s in {public} with {who}{group} "
            f"(tag {tag}) at {site}, and keeps waiting:"
        ]
        lines += [f"  {where_is(r, answers.get(r), exits)}" for r in others]
        lines.append(_STUCK_FOOTER.format(float(_settings.get("stuck_after"))))
        print("\n".join(lines), file=sys.stderr)
        sys.stderr.flush()
    except Exception:  # the world went away meanwhile: nothing to report
        pass


def where_is(r: int, answer: Optional[dict], exits: dict[int, dict]) -> str:
    """Where rank ``r`` is, from its answer to a roll call (``None``: it gave none; then
    its exit note in ``exits``, if it left one)."""
    if answer is None:
        if r in exits:
            return _board.describe_exit(r, exits[r])
        return f"rank {r} did not answer: it is gone, or busy in code that holds Python's lock"
    if answer.get("p2p"):
        other = answer["p2p"][0]
        with_ = ", ".join(f"rank {p}" for p in other["peers"])
        return (
            f"rank {r} waits in {other['call']} with {with_} (tag {other['tag']}) at "
            f"{other['site']}"
        )
    if answer["in"]:
        other = answer["in"][0]
        return f"rank {r} waits in {other['call']} on group {other['group']} at {other['site']}"
    return f"rank {r} is at {answer['at']}, not in a distkit call"


_STUCK_FOOTER = (
    "distkit reports a call once when it has waited DISTKIT_STUCK_AFTER seconds (now {:g}; "
    "0 turns this off); it is not stopped: if the missing ranks arrive, the run goes on."
)


def _stuck_text(
    facts: Any,
    call: str,
    seq: int,
    waited: float,
    me: int,
    mine: dict,
    answers: dict[int, dict],
    exits: dict[int, dict],
    found: Optional[BaseException] = None,
    passed: Sequence[int] = (),
) -> str:
    ranks = _ranks_of(facts)
    default = facts.gid == "0"
    group = "the default group" if default else f"group {ranks}"
    here = next((c for c in mine["in"] if c["gid"] == facts.gid and c["seq"] == seq), None)
    site = here["site"] if here else "<unknown>"
    lines = [
        f"distkit: rank {me} has waited {waited:.0f} s in {call} (its call #{seq} on "
        f"{group}) at {site}, and keeps waiting:"
    ]
    for r in ranks:
        if r == me:
            continue
        answer = answers.get(r)
        if answer is None:
            if r in exits:
                lines.append(f"  {_board.describe_exit(r, exits[r])}")
            else:
                lines.append(
                    f"  rank {r} did not answer: it is gone, or busy in code that holds "
                    "Python's lock"
                )
            continue
        kind, there = _position(answer, facts.gid, seq, call)
        if kind == "same":
            lines.append(f"  rank {r} waits in this call too, at {there['site']}")
        elif kind == "flight":
            meanwhile = (
                f", and waits in {there['call']} (its call #{there['seq']} on this group) "
                f"at {there['site']}"
                if there
                else ""
            )
            lines.append(f"  rank {r} has this call in flight (async_op=True){meanwhile}")
        elif kind == "ahead":
            lines.append(
                f"  rank {r} has passed this call: it waits in {there['call']} (its call "
                f"#{there['seq']} on this group) at {there['site']}"
            )
        elif kind == "behind":
            flying = any(f["gid"] == facts.gid and f["seq"] == there["seq"] for f in mine["flight"])
            has = "has in flight" if flying else "has passed"
            lines.append(
                f"  rank {r} waits in {there['call']} (its call #{there['seq']} on this "
                f"group) at {there['site']}: a call this rank {has}"
            )
        elif kind == "other":
            lines.append(
                f"  rank {r} waits in {there['call']} (its call #{there['seq']} on this "
                f"group) at {there['site']}: not the same call"
            )
        elif answer["in"]:
            other = answer["in"][0]
            lines.append(
                f"  rank {r} has not arrived: it waits in {other['call']} on group "
                f"{other['group']} at {other['site']}"
            )
        elif answer.get("p2p"):
            other = answer["p2p"][0]
            peers = ", ".join(f"rank {p}" for p in other["peers"])
            lines.append(
                f"  rank {r} has not arrived: it waits in {other['call']} with {peers} (tag "
                f"{other['tag']}) at {other['site']}"
            )
        else:
            lines.append(
                f"  rank {r} has not arrived: it is at {answer['at']}, not in a distkit collective"
            )
    who = _ranks_named(passed)
    if found is not None and passed:  # the mismatch the ranks still in it were checked for
        lines.append(_DISAGREE_PASSED + str(found))
    elif found is not None:
        lines.append(_DISAGREE + str(found))
    else:
        if passed:
            lines.append(_PASSED.format(passed=who.capitalize()))
        lines.append(_STUCK_FOOTER.format(float(_settings.get("stuck_after"))))
    return "\n".join(lines)


_started: Optional[int] = None  # the pid whose watchdog runs
_start_lock = threading.Lock()
_running: Optional[tuple[_Watchdog, threading.Thread]] = None


def _stop_at_exit() -> None:
    """End the watchdog before the interpreter exits: a daemon thread still running
    (in a store call, or holding a process group for a moment) while the interpreter
    tears down makes the process abort ("terminate called without an active exception")."""
    found = _running
    if found is not None and found[1].is_alive():
        found[0].stop = True
        found[0].wake.set()
        found[1].join(timeout=2 * TICK + 5.0)
    deadline = time.monotonic() + 5.0  # a stuck report in a store call: the same abort
    for thread in list(_reports):
        thread.join(timeout=max(deadline - time.monotonic(), 0.0))


def verdict(facts: Any, seq: int, seconds: float = 2.0) -> Optional[BaseException]:
    """The mismatch another rank's check found in call ``seq`` of ``facts``' group while
    this rank ran it unchecked (blocked in the backend), waiting up to ``seconds`` for the
    check to end; ``None`` when there is none. For a call that failed because its peer
    left: the peer may have left because of that check."""
    found = _running
    board = _board.board()
    if found is None or board is None:
        return None
    dog = found[0]
    deadline = time.monotonic() + seconds
    while any(j.facts is facts and j.request["seq"] == seq for j in list(dog.joined.values())):
        error = dog.settle(board, (facts, seq))
        if error is not None or time.monotonic() >= deadline:
            return error
        time.sleep(_board.POLL)
    return None


def ensure(table: dict[int, Any]) -> None:
    """Start this process's watchdog unless it runs (it ends when no world is left, and
    a forked child has none of its parent's threads); ``table`` holds the facts of every
    group the collectives know (``distkit.dist.core.comm._FACTS``)."""
    global _started, _table, _running
    _table = table
    if _started == os.getpid():
        return
    with _start_lock:
        if _started == os.getpid():
            return
        if _running is None:
            atexit.register(_stop_at_exit)
        _started = os.getpid()
        dog = _Watchdog()
        thread = threading.Thread(target=dog.run, name="distkit-watchdog", daemon=True)
        _running = (dog, thread)
        thread.start()
