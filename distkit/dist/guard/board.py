"""A notice board on the world's store: where ranks are, who exited, and roll calls.

Collectives travel through the backend (gloo, NCCL); when one goes wrong, the ranks still
need to tell each other what they are doing. The store the default process group
rendezvoused on (the launcher's TCPStore under torchrun and ``distkit launch``, a
FileStore under :mod:`distkit.testing`) is that side channel: the default cross-rank
check (:mod:`distkit.dist.guard.check`) meets there, the watchdog
(:mod:`distkit.dist.guard.watchdog`) answers roll calls there, and a rank that exits leaves a
note there for the ranks it leaves waiting.

Keys live under ``distkit/<world>/``, where ``<world>`` tells this world from earlier
ones on the same store: the launcher's run and restart count, and how many default groups
this process created before this one (every rank of a world has created as many). Exit
notes live in the launcher's own store, beneath torch's key prefixes, where
``distkit launch`` adds each rank's exit code as soon as it sees the rank go.

A collective that goes well touches none of this, except the few store operations of a
default check.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
import weakref
from typing import Any, Optional

from distkit import _registry
from distkit._compat import default_store, root_store

#: Seconds between two looks at the store while waiting for keys.
POLL = 0.05


def run_tag() -> str:
    """This launch and restart, as the launcher's variables say (``-.0`` without any)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID") or "-"
    return f"{run}.{os.environ.get('TORCHELASTIC_RESTART_COUNT') or '0'}"


def exit_key(global_rank: int, run: Optional[str] = None) -> str:
    """Where a rank's exit note is kept in the launcher's store (the launcher writes it
    too, with the exit code: see :mod:`distkit.local.script`)."""
    return f"distkit/exit/{run or run_tag()}/{global_rank}"


