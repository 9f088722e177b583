"""The default cross-rank check: the first calls at every call site, then a sample.

Debug mode (:mod:`distkit.dist.debug`) checks every collective and costs a round of
communication each time. Without it, a dtype or length mismatch would garble data or
abort gloo, and a skipped collective would hang silently. So, by default, distkit
checks the calls such bugs show up in: the first :data:`VISITS` calls at each call site
(``file:line``) of each group, and after that one call in :data:`SAMPLE`, chosen by the
group's call number (the same calls on every rank). At a checked call every rank meets
on the world's store (:mod:`distkit.dist._board`): it adds a digest of what must match
(the collective, the op, dtypes, shapes where they must match, ``src``/``dst``) to one
counter, and the last rank to arrive publishes the total. If the digests differ, every
rank posts its call and call site and raises :class:`CollectiveMismatchError` naming
them all, before the backend runs. The ranks' counters of call sites agree as long as
they run the same code, and the sample is keyed by call number; but when they do not
(one rank at a new line, another at an old one), a rank may check a call that the others
run unchecked. Such a rank does not wait forever: after a second it posts a roll call,
and the watchdog (:mod:`distkit.dist._watchdog`) of a rank blocked in that call unchecked
takes its part in the check for it. A mismatch found that way raises on the checking
ranks, is printed at once by the others, and is what they raise when their blocked call
ends (when the checking ranks exit).

What it does not catch: a mismatch at a call that is not checked (a call site seen more
than :data:`VISITS` times, outside the sample), for example a last batch of another
length on one rank, is left to the backend; debug mode checks every call.
"""

from __future__ import annotations

import hashlib
import json
import time
from types import FrameType
from typing import TYPE_CHECKING, Any, Optional

from distkit import _settings
from distkit._compat import group_timeout
from distkit.dist import _board, debug, timeouts

if TYPE_CHECKING:
    from distkit.dist._board import Board
    from distkit.dist._comm import Comm, _GroupFacts

#: Calls checked at each call site of each group.
VISITS = 3
#: After that, one call in this many is checked (a power of two), chosen by call number.
SAMPLE = 1024
_MIX = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads call numbers (Fibonacci hashing)
_SHIFT = 64 - (SAMPLE.bit_length() - 1)
_MASK64 = (1 << 64) - 1
#: Seconds a rank waits for the others at a check before it asks the watchdogs for help.
ASK_AFTER = 1.0
_INSIDE = ("distkit.", "torch.")


