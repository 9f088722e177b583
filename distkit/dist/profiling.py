"""Who makes everyone wait, and where: a communication profile that blames a rank and a line.

``with dist.profile() as prof:`` records every distkit collective of every rank inside
the block (tensor and object collectives, the evaluation collectors, point-to-point
calls), locally: the collective, the user's call site, the group, the bytes, and when the
rank entered and left it. Nothing is sent per call. When the block ends normally, one
collective merges the records, and every rank holds the same :attr:`Profile.rows`: per
collective and call site, how many calls, how many bytes, how long they took, and how
late each rank arrived at them, summed (``late``): the rank that makes everyone wait, and
the line where it does.

Arrival times are compared on one clock: when the block starts, each rank's offset from
the first rank of the group is estimated (a barrier, then each rank's clock, nine times),
so ranks on different hosts are compared fairly. ``trace=PATH`` writes a Chrome trace
(JSON; open it in Perfetto or chrome://tracing): a track per rank, a slice per call.

``DISTKIT_PROFILE=PATH`` profiles a whole run, from :func:`~distkit.dist.init_dist` to
:func:`~distkit.dist.destroy_dist` (which merges the records, prints the table on the main
process, to stderr, and writes the trace to ``PATH``); ``distkit launch --profile PATH``
sets it for every rank. A run that ends without ``destroy_dist`` is not merged (some ranks
may be gone): each rank writes its own trace to ``PATH.rank<N>`` instead. While the run's
profile is open, ``dist.profile()`` raises (profiles do not nest).
"""

from __future__ import annotations

import atexit
import json
import os
import statistics
import sys
import time
from typing import Any, NamedTuple, Optional

from distkit import _registry
from distkit._compat import is_compiling
from distkit.dist import _route
from distkit.dist.backends.base import ObjectCall
from distkit.dist.backends.single import SINGLE
from distkit.dist.codec import policy
from distkit.dist.core import spec
from distkit.dist.core.comm import GroupLike
from distkit.dist.guard import record as _record


class ProfileRow(NamedTuple):
    """One collective at one call site, over every call of it in the profile.

    A collective that ranks call from different lines is counted at each of them, with
    the ranks that called it there. A point-to-point call is one rank's own: both sides
    of a message are calls (``exchange`` at one line on two ranks: two calls a round),
    each counted with its own bytes and time.
    """

    op: str  #: the collective (its public name)
    site: str  #: the call site, ``file:line``
    calls: int  #: how many times it was called there
    bytes: int  #: the bytes of the tensors one rank passed, over those calls
    seconds: float  #: the time spent inside those calls, averaged over the ranks there
    late: dict[int, float]  #: by global rank: seconds it arrived after the first rank


