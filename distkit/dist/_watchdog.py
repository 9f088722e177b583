"""A thread per process that watches its collectives and answers for its rank.

Started with the first collective on a group of several ranks, it wakes every
:data:`TICK` seconds and

- answers roll calls on the world's store (:mod:`distkit.dist._board`): where this rank
  is (the collective it waits in, or the line its main thread runs), and, when another
  rank checks a call that this rank runs unchecked (see :mod:`distkit.dist._check`),
  takes this rank's part in that check;
- reports a stuck collective, once: when this rank has waited in one collective for
  ``DISTKIT_STUCK_AFTER`` seconds (60 by default; 0 turns it off), it prints which ranks
  have not arrived and where every rank of the group is, and keeps waiting: if the slow
  rank arrives, the run goes on.

It reads what the collectives note in their group's facts (:class:`~distkit.dist._comm.
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
from typing import Any, Optional

from distkit import _registry, _settings
from distkit.dist import _board, _check, debug
from distkit.utils.groups import group_ranks

#: Seconds between two rounds of the watchdog.
TICK = 0.5


class _Watchdog:
    def __init__(self) -> None:
        self.next_call = 0  # the next roll call to answer (0: not known yet)
        self.board: Optional[weakref.ref] = None
        self.seen: dict[tuple[int, str, int], float] = {}  # (facts, group, call) -> since
        self.reported: set[tuple[int, str, int]] = set()
        self.wake = threading.Event()
        self.stop = False

    def run(self) -> None:
        """Rounds until no world is left (the thread ends; the next world starts one),
        or until the interpreter begins to exit."""
        global _started
        while True:
            self.wake.wait(TICK)
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
        if board is None:
            self.board = None
        else:
            self.round_on(board)

    def round_on(self, board: _board.Board) -> None:
        if self.board is None or self.board() is not board:  # a new world
            self.board = weakref.ref(board)
            self.next_call = board.add(board.key("roll"), 0) + 1
            self.seen.clear()
            self.reported.clear()
        while board.has(board.key("roll", self.next_call)):
            request = board.read(board.key("roll", self.next_call))
            self.next_call += 1
            self.answer(board, request, self.next_call - 1)
        self.watch(board)

    # -- roll calls -------------------------------------------------------------------

    def answer(self, board: _board.Board, request: dict, k: int) -> None:
        me = board.rank
        if me not in request.get("group", ()) or request.get("from") == me:
            return
        if request.get("kind") == "check":
            self.join(board, request)
            return
        board.post(board.key("roll", k, me), state(board))

    def join(self, board: _board.Board, request: dict) -> None:
        """Take part in a check of the call this rank is blocked in, if it is that one."""
        frames = sys._current_frames()
        for facts in _facts():
            if facts.gid != request["gid"] or facts.seq != request["seq"]:
                continue
            if not facts.thread or facts.checking or facts.call is None:
                continue
            error = _check.join(board, facts, request, frames.get(facts.thread))
            if error is not None:
                facts.failed = (request["seq"], error)
                print(
                    f"distkit: rank {board.rank} is blocked in {facts.call[0]}, which does not "
                    "match the call of other ranks (it raises this error when that call "
                    f"ends):\n{error}",
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
                threading.Thread(
                    target=_report,
                    args=(board, facts, call, facts.seq, now - since),
                    name="distkit-stuck-report",
                    daemon=True,
                ).start()
        for mark in list(self.seen):
            if mark not in current:
                del self.seen[mark]
                self.reported.discard(mark)


_table: dict[int, Any] = {}  # the group facts of distkit.dist._comm (see ensure)


def _facts() -> list[Any]:
    return list(_table.values())


def _ranks_of(facts: Any) -> list[int]:
    if facts.ranks is None:
        pg = facts.ref()
        if pg is None:
            return []
        facts.ranks = group_ranks(pg)
    return list(facts.ranks)


def state(board: _board.Board) -> dict:
    """Where this rank is: the collectives it waits in, and its main thread's line."""
    frames = sys._current_frames()
    inside = []
    busy = set()
    for facts in _facts():
        call, thread = facts.call, facts.thread
        if not thread or call is None:
            continue
        busy.add(thread)
        inside.append(
            {
                "group": _ranks_of(facts),
                "gid": facts.gid,
                "seq": facts.seq,
                "call": call[0],
                "checking": facts.checking,
                "site": debug.call_site(frames.get(thread)),
            }
        )
    main = threading.main_thread().ident
    at = None
    if main not in busy and main in frames:
        at = debug.call_site(frames[main])
    return {"rank": board.rank, "in": inside, "at": at, "pid": os.getpid()}


def _report(board: _board.Board, facts: Any, call: str, seq: int, waited: float) -> None:
    """Print, once for all the ranks waiting in it, who has not arrived at a stuck call
    and where every rank of the group is."""
    try:
        if board.add(board.key("stuck", facts.gid, seq), 1) != 1:
            return  # another rank waiting in this call reports it
        ranks = _ranks_of(facts)
        me = board.rank
        mine = state(board)
        k = board.ask({"kind": "where", "group": ranks, "from": me})
        others = [r for r in ranks if r != me]
        answers = board.answers(k, others, max(4 * TICK, 1.5))
        exits = board.exits([r for r in others if r not in answers])
        print(_stuck_text(facts, call, seq, waited, me, mine, answers, exits), file=sys.stderr)
        sys.stderr.flush()
    except Exception:  # the world went away meanwhile: nothing to report
        pass


def _stuck_text(
    facts: Any,
    call: str,
    seq: int,
    waited: float,
    me: int,
    mine: dict,
    answers: dict[int, dict],
    exits: dict[int, dict],
) -> str:
    ranks = _ranks_of(facts)
    default = facts.gid == "0"
    group = "the default group" if default else f"group {ranks}"
    here = next((c for c in mine["in"] if c["gid"] == facts.gid), None)
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
        there = next((c for c in answer["in"] if c["gid"] == facts.gid), None)
        if there is not None and there["seq"] == seq and there["call"] == call:
            lines.append(f"  rank {r} waits in this call too, at {there['site']}")
        elif there is not None:
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
        else:
            lines.append(
                f"  rank {r} has not arrived: it is at {answer['at']}, not in a distkit collective"
            )
    lines.append(
        "distkit reports a collective once when it has waited DISTKIT_STUCK_AFTER seconds "
        f"(now {float(_settings.get('stuck_after')):g}; 0 turns this off); it is not "
        "stopped: if the missing ranks arrive, the run goes on."
    )
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


def ensure(table: dict[int, Any]) -> None:
    """Start this process's watchdog unless it runs (it ends when no world is left, and
    a forked child has none of its parent's threads); ``table`` holds the facts of every
    group the collectives know (``distkit.dist._comm._FACTS``)."""
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
