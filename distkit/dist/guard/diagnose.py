"""Errors that name names: which ranks never arrived at a collective, and where they are;
which rank went away, and how.

When a collective waits longer than its group's timeout, the rank posts where it is
waiting to the world's store, waits a few seconds (the *grace*) for the other ranks of
the group to post theirs, and raises :class:`CollectiveTimeoutError` naming the ranks
that never arrived and where they are waiting instead of the backend's bare timeout. A
post is removed when its rank leaves the collective, so a later timeout never reads an
earlier one's post. This costs one counter increment per collective until a timeout
happens.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Optional

from distkit import _registry, _settings
from distkit._compat import default_store
from distkit.dist.errors import CollectiveTimeoutError, RankGoneError
from distkit.dist.guard import board as _board
from distkit.dist.guard.board import describe_exit
from distkit.dist.guard.debugmode import call_site, group_label

if TYPE_CHECKING:
    from distkit.dist.core.comm import Comm


def is_timeout(exc: BaseException) -> bool:
    """Whether a backend exception says a collective timed out."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _key(global_rank: int) -> str:
    return f"distkit/where/{global_rank}"


#: Seconds between looks at the other ranks' posts, and how long a rank's post stays
#: after it read the others' (a rank that found every post at once must not take its own
#: away before the others looked)
_POLL = 0.05
_LINGER = 4 * _POLL


#: This process's posts, by thread: a rank's post holds all of them, so two of its
#: threads timing out at once (a handle waited in one, a collective in another) neither
#: write over each other's nor take it away
_posts: dict[int, dict] = {}
_posts_lock = threading.Lock()


def post(store: Any, me: int, where: dict) -> None:
    """Post where this thread of global rank ``me`` waits (beside its other threads')."""
    with _posts_lock:
        _posts[threading.get_ident()] = where
        store.set(_key(me), json.dumps(list(_posts.values())))


def unpost(store: Any, me: int) -> None:
    """Take this thread's post away (the rank's key goes with its last)."""
    with _posts_lock:
        _posts.pop(threading.get_ident(), None)
        if _posts:
            store.set(_key(me), json.dumps(list(_posts.values())))
        else:
            store.delete_key(_key(me))


def _after_fork() -> None:
    global _posts_lock
    _posts.clear()  # the parent's threads are not the child's
    _posts_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def posts_of(store: Any, rank: int) -> list[dict]:
    """Where the threads of global rank ``rank`` that report a timeout wait (its posts;
    none when it reports none)."""
    key = _key(rank)
    if not store.check([key]):
        return []
    return json.loads(store.get(key))


def _pick(posts: list[dict], gid: str, seq: int) -> dict:
    """Of a rank's posts (one per thread of it that timed out), the one in call ``seq``
    of group ``gid``, else one on that group, else the first."""
    return min(
        posts,
        key=lambda p: (p.get("gid") != gid, p.get("seq") != seq and seq not in p.get("flight", ())),
    )


def _gather_posts(store: Any, others: list[int], gid: str, seq: int) -> dict[int, dict]:
    """The other ranks' posts (of each, the one that concerns call ``seq`` of group
    ``gid``), waiting up to the grace for each to appear."""
    reports: dict[int, dict] = {}
    deadline = time.monotonic() + float(_settings.get("hang_grace"))
    pending = list(others)
    while pending and time.monotonic() < deadline:
        for r in list(pending):
            posts = posts_of(store, r)
            if posts:
                reports[r] = _pick(posts, gid, seq)
                pending.remove(r)
        if pending:
            time.sleep(_POLL)
    return reports


def _label(comm: Comm, global_rank: int) -> str:
    """``rank 2`` (global), with its place in a sub-group: ``rank 2 (rank 1 of group [1, 2])``."""
    if comm.pg is _registry.current._default_pg:
        return f"rank {global_rank}"
    return f"rank {global_rank} (rank {comm.rank} of {group_label(comm)})"