class Profile:
    """An open (then closed) communication profile; see :func:`profile`."""

    def __init__(self, trace: Optional[str], group: GroupLike) -> None:
        self.trace = trace
        self.group = group
        #: Per (collective, call site), on every rank alike, once the block ended
        #: normally (``None`` before, or when it ended with an exception).
        self.rows: Optional[list[ProfileRow]] = None
        #: What this rank recorded (kept however the block ends).
        self.records: list[_record.Entry] = []
        self.offsets: dict[int, float] = {}  # by global rank: its clock minus the first's
        self._recorder: Optional[_record.Recorder] = None
        #: the resolved group while the block is open: a closed profile holds no process
        #: group (one kept to the end of a script would keep its backend past
        #: ``destroy_dist``, into the interpreter's teardown)
        self._comm: Any = None
        self._rank = 0  # in the group: only its first rank prints
        self._me = 0  # in the world: names this rank's own trace file

    # -- the block ----------------------------------------------------------------------

    def __enter__(self) -> Profile:
        if _record.active is not None:
            raise RuntimeError(
                "profile: a profile is open already on this rank; close it before opening "
                "another (profiles do not nest)"
            )
        comm = _route.resolve(self.group, "profile")
        self._comm = comm
        self._rank, self._me = comm.rank, comm.global_ranks()[comm.rank]
        self.rows, self.records = None, []
        self.offsets = _offsets(comm)
        recorder = _record.Recorder(tuple(comm.global_ranks()))
        self._recorder = recorder
        _record.active = recorder
        _watch_single(True)
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        recorder, self._recorder = self._recorder, None
        comm, self._comm = self._comm, None
        _record.active = None
        _watch_single(False)
        if recorder is None:
            return
        self.records = [e._replace(ranks=tuple(e.ranks)) for e in recorder.entries]
        if kind is not None:  # the other ranks may not be here: no merging collective
            return
        me = self._me
        # sites as this rank shows them (relative to its own directory), before merging:
        # every rank then computes the rows from the same strings
        mine = [tuple(e._replace(file=_shown(e.file))) for e in self.records]
        if comm.alone:
            every = [(_TAG, me, mine)]
        else:
            every = _gather(comm, (_TAG, me, mine))
        entries = [(r, _record.Entry(*e)) for _, r, part in every for e in part]
        self.rows = _rows(entries, self.offsets)
        if self.trace is not None and comm.rank == 0:
            _write_trace(self.trace, entries, self.offsets)

    # -- what it found ------------------------------------------------------------------

    def print(self, file: Any = None, top: int = 20) -> None:
        """Print the rows where ranks waited most (and who was late there) as a rich table,
        on the group's first rank only (the main process, for the default group)."""
        if self.rows is None or self._rank != 0:
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title="distkit profile: where ranks waited for each other")
        for col, justify in (
            ("collective", "left"),
            ("call site", "left"),
            ("calls", "right"),
            ("bytes", "right"),
            ("seconds", "right"),
            ("late (rank: seconds)", "left"),
        ):
            # a site on one line, its file's head cut rather than its line number
            table.add_column(col, justify=justify, no_wrap=col == "call site")  # type: ignore[arg-type]
        for row in sorted(self.rows, key=lambda r: (-sum(r.late.values()), -r.seconds))[:top]:
            worst = sorted(row.late.items(), key=lambda kv: -kv[1])[:3]
            late = ", ".join(f"{r}: {s:.3f}" for r, s in worst if s > 0) or "nobody"
            table.add_row(
                row.op,
                _tail(row.site, 60),
                str(row.calls),
                _size(row.bytes),
                f"{row.seconds:.3f}",
                late,
            )
        Console(file=file or sys.stdout, width=140).print(table)


def profile(trace: Optional[str] = None, group: GroupLike = None) -> Profile:
    """Record every distkit collective inside the block; find who makes the others wait.

    Collective: every rank of ``group`` must enter the block and, when it ends normally,
    leave it (the records are merged in one collective then).
    Single process: records as well; every row's ``late`` is ``{0: 0.0}``.

    Recording is local (no communication per call) and costs a few microseconds per call;
    outside a profile nothing is recorded. When the block ends with an exception, nothing
    is merged (the other ranks may not be there): :attr:`Profile.rows` stays ``None`` and
    :attr:`Profile.records` holds what this rank recorded. Calls on sub-groups and mesh
    dimensions are attributed to their own group's ranks. Point-to-point calls
    (:func:`~distkit.dist.send`, :func:`~distkit.dist.recv`, :func:`~distkit.dist.exchange`)
    are rows of each side at its own site: a rank is late there by how long after the
    first of its peers (on the messages they share) it arrived. Collectives traced by
    ``torch.compile`` run without Python and are not recorded.

    Args:
        trace: Where the main process writes a Chrome trace (JSON: a track per rank, a
            slice per call, named by collective and call site), or ``None``.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).

    Returns:
        A :class:`Profile`, the context manager; after the block, its :attr:`~Profile.rows`
        (a list of :class:`ProfileRow`) and :meth:`~Profile.print`.

    Raises:
        RuntimeError: A profile is open already on this rank.

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> with dist.profile() as prof:
        ...     _ = dist.all_reduce(torch.ones(4), op="max")
        >>> [(row.op, row.calls, row.bytes, row.late) for row in prof.rows]
        [('all_reduce', 1, 16, {0: 0.0})]

        With 2 ranks, where rank 1 is slow before its calls::

            with dist.profile(trace="trace.json") as prof:
                train_one_epoch()
            prof.print()  # the table, on the main process
            # prof.rows on every rank: ProfileRow('all_reduce', 'train.py:23', 100, ...,
            #                                     late={0: 0.0, 1: 0.503})
    """
    return Profile(trace, group)


# -- while a profile is open ---------------------------------------------------------------


def _watch_single(on: bool) -> None:
    """Record the single-process backend's calls while a profile is open: its methods are
    wrapped then, and the collectives' shortcuts send every call to the checked path (so
    outside a profile neither costs anything)."""
    if on:
        for method in spec.SPECS:
            setattr(SINGLE, method, _recorded(getattr(SINGLE, method), method))
    else:
        for method in spec.SPECS:
            SINGLE.__dict__.pop(method, None)
    _registry.divert(on)


