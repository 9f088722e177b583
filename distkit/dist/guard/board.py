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
        """The exit notes of those of ``ranks`` that left one (by global rank)."""
        found = {}
        for r in ranks:
            key = exit_key(r, self.run)
            if self.root.check([key]):
                found[r] = json.loads(bytes(self.root.get(key)).decode())
        return found

    def post_exit(self, note: dict) -> None:
        key = exit_key(self.rank, self.run)
        if self.root.check([key]):  # the launcher's code, or an earlier note
            note = {**json.loads(bytes(self.root.get(key)).decode()), **note}
        self.root.set(key, json.dumps(note))


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


def describe_exit(rank: int, note: dict) -> str:
    """``rank 1 exited (code 0)``, from a rank's exit note."""
    code = note.get("code")
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
