"""The value every layer passes around: a resolved group, and what is known of groups.

:class:`Comm` is a group as one collective call sees it: the process group, this rank's
place in it, and the backend object that runs the call. :class:`_GroupFacts` is what
distkit learns about a process group once (size, rank, devices, call numbers, what the
watchdog reads), in :data:`_FACTS`. Deciding which group and which backend a call gets is
:mod:`distkit.dist._route`'s job; this module imports none of the layers that use it.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Literal, NoReturn, Optional, Union

import torch
from torch import Tensor

from distkit import _registry
from distkit._compat import (
    ProcessGroup,
    backend_config,
    backend_name,
    group_name,
    group_timeout,
)
from distkit.dist.core.args import Where, fail
from distkit.utils.device import backend_device_types, device_of_type
from distkit.utils.groups import forked_error, group_ranks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_CPU = torch.device("cpu")


#: What every ``group`` argument accepts: ``None`` (the default group), a process group,
#: a sequence of global ranks (resolved through :func:`distkit.utils.get_group`), a 1-D
#: ``DeviceMesh`` (``mesh["dp"]``), or one dimension of a mesh as ``(mesh, "dp")`` or
#: ``(mesh, 0)``. ``-100`` is what ``torch.distributed.new_group`` returns on a rank outside
#: the new group (and says so in its annotation since torch 2.14): accepted by the type,
#: refused at run time with ``ValueError`` (this rank is not a member).
GroupLike = Union[
    None,
    ProcessGroup,
    Sequence[int],
    "DeviceMesh",
    tuple["DeviceMesh", Union[str, int]],
    Literal[-100],
]


#: Names of the groups torch.compile traced a collective of (see _GroupFacts.traced)
_TRACED: set[str] = set()

#: Per backend method, the call that runs it eagerly from a traced region (a clean graph
#: break), filled by :mod:`distkit.dist._route` once torch._dynamo is loaded.
EAGER: dict[str, Callable[..., Any]] = {}


class _GroupFacts:
    """What distkit learns about a process group once: size, rank, backend, devices."""

    __slots__ = (
        "backend",
        "backend_name",
        "broken",
        "call",
        "checking",
        "cpu_home",
        "failed",
        "gid",
        "histories",
        "last_check",
        "p2p",
        "pairs",
        "pending",
        "rank",
        "ranks",
        "ref",
        "seq",
        "sites",
        "size",
        "thread",
        "timeout",
        "traced",
        "types",
    )

    def __init__(self, pg: ProcessGroup) -> None:
        self.ref = weakref.ref(pg, _forget)
        self.rank: int = pg.rank()
        self.size: int = pg.size()
        self.gid: str = group_name(pg)  # the same on every rank
        timeout = group_timeout(pg)
        self.timeout: Optional[float] = None if timeout is None else timeout.total_seconds()
        self.backend_name: str = backend_name(pg)  # "gloo", "nccl", "cpu:gloo,cuda:nccl"
        self.types: list[str] = backend_device_types(backend_config(pg))
        # gloo-like groups stage CPU tensors on the CPU: the common case, checked first
        self.cpu_home: bool = self.types[0] == "cpu"
        # the backend object that runs its collectives: chosen by distkit.dist._route
        self.backend: Any = None
        self.ranks: Optional[list[int]] = None
        self.seq = 0  # collectives this process entered on the group (hang reports)
        self.thread = 0  # ident of the thread in a collective on it (0: none)
        self.histories: dict[str, deque[list[int]]] = {}  # sizes of recent calls (_uneven)
        # what the watchdog reads (see _watchdog): the collective the thread is in, as
        # (public name, backend method, its parameter names, its arguments) ...
        self.call: Optional[tuple[str, str, Sequence[str], tuple]] = None
        self.checking = False  # ... whether it is in that call's default check ...
        self.failed: Optional[tuple[int, BaseException]] = None  # ... what it found there
        # ... and the async calls still in flight: call number -> (call, its handle, weakly)
        self.pending: dict[int, tuple[tuple, Any]] = {}
        self.sites: dict[tuple[str, int], int] = {}  # calls seen per call site (_check)
        # the number of the last default check, and the store keys of its attempts
        self.last_check: Optional[tuple[int, list[str]]] = None
        # whether torch.compile traced a collective of this group: its traced calls run
        # without Python (no call number), so ranks' call numbers drift: no default check
        self.traced = self.gid in _TRACED
        # why the group cannot be used any more (a collective on it timed out, or a rank
        # went away: its ranks are out of step), or None
        self.broken: Optional[str] = None
        # point to point: the state of each channel ((direction, peer, tag) -> its
        # history, message count and receives in order: distkit.dist.backends.p2p) ...
        self.pairs: dict[tuple[str, int, int], Any] = {}
        # ... and the point-to-point calls threads wait in now, for the watchdog (token ->
        # (public name, peers' group ranks, tag, thread ident, the ops it waits for))
        self.p2p: dict[int, tuple[str, tuple[int, ...], int, int, tuple[Any, ...]]] = {}
        if _registry.inherited(pg):
            self.broken = FORKED


# Keyed by id and holding the group only weakly: distkit never keeps a process group
# alive. A group that outlives torch's destroy_process_group is finalized during
# interpreter shutdown, when gloo's worker threads can no longer be joined, and the
# process aborts with "terminate called without an active exception" (pytorch#179291);
# holding one reference past destroy made 12 of 20 four-rank torchrun runs on this
# project's machine end that way. An entry goes away with its group.
_FACTS: dict[int, _GroupFacts] = {}


def broken_groups() -> list[str]:
    """Why each group that cannot be used any more is broken (empty: none is)."""
    return [f"group {f.gid}: {f.broken}" for f in list(_FACTS.values()) if f.broken]


def _forget(ref: weakref.ref) -> None:
    if not isinstance(_FACTS, dict):  # the interpreter is tearing this module down
        return
    for key, facts in list(_FACTS.items()):
        if facts.ref is ref:
            del _FACTS[key]


#: What :attr:`_GroupFacts.broken` says of a group a forked child inherited from its
#: parent (see :func:`_after_fork`).
FORKED = "this process is a fork of the rank that made it"


class _ForkedWork:
    """In a fork's child, what an async call its parent started waits for: the refusal
    (the parent's work is the parent's; waited for here, it never ends)."""

    def __init__(self, fn: str, comm: Comm) -> None:
        self.fn = fn
        self.comm = comm

    def is_completed(self) -> bool:
        return True  # wait() does not block: it raises

    def wait(self, timeout: Any = None) -> None:
        refuse_forked(self.fn, self.comm)


def _after_fork() -> None:
    # A fork's child shares its parent's connections (the backend's sockets, the store's):
    # it cannot take part in the parent's collectives, which waited for the group's
    # timeout (the board's keys are the parent's), and a send could put its bytes on the
    # parent's connection. Every group it inherited is marked: its next call raises
    # (Comm.enter), before any communication, and so does the wait of an async call the
    # parent had in flight. Python objects only, as in any fork hook.
    if _registry.forked_from is None:
        return
    for facts in list(_FACTS.values()):
        pg = facts.ref()
        if pg is None or not _registry.inherited(pg):
            continue
        facts.broken = FORKED
        where = Comm(None, facts.rank, facts.size, None)
        for call, ref in list(facts.pending.values()):
            handle = ref()
            if handle is not None and handle._works is not None:
                handle._works = [_ForkedWork(call[0], where)]
                handle._on_error = None
        facts.pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def refuse_forked(fn: str, comm: Where) -> NoReturn:
    """Raise the error of a call on a group this process inherited from the rank that
    forked it (see :func:`distkit._registry.inherited`)."""
    what, fix = forked_error()
    fail(RuntimeError, fn, comm, what, fix)


def _alive_thread(ident: int) -> Optional[threading.Thread]:
    for thread in threading.enumerate():
        if thread.ident == ident:
            return thread
    return None


class Comm:
    """A resolved group: who we talk to, and which backend does the talking.

    A Comm lives for one collective call; it holds its process group only that long.
    """

    __slots__ = ("_facts", "backend", "pg", "rank", "size")

    def __init__(
        self,
        pg: Optional[ProcessGroup],
        rank: int,
        size: int,
        backend: Any,
        facts: Optional[_GroupFacts] = None,
    ) -> None:
        self.pg = pg
        self.rank = rank
        self.size = size
        self.backend = backend
        self._facts = facts

    @property
    def traceable(self) -> bool:
        """Whether the group is there to trace a collective on (while ``torch.compile``
        traces, a rank list :func:`~distkit.utils.get_group` has not created yet is not:
        then every collective runs eagerly)."""
        return self.pg is not None

    @property
    def alone(self) -> bool:
        """Whether this rank is the whole group (no process group, or a group of one):
        the one test of "is there anyone to talk to" outside the router."""
        return self.size == 1

    @property
    def cpu_home(self) -> bool:
        """Whether tensors are staged on the CPU by default (gloo, mpi, no group)."""
        return self._facts is None or self._facts.cpu_home

    @property
    def backend_name(self) -> Optional[str]:
        """Lower-case backend string of the group (``None`` in a single process)."""
        return None if self._facts is None else self._facts.backend_name

    def enter(self, fn: str, count: bool = True) -> int:
        """Note that this thread entered a collective on the group; return its number.

        A process group serves one thread at a time: two threads in collectives on one
        group enqueue their work in an order the other ranks cannot follow, and the
        backend aborts the process (gloo) or deadlocks. The second thread raises here
        instead. Threads may use different groups at once. A point-to-point call
        (``count=False``) holds the group too, but takes no number: only two of its ranks
        take part, so the others' numbers would drift from its ranks'.
        """
        facts = self._facts
        if facts is None:
            return 0
        if facts.broken is not None:
            if facts.broken is FORKED:
                refuse_forked(fn, self)
            fail(
                RuntimeError,
                fn,
                self,
                f"this group cannot be used any more: {facts.broken}, and its ranks are "
                "out of step since",
                "Start a new world (dist.destroy_dist(), then dist.init_dist()), or use "
                "another group",
            )
        me = threading.get_ident()
        busy = facts.thread
        other = _alive_thread(busy) if busy and busy != me else None
        if other is not None:
            fail(
                RuntimeError,
                fn,
                self,
                f"thread {other.name!r} is in a collective on this group already, and a "
                "process group serves one thread at a time",
                "Run the collectives of one group from one thread, or give each thread a "
                "group of its own (distkit.utils.get_group(ranks, timeout=...) makes one)",
            )
        facts.thread = me
        if count:
            facts.seq += 1
        return facts.seq

    def history(self, kind: str, length: int) -> deque[list[int]]:
        """The sizes the last ``length`` calls of ``kind`` on this group moved."""
        assert self._facts is not None, "a world of one rank keeps no history"
        past = self._facts.histories.get(kind)
        if past is None:
            past = self._facts.histories[kind] = deque(maxlen=length)
        return past

    def leave(self) -> None:
        """Note that this thread left its collective on the group."""
        if self._facts is not None:
            self._facts.thread = 0

    def global_ranks(self) -> list[int]:
        """Global rank of each group rank."""
        facts = self._facts
        if self.pg is None or facts is None:
            return [0]
        if facts.ranks is None:
            facts.ranks = group_ranks(self.pg)
        return facts.ranks

    def global_rank(self, group_rank: int) -> int:
        return self.global_ranks()[group_rank]

    def device(self, data: Optional[Tensor] = None) -> torch.device:
        """The device to stage tensors on (see :func:`distkit.utils.get_comm_device`)."""
        facts = self._facts
        if facts is None:
            return _CPU
        types_ = facts.types
        if data is not None and len(types_) > 1:
            if data.is_cpu:
                if "cpu" in types_:
                    return _CPU
            elif data.device.type in types_:
                return device_of_type(data.device.type, self.pg)
        return _CPU if facts.cpu_home else device_of_type(types_[0], self.pg)

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, size={self.size}, backend={self.backend_name})"


class TracedComm(Comm):
    """A group resolved while ``torch.compile`` traces: only what traces.

    No facts cache (weak references), no thread guard, no history: the traced backend
    (:mod:`distkit.dist.backends.traced`) runs functional collectives on ``pg``. ``group`` is the
    caller's own argument, from which :meth:`eager` resolves the group again, outside
    the graph, for what cannot trace. ``pg`` is ``None`` when the group cannot be found
    while tracing (a rank list :func:`~distkit.utils.get_group` did not create yet):
    then every collective runs eagerly.
    """

    __slots__ = ("gloo", "group", "ranks")

    def __init__(
        self,
        pg: Optional[ProcessGroup],
        rank: int,
        size: int,
        backend: Any,
        group: Any,
        ranks: list[int],
        gloo: bool = False,
    ) -> None:
        super().__init__(pg, rank, size, backend)
        self.group = group
        self.ranks = ranks
        #: whether the eager backend carries the dtypes gloo refuses (as bytes, or wider)
        self.gloo = gloo

    def global_ranks(self) -> list[int]:
        return self.ranks

    def eager(self, method: str, *args: Any) -> Any:
        """Run backend ``method`` outside the graph (a clean graph break), eagerly."""
        return EAGER[method](self.group, *args)