def _recorded(method: Any, name: str) -> Any:
    def run(comm: Any, *args: Any) -> Any:
        if is_compiling():  # traced calls are not recorded (and time.time cannot trace)
            return method(comm, *args)
        entered = time.time()
        result = method(comm, *args)
        recorder = _record.active
        if recorder is not None:
            call = next((a for a in args if hasattr(a, "serializer")), None)
            public = call.fn if call is not None else name
            recorder.add("", (0,), 0, public, args, sys._getframe(1), entered)
        return result

    return run


def _offsets(comm: Any) -> dict[int, float]:
    """Each global rank's clock minus the group's first rank's (nine estimates, after a
    barrier each, the median kept: on a loaded machine a rank can leave a barrier a
    millisecond late, and with three estimates that skewed who was late by as much)."""
    ranks = comm.global_ranks()
    if comm.alone:
        return {ranks[0]: 0.0}
    rounds = []
    for _ in range(9):
        comm.backend.barrier(comm)
        rounds.append(
            [clock for _, _, clock in _gather(comm, (_TAG, ranks[comm.rank], time.time()))]
        )
    return {
        r: statistics.median(clocks[i] - clocks[0] for clocks in rounds)
        for i, r in enumerate(ranks)
    }


_TAG = "distkit profile"  # marks what the profile's own collectives carry


def _gather(comm: Any, mine: tuple) -> list[Any]:
    """``all_gather_object`` of the profile's own ``(tag, rank, data)`` tuples, under the
    name ``profile`` (so the default check tells it from a user's ``all_gather_object``);
    raises on every rank that finds another rank's part missing (that rank left the block
    with an exception, or skipped it, and sent something else)."""
    call = ObjectCall("profile", None, policy.serializer_of(None, "profile", comm))
    every = comm.backend.all_gather_object(comm, mine, call)
    strays = [
        r
        for r, part in enumerate(every)
        if not (isinstance(part, tuple) and len(part) == 3 and part[0] == _TAG)
    ]
    if strays:
        ranks = comm.global_ranks()
        raise RuntimeError(
            f"profile: rank {comm.global_ranks()[comm.rank]} closed its profile, but rank(s) "
            f"{', '.join(str(ranks[r]) for r in strays)} sent something else in its place: "
            "every rank of the profile's group must leave the block normally (a rank that "
            "raised inside it does not merge); those ranks are now out of step with this one"
        )
    return every


# -- merging ---------------------------------------------------------------------------------


def _shown(file: str) -> str:
    """A call site's file as this rank shows it: relative to its directory when inside."""
    if not file or not os.path.isabs(file):
        return file
    shown = os.path.relpath(file)
    return file if shown.startswith("..") else shown


def _tail(text: str, width: int) -> str:
    """``text``, or its last ``width - 1`` characters after an ellipsis."""
    return text if len(text) <= width else "\u2026" + text[1 - width :]


def _site(file: str, line: int) -> str:
    return f"{file}:{line}" if file else "<unknown>"


def _rows(entries: list[tuple[int, _record.Entry]], offsets: dict[int, float]) -> list[ProfileRow]:
    """Every rank's records, as rows (the same on every rank: a function of the records)."""
    calls: dict[tuple, list[tuple[int, _record.Entry]]] = {}
    seen: dict[tuple, int] = {}
    first_at = _pairs_first(entries, offsets)
    for rank, e in entries:
        if e.gid.startswith(_record.PAIRS):  # one rank's side of point-to-point messages
            mine = (rank, e.gid)
            seen[mine] = n = seen.get(mine, 0) + 1
            key: tuple = (e.gid, rank, n)
        elif e.gid:  # a call of a group: one key on every rank of it
            key = (e.gid, e.seq)
        else:  # it sent nothing (or no process group): the n-th call at its site, by rank
            local = (rank, e.op, e.file, e.line)
            seen[local] = n = seen.get(local, 0) + 1
            key = ("", e.op, e.file, e.line, n)
        calls.setdefault(key, []).append((rank, e))
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for key, got in sorted(calls.items(), key=lambda kv: min(e.enter for _, e in kv[1])):
        got.sort(key=lambda pair: pair[0])
        first = got[0][1]
        arrived = {r: e.enter - offsets.get(r, 0.0) for r, e in got}
        start = min(arrived.values())
        if key[0].startswith(_record.PAIRS):  # late for the peers that waited for it
            start = min([start, *(first_at[m] for m in _messages(first.gid))])
        # one row per call site: ranks that made the call from different lines are each
        # counted, and blamed, at their own (rank 1 late in evaluate(), not at rank 0's line)
        by_site: dict[tuple[str, str], list[tuple[int, _record.Entry]]] = {}
        for r, e in got:
            by_site.setdefault((e.op, _site(e.file, e.line)), []).append((r, e))
        for where, here in by_site.items():
            row = rows.setdefault(where, {"calls": 0, "bytes": 0, "seconds": 0.0, "late": {}})
            row["calls"] += 1
            row["bytes"] += here[0][1].nbytes
            row["seconds"] += sum(e.leave - e.enter for _, e in here) / len(here)
            for r, _ in here:  # nobody waits for a call that sends nothing
                late = max(arrived[r] - start, 0.0) if key[0] else 0.0
                row["late"][r] = row["late"].get(r, 0.0) + late
    return [
        ProfileRow(op, site, v["calls"], v["bytes"], v["seconds"], dict(sorted(v["late"].items())))
        for (op, site), v in rows.items()
    ]


