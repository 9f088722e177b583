"""The one place that decides "distributed or not", and which backend runs a call.

Every collective resolves its ``group`` argument with :func:`resolve` into a
:class:`Comm`: the process group, this rank's place in it, and ``backend``, the object
that runs the collective (:data:`~distkit.dist._single.SINGLE` when there is no process
group, :data:`~distkit.dist._torch.TORCH` otherwise). Both implement
:class:`~distkit.dist._backend.Backend`, and arguments are checked before either runs,
so a bad argument fails the same way in a debugger as on 8 ranks.

Whether a process group exists is read from one place, :data:`distkit._registry.current`,
here and in the compiled shortcuts of :mod:`distkit.dist._shortcut` that let the
hottest calls skip this resolution when there is nothing to resolve.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn, Optional, Union

import torch
from torch import Tensor

from distkit import _registry
from distkit._compat import ProcessGroup, backend_config, backend_name, c10d, is_registered
from distkit.dist._args import fail
from distkit.dist._gloo import GLOO
from distkit.dist._single import SINGLE
from distkit.dist._torch import TORCH
from distkit.utils.device import backend_device_types, device_of_type
from distkit.utils.groups import get_group, group_ranks

if TYPE_CHECKING:
    from distkit.dist._backend import Backend

_CPU = torch.device("cpu")

#: What every ``group`` argument accepts: ``None`` (the default group), a process group,
#: or a sequence of global ranks (resolved through :func:`distkit.utils.get_group`).
GroupLike = Union[None, ProcessGroup, Sequence[int]]


class _GroupFacts:
    """What distkit learns about a process group once: size, rank, backend, devices."""

    __slots__ = (
        "backend",
        "cpu_home",
        "histories",
        "impl",
        "rank",
        "ranks",
        "ref",
        "seq",
        "size",
        "thread",
        "types",
    )

    def __init__(self, pg: ProcessGroup) -> None:
        self.ref = weakref.ref(pg, _forget)
        self.rank: int = pg.rank()
        self.size: int = pg.size()
        self.backend: str = backend_name(pg)
        self.types: list[str] = backend_device_types(backend_config(pg))
        # gloo-like groups stage CPU tensors on the CPU: the common case, checked first
        self.cpu_home: bool = self.types[0] == "cpu"
        # gloo cannot carry some dtypes: its backend carries them in others (see _gloo)
        self.impl: Backend = GLOO if "gloo" in self.backend else TORCH
        self.ranks: Optional[list[int]] = None
        self.seq = 0  # collectives this process entered on the group (hang reports)
        self.thread = 0  # ident of the thread in a collective on it (0: none)
        self.histories: dict[str, deque[list[int]]] = {}  # sizes of recent calls (_uneven)


# Keyed by id and holding the group only weakly: distkit never keeps a process group
# alive. A group that outlives torch's destroy_process_group is finalized during
# interpreter shutdown, when gloo's worker threads can no longer be joined, and the
# process aborts with "terminate called without an active exception" (pytorch#179291);
# holding one reference past destroy made 12 of 20 four-rank torchrun runs on this
# project's machine end that way. An entry goes away with its group.
_FACTS: dict[int, _GroupFacts] = {}


def _forget(ref: weakref.ref) -> None:
    for key, facts in list(_FACTS.items()):
        if facts.ref is ref:
            del _FACTS[key]


def _facts(pg: ProcessGroup) -> _GroupFacts:
    facts = _FACTS.get(id(pg))
    if facts is None or facts.ref() is not pg:
        facts = _FACTS[id(pg)] = _GroupFacts(pg)
    return facts


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
        backend: Backend,
        facts: Optional[_GroupFacts] = None,
    ) -> None:
        self.pg = pg
        self.rank = rank
        self.size = size
        self.backend = backend
        self._facts = facts

    @property
    def cpu_home(self) -> bool:
        """Whether tensors are staged on the CPU by default (gloo, mpi, no group)."""
        return self._facts is None or self._facts.cpu_home

    @property
    def backend_name(self) -> Optional[str]:
        """Lower-case backend string of the group (``None`` in a single process)."""
        return None if self._facts is None else self._facts.backend

    def enter(self, fn: str) -> int:
        """Note that this thread entered a collective on the group; return its number.

        A process group serves one thread at a time: two threads in collectives on one
        group enqueue their work in an order the other ranks cannot follow, and the
        backend aborts the process (gloo) or deadlocks. The second thread raises here
        instead. Threads may use different groups at once.
        """
        facts = self._facts
        if facts is None:
            return 0
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


#: The implicit world of one rank, when no process group exists.
NO_GROUP = Comm(None, 0, 1, SINGLE)


def _comm_of(pg: ProcessGroup) -> Comm:
    facts = _facts(pg)
    return Comm(pg, facts.rank, facts.size, facts.impl, facts)


def resolve(group: Any, fn: str) -> Comm:
    """Resolve a ``group`` argument (see :data:`GroupLike`) for the collective ``fn``.

    Raises:
        TypeError: ``group`` is not None, a ProcessGroup or a sequence of ranks.
        ValueError: The group belongs to a destroyed world, or this rank is not in it.
    """
    world = _registry.current._default_pg
    if group is None:
        return NO_GROUP if world is None else _comm_of(world)
    here = NO_GROUP if world is None else None
    if isinstance(group, ProcessGroup):
        if world is None or not is_registered(group):
            fail(
                ValueError,
                fn,
                here or _comm_of(world),
                "group belongs to a process group that was destroyed",
                "Create groups again (distkit.utils.get_group) after init_dist",
            )
        if group.rank() < 0:
            _not_member("the group", fn)
        return _comm_of(group)
    if isinstance(group, (list, tuple, range)):
        try:
            pg = get_group(group)
        except (TypeError, ValueError) as exc:
            what = str(exc).removeprefix("get_group: ")
            fail(type(exc), fn, here or _comm_of(world), f"group={list(group)!r}: {what}")
        if pg is None:  # single process, group == [0]
            return NO_GROUP
        if not isinstance(pg, ProcessGroup):
            _not_member(f"group {list(group)}", fn)
        return _comm_of(pg)
    if c10d is not None and group is c10d.GroupMember.NON_GROUP_MEMBER:
        _not_member("the group (torch's non-member marker)", fn)
    fail(
        TypeError,
        fn,
        here or _comm_of(world),
        f"group must be None, a ProcessGroup or a list of global ranks, got {type(group).__name__}",
    )


def _not_member(what: str, fn: str) -> NoReturn:
    comm = _comm_of(_registry.current._default_pg)
    fail(
        ValueError,
        fn,
        comm,
        f"this rank (global rank {comm.rank}) is not a member of {what}",
        "Call the collective only on the group's members; get_group must still be "
        "called on every rank to create the group",
    )