class Board:
    """The store of one world, with distkit's key names."""

    __slots__ = (
        "__weakref__",
        "dead",
        "groups",
        "host",
        "pg",
        "probe",
        "procs",
        "rank",
        "root",
        "run",
        "size",
        "store",
        "tag",
    )

    def __init__(self, pg: Any, store: Any, index: int) -> None:
        self.dead = False  # the store failed: its host (rank 0 under env://) went away
        self.groups = 0  # process groups created in this world (see guard.creation)
        self.pg = weakref.ref(pg)
        self.store = store
        self.root = root_store(store)
        self.rank: int = pg.rank()
        self.size: int = pg.size()
        self.run = run_tag()
        self.tag = f"distkit/{self.run}.{index}"
        # the rank whose process hosts the store, when one does: rank 0 under env:// (a
        # launcher's own store is hosted by the launcher, a FileStore by nobody)
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        hosted = type(self.root).__name__ == "TCPStore" and not agent
        self.host: Optional[int] = 0 if hosted else None
        # a rank killed outside ``distkit launch`` (which notes every rank's exit code)
        # leaves no note: where the kernel can tell, the ranks of this machine are looked
        # up by their process (see vanished)
        self.probe = not self.run.startswith("distkit-")
        self.procs: dict[int, dict] = {}  # the process records read so far, by rank
        me = _process()
        if self.probe and me is not None:
            try:  # when: a record of an earlier run on a reused store is not this rank's
                self.post(self.key("proc", self.rank), {**me, "posted": _since_boot()})
            except Exception:  # the store is gone already: nothing to look up
                pass

    def key(self, *parts: Any) -> str:
        return "/".join([self.tag, *map(str, parts)])

    # -- the store --------------------------------------------------------------------

    def add(self, key: str, amount: int) -> int:
        return int(self.store.add(key, amount))

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> str:
        return bytes(self.store.get(key)).decode()

    def has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def publish(self, key: str, value: str) -> str:
        """Set ``key`` to ``value`` unless it is set already; return what it holds."""
        return bytes(self.store.compare_set(key, "", value)).decode()

    def post(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def read(self, key: str) -> Any:
        """The value posted at ``key``, or ``None`` when nothing (whole) is there yet.
        (A key deleted between the check and the get would make the get wait for the
        store's timeout: keys read while others may delete them are written over
        instead, as debug mode's wait markers are.)"""
        if not self.has(key):
            return None
        try:
            return json.loads(self.get(key))
        except ValueError:  # rewritten meanwhile
            return None

    def collect(self, keys: dict[Any, str], seconds: float) -> dict[Any, Any]:
        """Read what is posted at ``keys`` (a name per key), waiting up to ``seconds``
        for the keys still missing."""
        found: dict[Any, Any] = {}
        deadline = time.monotonic() + seconds
        while True:
            for name, key in keys.items():
                if name not in found:
                    value = self.read(key)
                    if value is not None:
                        found[name] = value
            if len(found) == len(keys) or time.monotonic() >= deadline:
                return found
            time.sleep(POLL)

    # -- roll calls -------------------------------------------------------------------

    def ask(self, request: dict) -> int:
        """Post a roll call; the watchdog of every rank named in it answers (see
        :func:`answers`). Returns its number."""
        k = self.add(self.key("roll"), 1)
        self.post(self.key("roll", k), request)
        return k

    def answers(self, k: int, ranks: list[int], seconds: float) -> dict[int, dict]:
        """What ``ranks`` answered roll call ``k`` within ``seconds`` (by global rank)."""
        return self.collect({r: self.key("roll", k, r) for r in ranks}, seconds)

    def where(
        self, group: list[int], ranks: list[int], seconds: float
    ) -> tuple[dict[int, dict], dict[int, dict]]:
        """Where ``ranks`` are: ask every rank of ``group``; return what ``ranks``
        answered within ``seconds``, and the exit notes of those that did not answer."""
        k = self.ask({"kind": "where", "group": group, "from": self.rank})
        answers = self.answers(k, ranks, seconds)
        return answers, self.exits([r for r in ranks if r not in answers])

    # -- exits ------------------------------------------------------------------------

    def exits(self, ranks: list[int]) -> dict[int, dict]:
        """The exit notes of those of ``ranks`` that left one (by global rank), and for
        those that left none, a note for each whose process is gone (:meth:`vanished`)."""
        found = {}
        for r in ranks:
            key = exit_key(r, self.run)
            if self.root.check([key]):
                found[r] = json.loads(bytes(self.root.get(key)).decode())
            elif self.probe:
                note = self.vanished(r)
                if note is not None:
                    found[r] = note
        return found

    def vanished(self, rank: int) -> Optional[dict]:
        """A note for ``rank`` when its process is gone, or ``None`` when it is alive or
        this rank cannot tell. Only the kernel knows a process killed by SIGKILL or the
        out-of-memory killer is gone, and only for processes it runs: ranks of this
        machine (same boot, same pid namespace) are looked up by pid; a rank of another
        machine, or one that never posted its record, is not."""
        me = _process()
        record = self.procs.get(rank)
        if record is None and me is not None:
            record = self.read(self.key("proc", rank))
            if record is None or record.get("posted", -1.0) < int(me["start"]) / _TICKS:
                # none yet, or posted before this process started, so not in this world
                # (its ranks post once they all met): an earlier run's, on a store it
                # left behind (read again next time: the rank's own may come)
                return None
            self.procs[rank] = record
        if me is None or record is None or (record["boot"], record["ns"]) != (me["boot"], me["ns"]):
            return None
        pid = record["pid"]
        return None if _alive(pid, record["start"]) else {"how": "vanished", "pid": pid}

    def post_exit(self, note: dict) -> None:
        key = exit_key(self.rank, self.run)
        if self.root.check([key]):  # the launcher's code, or an earlier note
            note = {**json.loads(bytes(self.root.get(key)).decode()), **note}
        self.root.set(key, json.dumps(note))


def _stat(pid: int) -> tuple[str, str]:
    """A process's state letter and start time (in clock ticks since boot), from Linux's
    ``/proc/<pid>/stat`` (its name, in parentheses, may hold spaces)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], fields[19]


def _alive(pid: int, start: str) -> bool:
    """Whether process ``pid``, started at ``start`` (clock ticks since boot), is there:
    running, sleeping, or stopped (under a debugger); not when it is gone, a zombie
    (dead, not yet reaped: unless its main thread alone ended, with others running), or
    another process that took its pid since."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it is there
        pass
    try:
        state, started = _stat(pid)
        if state in "ZX":
            return started == start and len(os.listdir(f"/proc/{pid}/task")) > 1
    except (OSError, ValueError, IndexError):  # /proc hides it (or it went just now)
        return True  # cannot tell: never call a rank dead on a guess (the next look will)
    return started == start


def _since_boot() -> float:
    """Seconds since this machine booted (the clock of processes' start times)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_me: Optional[tuple[int, Optional[dict]]] = None  # (pid, record): a fork has its own


def _process() -> Optional[dict]:
    """This process as the kernel knows it (its boot, pid namespace, pid and start time),
    or ``None`` where there is no ``/proc`` to read (not Linux)."""
    global _me
    pid = os.getpid()
    if _me is None or _me[0] != pid:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
            record: Optional[dict] = {
                "boot": boot,
                "ns": os.readlink("/proc/self/ns/pid"),
                "pid": pid,
                "start": _stat(pid)[1],
            }
        except (OSError, ValueError, IndexError):
            record = None
        _me = (pid, record)
    return _me[1]


_lock = threading.Lock()
_current: Optional[Board] = None
_worlds = 0  # default groups seen by this process, in order
_owner = os.getpid()  # the process the board and the exit hooks belong to
_uncaught: Optional[str] = None  # what killed the main thread, for the exit note


def board() -> Optional[Board]:
    """The board of the current world, or ``None`` (no process group, or no store)."""
    global _current, _worlds
    pg = _registry.current._default_pg
    found = _current
    if pg is None:
        return None
    if found is not None and found.pg() is pg:
        return found
    with _lock:
        if _current is not None and _current.pg() is pg:
            return _current
        if _registry.inherited(pg):  # a fork's child: the world's store is its parent's
            return None
        try:
            store = default_store()
        except Exception:  # a world without a store (MPI): no side channel
            return None
        _worlds += 1
        _current = Board(pg, store, _worlds)
        _hooks()
        os.environ[_registry.RANK_PID] = str(os.getpid())  # see _registry.decide
        return _current


def forget() -> None:
    """Drop the board (the world is going, or a forked child must not use its parent's)."""
    global _current
    _current = None


_hooked = False


def _hooks() -> None:
    """Leave an exit note when this process ends (and remember an uncaught error for
    it), once per process."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    atexit.register(_at_exit)
    previous = sys.excepthook

    def excepthook(kind: Any, value: Any, tb: Any) -> None:
        note_exception(value)
        if not hasattr(sys, "ps1"):  # not at a REPL's prompt, where the process goes on
            note_exit("raised")  # now: the ranks waiting for it need not wait for its exit
        previous(kind, value, tb)

    sys.excepthook = excepthook


def note_exception(exc: BaseException) -> None:
    """Record the error that ends this process, for the exit note."""
    global _uncaught
    text = str(exc).strip().splitlines()
    _uncaught = f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def note_exit(how: str) -> None:
    """Post, for the ranks left waiting, how this rank leaves (``"exited"``, ...)."""
    found = _current
    if found is None or os.getpid() != _owner or found.dead:
        return
    note: dict[str, Any] = {"how": how, "pid": os.getpid(), "t": time.time()}
    if _uncaught is not None:
        note["error"] = _uncaught
    try:
        found.post_exit(note)
    except Exception:  # the store may be gone with the world
        pass


def _at_exit() -> None:
    note_exit("exited")
    found = _current
    if found is not None and found.host == found.rank and os.getpid() == _owner:
        _leave_hosting(found)
    forget()  # let go of the store now, while the interpreter can still free it


def _leave_hosting(board: Board) -> None:
    """This rank hosts the store, which goes with its process: tell the other ranks'
    watchdogs to stop asking it (a store call on a closed connection makes torch print
    a C++ backtrace), and give them a moment to say they heard."""
    try:
        board.set(board.key("host-leaving"), "1")
        deadline = time.monotonic() + 1.5
        while board.add(board.key("host-left-heard"), 0) < board.size - 1:
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL)
    except Exception:  # the world is gone already
        pass


def _after_fork() -> None:
    global _current, _owner
    _current = None
    _owner = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def final(note: dict) -> bool:
    """Whether an exit note says all there is to know: ``distkit launch`` adds the exit
    code to a rank's own note; a rank found gone by its process gets no code."""
    return "code" in note or note.get("how") == "vanished"


def describe_exit(rank: int, note: dict) -> str:
    """``rank 1 exited (code 0)``, from a rank's exit note."""
    code = note.get("code")
    if note.get("how") == "vanished":
        return (
            f"rank {rank} died: its process (pid {note.get('pid')}, on this machine) is "
            "gone and left no exit note (killed by a signal such as SIGKILL or the "
            "out-of-memory killer, crashed, or ended by os._exit)"
        )
    if code is not None and code < 0:
        text = f"rank {rank} was killed by signal {-code}"
    elif code is not None:
        text = f"rank {rank} exited (code {code})"
    elif note.get("error"):
        text = f"rank {rank} failed"
    else:
        text = f"rank {rank} exited"
    if note.get("error"):
        text += f" with {note['error']}"
    return text