def diagnose(
    comm: Comm, public: str, seq: int, exc: BaseException, closed: bool = False
) -> CollectiveTimeoutError:
    """Ask the store where every rank of the group is; build the error to raise
    (``closed``: the call failed because a rank that is still there closed its
    connection, as gloo does when that rank's own wait times out).

    Ranks are named by their global rank (what launchers and logs show), with their
    rank within a sub-group beside it.
    """
    site = call_site()
    ranks = comm.global_ranks()
    me = ranks[comm.rank]
    # the group's id too: two groups of the same ranks number their calls apart
    facts = comm._facts
    gid = facts.gid if facts is not None else ""
    # this rank's calls of the group in flight (async_op=True): it is in those as well
    flight = [] if facts is None else _in_flight(facts)
    where = {"group": ranks, "gid": gid, "call": public, "seq": seq, "site": site, "flight": flight}
    reports: dict[int, dict] = {}
    note = ""
    store = None
    try:
        store = default_store()
        post(store, me, where)
        reports = _gather_posts(store, [r for r in ranks if r != me], gid, seq)
    except Exception as store_error:  # the store may be gone too
        note = f" (could not ask the other ranks through the store: {store_error})"
    finally:
        if store is not None:
            # others that posted as this rank read theirs may not have read this one
            # yet: they look every POLL seconds
            time.sleep(_LINGER)
            try:  # leaving this collective: a later timeout must not read this post
                unpost(store, me)
            except Exception:
                pass
    gone: dict[int, dict] = {}  # how the ranks that posted nothing left, if they did
    silent = [r for r in ranks if r != me and r not in reports]
    if silent and not note:
        try:
            board = _board.board()
            if board is not None and not board.dead:
                gone = board.exits(silent)
        except Exception:  # the store went away meanwhile
            pass
    same, missing, elsewhere, passed, ahead, behind = [], [], [], [], [], []
    grace = float(_settings.get("hang_grace"))
    for r in ranks:
        if r == me:
            continue
        report = reports.get(r)
        ours = report is not None and report["group"] == ranks and report.get("gid") == gid
        if ours and report is not None and report["seq"] == seq and report["call"] == public:
            same.append(r)
            continue
        if ours and report is not None and seq in report.get("flight", ()):
            same.append(r)  # it has this call in flight, and waits in a later one
            continue
        if ours and report and report["seq"] > seq:
            passed.append(r)  # it finished this call (see _PASSED)
            ahead.append(
                f"rank {r} is waiting in {report['call']} (its call #{report['seq']} on "
                f"this group) at {report['site']}"
            )
            continue
        missing.append(r)
        if ours and report and report["seq"] < seq:
            behind.append(r)  # it waits in a call this rank finished
        if report:
            group = "this group" if ours else f"group {report['group']}"
            elsewhere.append(
                f"rank {r} is waiting in {report['call']} (its call "
                f"#{report['seq']} on {group}) at {report['site']}"
            )
        elif r in gone:
            elsewhere.append(describe_exit(r, gone[r]))
        else:
            elsewhere.append(
                f"rank {r} posted nothing within {grace:g} s: it is not waiting "
                "in a distkit collective (busy, blocked elsewhere, or dead)"
            )
    where_me = _label(comm, me)
    group = "this group" if comm.pg is not _registry.current._default_pg else "the default group"
    if closed:
        first = (
            f"{public} failed on {where_me} (its call #{seq} on {group}, at {site}){note}: "
            "another rank of the group, still there, closed its connection (as gloo does "
            "when a rank's wait times out), so this call cannot complete."
        )
    else:
        first = f"{public} timed out on {where_me} (its call #{seq} on {group}, at {site}){note}."
    lines = [first]
    if missing:
        lines.append(f"Rank(s) {', '.join(map(str, missing))} never arrived at this call:")
        lines += [f"  {line}" for line in elsewhere]
    # a rank that has not come may be what holds a call some ranks finished (a slow
    # rank, with a gather's senders gone on): say the ranks disagree only when none is
    if behind and len(behind) + len(same) == len(ranks) - 1:
        lines.append(_BEHIND.format(", ".join(map(str, behind))))
    if passed:
        why = _DISAGREE if len(passed) + len(same) == len(ranks) - 1 else ""
        lines.append(_PASSED.format(", ".join(map(str, passed)), why))
        lines += [f"  {line}" for line in ahead]
    if same:
        lines.append(f"Rank(s) {', '.join(map(str, same))} are waiting in this call too.")
    lines.append(f"The backend said: {exc}")
    return CollectiveTimeoutError("\n".join(lines), missing + passed, reports)