def _messages(gid: str) -> list[str]:
    """The keys of the messages of a point-to-point entry (see :data:`_record.PAIRS`)."""
    return [m for m in gid[len(_record.PAIRS) :].split(";") if m]


def _pairs_first(
    entries: list[tuple[int, _record.Entry]], offsets: dict[int, float]
) -> dict[str, float]:
    """By point-to-point message: when the first of its two ends arrived (one clock)."""
    first: dict[str, float] = {}
    for rank, e in entries:
        if e.gid.startswith(_record.PAIRS):
            at = e.enter - offsets.get(rank, 0.0)
            for m in _messages(e.gid):
                first[m] = min(first.get(m, at), at)
    return first


def _write_trace(
    path: str, entries: list[tuple[int, _record.Entry]], offsets: dict[int, float]
) -> None:
    """A Chrome trace: a process (track) per rank, a complete event per call."""
    if not entries:
        origin = 0.0
    else:
        origin = min(e.enter - offsets.get(r, 0.0) for r, e in entries)
    events: list[dict] = []
    for rank in sorted({r for r, _ in entries}):
        events.append(
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
    for rank, e in entries:
        start = e.enter - offsets.get(rank, 0.0) - origin
        pair = e.gid.startswith(_record.PAIRS)
        events.append(
            {
                "name": f"{e.op} {_site(e.file, e.line)}",
                "cat": "point to point" if pair else e.gid or "single",
                "ph": "X",
                "ts": round(start * 1e6, 3),
                "dur": round((e.leave - e.enter) * 1e6, 3),
                "pid": rank,
                "tid": "point to point" if pair else f"group {list(e.ranks)}",
                "args": {"call": e.seq, "bytes": e.nbytes},
            }
        )
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


# -- a whole run: DISTKIT_PROFILE ---------------------------------------------------------------

_run: Optional[Profile] = None


def start_run() -> None:
    """Open the whole run's profile when ``DISTKIT_PROFILE`` is set (``init_dist``)."""
    global _run
    path = os.environ.get("DISTKIT_PROFILE")
    if path and _run is None and _record.active is None:
        _run = profile(trace=path)
        _run.__enter__()
        atexit.register(_at_exit)


def _at_exit() -> None:
    """The run ended without ``destroy_dist``: merging now could wait for ranks that are
    gone, so each rank writes its own records (a single process merges as usual)."""
    global _run
    found = _run
    if found is None or found._comm is None:
        return
    if found._comm.alone:
        end_run()
        return
    _run = None
    found.__exit__(SystemExit, None, None)  # closes without merging
    _write_own(found, "the run ended without destroy_dist(), so the ranks' records were not merged")


def end_run() -> None:
    """Close the whole run's profile (``destroy_dist``): merge, print, write the trace.
    When merging fails (a rank is gone), this rank's own trace is written instead and
    ``destroy_dist`` goes on."""
    global _run
    found, _run = _run, None
    if found is None:
        return
    try:
        found.__exit__(None, None, None)
    except Exception as exc:
        _write_own(
            found,
            f"merging the ranks' records failed ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})",
        )
        return
    found.print(file=sys.stderr)


def _write_own(found: Profile, why: str) -> None:
    """Write this rank's records alone, to ``PATH.rank<N>``, and say why."""
    rank = found._me
    own = f"{found.trace}.rank{rank}"
    entries = [(rank, e._replace(file=_shown(e.file))) for e in found.records]
    _write_trace(own, entries, {rank: 0.0})
    print(f"distkit profile: rank {rank}: {why}; this rank's trace is in {own}", file=sys.stderr)