def site_key(frame: Optional[FrameType]) -> tuple[Any, int]:
    """Identity of the user's call site above ``frame``: its code object and line."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_INSIDE):
        frame = frame.f_back
    if frame is None:
        return (None, 0)
    return (frame.f_code, frame.f_lineno)


def sampled(seq: int) -> bool:
    """Whether call number ``seq`` of a group is in the sample (the same on every rank)."""
    return ((seq * _MIX) & _MASK64) >> _SHIFT == 0


def peek(facts: _GroupFacts, seq: int, frame: Optional[FrameType]) -> bool:
    """Whether call ``seq``, made from above ``frame``, will be checked (counting nothing:
    for the lean lane, which steps aside to the checked path when it will)."""
    return facts.sites.get(site_key(frame), 0) < VISITS or sampled(seq)


def due(facts: _GroupFacts, seq: int, frame: Optional[FrameType]) -> bool:
    """Whether to check call ``seq``, made from above ``frame``; counts the visit."""
    key = site_key(frame)
    visits = facts.sites.get(key, 0)
    if visits < VISITS:
        facts.sites[key] = visits + 1
        return True
    return sampled(seq)


# -- the meeting on the store ---------------------------------------------------------


def _plan(size: int) -> tuple[int, int]:
    """(bits of the counter, bits of a digest) so that ``size`` of each fit in 62 bits."""
    count_bits = (2 * size).bit_length() + 1
    return count_bits, 62 - count_bits - size.bit_length()


def _digest(public: str, must: dict, bits: int) -> int:
    text = json.dumps([public, must], sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> (64 - bits)


def _add(board: Board, key: str, digest: int, size: int) -> Optional[str]:
    """Add this rank's digest; return the total if this rank was the last (it publishes
    it at ``key/done``), else None."""
    count_bits, _ = _plan(size)
    total = board.add(key, (digest << count_bits) + 1)
    count = total & ((1 << count_bits) - 1)
    if count > size:  # keys of another world on a reused store: no verdict
        return _SKIP
    if count < size:
        return None
    board.set(key + "/done", str(total))
    return str(total)


#: What ``key/done`` holds when the check cannot tell (not a number): go on unchecked.
_SKIP = "skip"
#: What ``key/done`` holds when a rank of the group exited: read ``key/gone``.
_GONE = "gone"


def _agrees(total: str, digest: int, size: int) -> bool:
    if not total.lstrip("-").isdigit():
        return True
    count_bits, _ = _plan(size)
    return int(total) >> count_bits == digest * size


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


def run(comm: Comm, public: str, fields: dict, must: dict, seq: int) -> None:
    """Check call ``seq`` with every rank of ``comm``'s group; raise on a mismatch.

    Raises:
        CollectiveMismatchError: The ranks are not in the same collective, or disagree
            on what must match.
        RankGoneError: A rank of the group exited while this one waited here.
        CollectiveTimeoutError: The others did not come within the group's timeout.
    """
    board = _board.board()
    facts = comm._facts
    if board is None or facts is None:
        return
    size = comm.size
    digest = _digest(public, must, _plan(size)[1])
    key = board.key("check", facts.gid, seq)
    ranks = comm.global_ranks()
    me = ranks[comm.rank]
    facts.checking = True
    try:
        total = _add(board, key, digest, size)
        if total is None:
            total = _await(board, key, comm, facts, public, seq)
        else:  # every rank reached this check, so every rank has left its previous one
            _forget(board, facts.last_check)
        facts.last_check = key
    finally:
        facts.checking = False
    if total == _GONE:
        raise timeouts.gone_error(comm, public, seq, board.read(key + "/gone") or {}, None)
    if _agrees(total, digest, size):
        return
    mine = {"call": public, "fields": fields, "must": must, "site": debug.call_site()}
    label = debug.group_label(comm)
    raise _mismatch(board, key, ranks, me, public, mine, seq, label)


def _forget(board: Board, key: Optional[str]) -> None:
    if key is not None:
        for name in (key, key + "/done", key + "/asked"):
            try:
                board.store.delete_key(name)
            except Exception:  # already gone, or a store without deletion
                pass


def _await(board: Board, key: str, comm: Comm, facts: _GroupFacts, public: str, seq: int) -> str:
    """Wait for the last rank's total. After :data:`ASK_AFTER` s, one waiting rank (the
    first to ask) posts a roll call, so that the watchdog of a rank blocked in this call
    unchecked takes its part, and watches for ranks that exited."""
    timeout = group_timeout(comm.pg)
    start = time.monotonic()
    deadline = start + (timeout.total_seconds() if timeout is not None else 1800.0)
    ranks = comm.global_ranks()
    others = [r for r in ranks if r != ranks[comm.rank]]
    request = {
        "kind": "check",
        "gid": facts.gid,
        "seq": seq,
        "group": ranks,
        "key": key,
        "label": debug.group_label(comm),
    }
    state: dict[str, Any] = {"at": start + ASK_AFTER, "every": ASK_AFTER, "asker": None}

    def on_pause(now: float) -> None:
        if now < state["at"]:
            return
        if state["asker"] is None:
            state["asker"] = board.add(key + "/asked", 1) == 1
        if state["asker"]:
            gone = board.exits(others)
            if gone:
                board.post(key + "/gone", {str(r): note for r, note in gone.items()})
                board.set(key + "/done", _GONE)
                return
            board.ask(request)
        state["every"] = min(state["every"] * 2, 8.0)
        state["at"] = now + state["every"]

    total = _wait(board, key + "/done", deadline, on_pause)
    if total is None:
        raise timeouts.diagnose(
            comm,
            public,
            seq,
            TimeoutError(
                f"distkit's default check waited {deadline - start:.0f} s for the other ranks"
            ),
        )
    return total


def _mismatch(
    board: Board,
    key: str,
    ranks: list[int],
    me: int,
    public: str,
    mine: dict,
    seq: int,
    label: str,
) -> debug.CollectiveMismatchError:
    """Post this rank's call, read every rank's, and build the error."""
    board.post(f"{key}/call/{me}", mine)
    grace = float(_settings.get("hang_grace"))
    calls = board.collect({r: f"{key}/call/{r}" for r in ranks}, grace)
    rows = []
    for group_rank, r in enumerate(ranks):
        call = calls.get(r)
        name = f"rank {r}" if label == "the default group" else f"rank {r} (rank {group_rank})"
        if call is None:
            rows.append(f"  {name}: did not answer within {grace:g} s")
        else:
            rows.append(f"  {name}: {debug.format_call(call)}")
    known = list(calls.values())
    lines = [
        f"{public}: the ranks of {label} disagree on this collective (found by distkit's "
        f"default check, at call #{seq} on the group; on rank {me}):",
        *rows,
    ]
    if len({c["call"] for c in known}) > 1:
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
    lines.append(
        "(DISTKIT_CHECK=0 turns the default check off; DISTKIT_DEBUG=1 checks every call.)"
    )
    ordered = [calls.get(r, {}) for r in ranks]
    return debug.CollectiveMismatchError("\n".join(lines), ordered)


def join(board: Board, facts: _GroupFacts, request: dict, frame: Optional[FrameType]) -> Any:
    """Take this rank's part in a check of a call it runs unchecked: the watchdog calls
    this while the rank is blocked in that call (``frame`` is its thread's).

    Returns:
        The :class:`CollectiveMismatchError` this rank will raise, or ``None``.
    """
    call = facts.call
    key = request["key"]
    if call is None or board.has(key + "/done"):
        return None
    public, name, params, args = call
    _, fields, must = debug.signature(name, dict(zip(params, args)))
    ranks = request["group"]
    size = len(ranks)
    digest = _digest(public, must, _plan(size)[1])
    total = _add(board, key, digest, size)
    if total is None:
        grace = float(_settings.get("hang_grace"))
        total = _wait(board, key + "/done", time.monotonic() + grace)
    if total is None or total == _GONE or _agrees(total, digest, size):
        return None
    mine = {"call": public, "fields": fields, "must": must, "site": debug.call_site(frame)}
    return _mismatch(board, key, ranks, board.rank, public, mine, request["seq"], request["label"])