#: Ranks past the call that timed out: only a call some ranks finish first lets them on
_FIRST = (
    "a call some ranks finish first (gather, reduce or scatter with another dst or src on "
    "some ranks)"
)
_BEHIND = (
    "This rank finished the call rank(s) {} still wait in: the ranks disagree on " + _FIRST + "."
)
_PASSED = "Rank(s) {} finished this call and went on, while this rank still waits in it{}:"
_DISAGREE = " (and no rank is missing: the ranks disagree on " + _FIRST + ")"


def _in_flight(facts: Any) -> list[int]:
    """The numbers of the group's calls this rank has in flight (``async_op=True``,
    started, and their handle not waited for: one that failed meanwhile, with the same
    timeout, counts)."""
    found = []
    for seq, (_, ref) in list(facts.pending.items()):
        handle = ref()
        if handle is not None and handle._works is not None:
            found.append(seq)
    return found


#: What a backend's error says when a peer went away (gloo, NCCL, the store)
PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited",
)


def is_peer_lost(exc: BaseException) -> bool:
    """Whether a backend exception says that another rank went away."""
    text = str(exc)
    return any(s in text for s in PEER_LOST)


def gone_error(
    comm: Comm, public: str, seq: int, gone: dict, exc: Optional[BaseException]
) -> RankGoneError:
    """The error for ``gone`` (exit notes or descriptions, by global rank) having left
    while this rank waited in call ``seq`` (``exc``: the backend's error, if any)."""
    gone = {int(r): note for r, note in gone.items()}

    def when(item: tuple[int, Any]) -> tuple[bool, float, int]:
        # a rank found gone by its process (killed: no note, no time) is the likely
        # cause of the others' exits (a rank that saw it go raises, and leaves a note)
        note = item[1] if isinstance(item[1], dict) else {}
        return (note.get("how") != "vanished", note.get("t", float("inf")), item[0])

    told = [
        describe_exit(r, note) if isinstance(note, dict) else f"rank {r} {note}"
        for r, note in sorted(gone.items(), key=when)
    ]
    timed = all(isinstance(n, dict) and "t" in n for n in gone.values())
    if len(told) > 1 and timed:  # in the order they left: the first is the likely cause
        told = [f"{told[0]} first", *(f"then {t}" for t in told[1:])]
    # else the ranks found gone by their process (no time: which died first is not
    # known) come first, the likely cause, and no order is claimed
    ranks = comm.global_ranks()
    default = comm.pg is _registry.current._default_pg
    said = (", " if timed else "; ").join(told) or "a rank went away"
    text = (
        f"{public}: {said} while {_label(comm, ranks[comm.rank])} "
        f"waited in {public} at {call_site()} (its call #{seq} on "
        f"{'the default group' if default else group_label(comm)})"
    )
    if exc is not None:
        text += f". The backend said: {exc}"
    return RankGoneError(text, {r: n if isinstance(n, dict) else {} for r, n in gone.items()})


def peer_gone(comm: Comm, public: str, seq: int, exc: BaseException) -> RuntimeError:
    """Name the rank(s) that went away, from their exit notes on the store (the rank's
    own, and the exit code ``distkit launch`` adds), or from who fails to answer a roll
    call when none left a note (killed, crashed). When every rank answers, none went
    away: one closed its connection when its own wait timed out, and the error is that
    timeout's (:func:`diagnose`: where each rank is)."""
    ranks = comm.global_ranks()
    me = ranks[comm.rank]
    others = [r for r in ranks if r != me]
    found: dict[int, Any] = {}
    try:
        board = _board.board()
        if board is not None:
            deadline = time.monotonic() + 1.0  # the launcher's exit code follows the note
            while True:
                found = board.exits(others)
                if found and all(_board.final(n) for n in found.values()):
                    break
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            if not found:
                k = board.ask({"kind": "where", "group": ranks, "from": me})
                grace = min(float(_settings.get("hang_grace")), 3.0)
                answered = board.answers(k, others, grace)
                found = {
                    r: "did not answer a roll call (killed, crashed, or stuck outside Python)"
                    for r in others
                    if r not in answered
                }
                if not found:
                    return diagnose(comm, public, seq, exc, closed=True)
    except Exception:  # the store went away too: rank 0 hosts it under env:// alone
        if not found and 0 in others:
            found = {0: "is gone, and the store it hosted with it"}
    return gone_error(comm, public, seq, found, exc)
