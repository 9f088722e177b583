"""The one place that decides "distributed or not", and which backend runs a call.

Every collective resolves its ``group`` argument with :func:`resolve` into a
:class:`Comm`: the process group, this rank's place in it, and ``backend``, the object
that runs the collective (:data:`~distkit.dist._single.SINGLE` when there is no process
group, :data:`~distkit.dist._torch.TORCH` otherwise, and
:data:`~distkit.dist._traced.TRACED` while ``torch.compile`` traces). All implement
:class:`~distkit.dist._backend.Backend`, and arguments are checked before any of them runs,
so a bad argument fails the same way in a debugger as on 8 ranks.

Whether a process group exists is read from one place, :data:`distkit._registry.current`,
here and in the compiled shortcuts of :mod:`distkit.dist._shortcut` that let the
hottest calls skip this resolution when there is nothing to resolve.
"""

from __future__ import annotations

import sys
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
    after_import,
    backend_config,
    backend_name,
    c10d,
    disable,
    get_process_group_ranks,
    group_name,
    group_timeout,
    is_compiling,
    is_registered,
    run_at_trace_time,
)
from distkit.dist import _watchdog
from distkit.dist._args import fail
from distkit.dist._gloo import GLOO
from distkit.dist._single import SINGLE
from distkit.dist._torch import TORCH
from distkit.dist._traced import TRACED
from distkit.utils.device import backend_device_types, device_of_type
from distkit.utils.groups import cached_group, get_group, group_ranks

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from distkit.dist._backend import Backend

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

_MESH_MODULE = "torch.distributed.device_mesh"


class _GroupFacts:
    """What distkit learns about a process group once: size, rank, backend, devices."""

    __slots__ = (
        "backend",
        "broken",
        "call",
        "checking",
        "cpu_home",
        "failed",
        "gid",
        "histories",
        "impl",
        "last_check",
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
        # what the watchdog reads (see _watchdog): the collective the thread is in, as
        # (public name, backend method, its parameter names, its arguments) ...
        self.call: Optional[tuple[str, str, Sequence[str], tuple]] = None
        self.checking = False  # ... whether it is in that call's default check ...
        self.failed: Optional[tuple[int, BaseException]] = None  # ... what it found there
        # ... and the async calls still in flight: call number -> (call, its handle, weakly)
        self.pending: dict[int, tuple[tuple, Any]] = {}
        self.sites: dict[tuple[str, int], int] = {}  # calls seen per call site (_check)
        self.last_check: Optional[str] = None  # store key of the last default check
        # whether torch.compile traced a collective of this group: its traced calls run
        # without Python (no call number), so ranks' call numbers drift: no default check
        self.traced = self.gid in _TRACED
        # why the group cannot be used any more (a collective on it timed out, or a rank
        # went away: its ranks are out of step), or None
        self.broken: Optional[str] = None
        if self.size > 1:
            _watchdog.ensure(_FACTS)


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
        if facts.broken is not None:
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
    (:mod:`distkit.dist._traced`) runs functional collectives on ``pg``. ``group`` is the
    caller's own argument, from which :meth:`eager` resolves the group again, outside
    the graph, for what cannot trace. ``pg`` is ``None`` when the group cannot be found
    while tracing (a rank list :func:`~distkit.utils.get_group` did not create yet):
    then every collective runs eagerly.
    """

    __slots__ = ("group", "ranks")

    def __init__(
        self, pg: Optional[ProcessGroup], rank: int, size: int, group: Any, ranks: list[int]
    ) -> None:
        super().__init__(pg, rank, size, TRACED)
        self.group = group
        self.ranks = ranks

    def global_ranks(self) -> list[int]:
        return self.ranks

    def eager(self, method: str, *args: Any) -> Any:
        """Run backend ``method`` outside the graph (a clean graph break), eagerly."""
        return _EAGER[method](self.group, *args)


def _run_eager_impl(group: Any, method: str, *args: Any) -> Any:
    comm = resolve(group, method)
    return getattr(comm.backend, method)(comm, *args)


def _facts_eager_impl(group: Any, fn: str) -> tuple[int, int, list[int]]:
    comm = resolve(group, fn)
    return comm.rank, comm.size, comm.global_ranks()


_EAGER_REASON = (
    "distkit.dist.%s cannot be traced with these arguments (it needs sizes only known "
    "at run time, or async_op=True returns a handle): it runs eagerly between graphs"
)
_OBJECT_METHODS = (
    "all_gather_object",
    "gather_object",
    "broadcast_object",
    "scatter_object",
    "all_to_all_object",
)
_EAGER_REASONS = {
    **dict.fromkeys(
        _OBJECT_METHODS,
        "distkit.dist.%s pickles objects, which cannot be traced: it runs eagerly between graphs",
    ),
    "barrier": "distkit.dist.%s blocks, which cannot be traced: it runs eagerly between graphs",
}


def _eager_runner(method: str) -> Callable[..., Any]:
    def run(group: Any, *args: Any) -> Any:
        return _run_eager_impl(group, method, *args)

    return disable(run, _EAGER_REASONS.get(method, _EAGER_REASON) % method)


#: Names of the groups torch.compile traced a collective of (see _GroupFacts.traced)
_TRACED: set[str] = set()


def _mark_traced(pg: ProcessGroup) -> bool:
    """Note, while tracing, that ``pg``'s collectives are traced (see _GroupFacts.traced)."""
    name = group_name(pg)
    _TRACED.add(name)
    for facts in list(_FACTS.values()):
        if facts.gid == name:
            facts.traced = True
    return True


#: Per backend method, the call that runs it eagerly (a graph break that says why). Built
#: when torch._dynamo is imported (torch.compile imports it before it traces anything):
#: building it needs torch._dynamo, whose import would otherwise cost every process that
#: never compiles 70 to 170 MB and a second on its first collective.
_EAGER: dict[str, Callable[..., Any]] = {}
_EAGER_METHODS = (
    "all_reduce",
    "all_gather",
    "gather",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single",
    "scatter",
    "barrier",
    *_OBJECT_METHODS,
)
#: _facts_eager_impl as a graph break; the same, with no graph to break, until then
_facts_eager: Callable[..., Any] = _facts_eager_impl
#: _mark_traced, run once while tracing (its result a constant of the graph), once
#: torch._dynamo is loaded
_traced_once: Callable[..., Any] = _mark_traced


def _with_dynamo() -> None:
    global _facts_eager, _traced_once
    _traced_once = run_at_trace_time(_mark_traced)
    _EAGER.update({name: _eager_runner(name) for name in _EAGER_METHODS})
    _facts_eager = disable(
        _facts_eager_impl,
        "distkit: a rank-list group that get_group has not created yet is created eagerly; "
        "call distkit.utils.get_group(ranks) once before compiling",
    )


after_import("torch._dynamo", _with_dynamo)


#: The implicit world of one rank, when no process group exists.
NO_GROUP = Comm(None, 0, 1, SINGLE)


def _comm_of(pg: ProcessGroup) -> Comm:
    facts = _facts(pg)
    return Comm(pg, facts.rank, facts.size, facts.impl, facts)


def _traced_comm(pg: ProcessGroup, group: Any) -> Comm:
    _traced_once(pg)
    return TracedComm(pg, pg.rank(), pg.size(), group, get_process_group_ranks(pg))


def _mesh_type() -> Any:
    """torch's DeviceMesh class, or None while its module is not loaded (then no mesh
    can exist, and the module is not imported for nothing)."""
    module = sys.modules.get(_MESH_MODULE)
    return None if module is None else module.DeviceMesh


def _mesh_group(group: Any, fn: str, world: Any) -> Optional[ProcessGroup]:
    """The process group of a mesh dimension (``mesh["dp"]``, ``(mesh, "dp")``,
    ``(mesh, 0)``), or ``None`` when ``group`` is no mesh at all."""
    mesh_type = _mesh_type()
    if mesh_type is None:
        return None
    here = NO_GROUP if world is None else None
    if isinstance(group, mesh_type):
        mesh, dim = group, None
    elif isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], mesh_type):
        mesh, dim = group
    else:
        return None
    if world is None:
        fail(
            ValueError,
            fn,
            NO_GROUP,
            "group is a DeviceMesh, but no process group exists (it was destroyed)",
            "Create the mesh (init_device_mesh) after init_dist, and use it before destroy_dist",
        )
    names = mesh.mesh_dim_names
    if dim is None:
        if mesh.ndim != 1:
            fail(
                TypeError,
                fn,
                here or _comm_of(world),
                f"group is a {mesh.ndim}-D DeviceMesh (dimensions {names}); a collective "
                "runs over one dimension",
                'Pass one dimension: mesh["dp"], (mesh, "dp") or (mesh, 0)',
            )
        return mesh.get_group()
    if isinstance(dim, str):
        if names is None or dim not in names:
            fail(
                ValueError,
                fn,
                here or _comm_of(world),
                f"group=(mesh, {dim!r}): the mesh has no dimension {dim!r} "
                f"(its dimensions: {names})",
                "Name one of the mesh's dimensions, or pass its index",
            )
        return mesh.get_group(dim)
    if isinstance(dim, bool) or not isinstance(dim, int):
        fail(
            TypeError,
            fn,
            here or _comm_of(world),
            f"group=(mesh, dim): dim must be a dimension name or index, got {dim!r}",
        )
    if not 0 <= dim < mesh.ndim:
        fail(
            ValueError,
            fn,
            here or _comm_of(world),
            f"group=(mesh, {dim}): the mesh has {mesh.ndim} dimension(s)",
            f"Pass a dimension from 0 to {mesh.ndim - 1}",
        )
    return mesh.get_group(dim)


def resolve(group: Any, fn: str, collective: bool = True) -> Comm:
    """Resolve a ``group`` argument (see :data:`GroupLike`) for the collective ``fn``.

    While ``torch.compile`` traces, the result is a :class:`TracedComm` whose backend is
    :data:`~distkit.dist._traced.TRACED` (functional collectives, no bookkeeping).

    Args:
        group: The caller's ``group`` argument.
        fn: The public function, for messages.
        collective: ``False`` for queries (``get_rank(group)``), which answer for a world
            of one rank even in a launched process that has no process group.

    Raises:
        TypeError: ``group`` is not one of the forms of :data:`GroupLike`, or is a mesh
            of more than one dimension.
        ValueError: The group belongs to a destroyed world, or this rank is not in it.
        RuntimeError: A collective without a process group in a process that a launcher
            started as one of several ranks (see :func:`_launched_alone`).
    """
    world = _registry.current._default_pg
    if group is None:
        if world is None:
            if collective and _registry.alone != "":
                _launched_alone(fn)
            return NO_GROUP
        return _traced_comm(world, None) if is_compiling() else _comm_of(world)
    here = NO_GROUP if world is None else None
    pg: Optional[ProcessGroup]
    if isinstance(group, ProcessGroup):
        pg = group
    else:
        pg = (
            _mesh_group(group, fn, world)
            if isinstance(group, tuple) or not isinstance(group, (list, range))
            else None
        )
        if pg is None and isinstance(group, (list, tuple, range)):
            if world is not None and is_compiling():
                found = cached_group(group, world)
                if found is None:  # not created yet: created (and used) eagerly
                    rank, size, ranks = _facts_eager(group, fn)
                    return TracedComm(None, rank, size, group, ranks)
                pg = found
            else:
                if world is None and collective and _registry.alone != "":
                    _launched_alone(fn)  # before the rank list is judged by a world of one
                try:
                    got = get_group(group)
                except (TypeError, ValueError) as exc:
                    what = str(exc).removeprefix("get_group: ")
                    fail(type(exc), fn, here or _comm_of(world), f"group={list(group)!r}: {what}")
                if got is None:  # single process, group == [0]
                    if collective and _registry.alone != "":
                        _launched_alone(fn)
                    return NO_GROUP
                if not isinstance(got, ProcessGroup):
                    _not_member(f"group {list(group)}", fn)
                return _traced_comm(got, group) if is_compiling() else _comm_of(got)
        if pg is None:
            if c10d is not None and group is c10d.GroupMember.NON_GROUP_MEMBER:
                _not_member("the group (torch's non-member marker)", fn)
            fail(
                TypeError,
                fn,
                here or _comm_of(world),
                "group must be None, a ProcessGroup, a list of global ranks, a 1-D "
                'DeviceMesh or (mesh, "dim"), got ' + type(group).__name__,
            )
    if world is None or not is_registered(pg):
        fail(
            ValueError,
            fn,
            here or _comm_of(world),
            "group belongs to a process group that was destroyed",
            "Create groups again (distkit.utils.get_group) after init_dist",
        )
    if pg.rank() < 0:
        _not_member("the group", fn)
    return _traced_comm(pg, group) if is_compiling() else _comm_of(pg)


def _launched_alone(fn: str) -> None:
    """Raise when a launcher started this process as one of several ranks and no process
    group exists: the collective would run as a world of one rank, and every rank would
    silently work alone (torch raises here too)."""
    launched = _registry.decide()
    if not launched:
        return
    raise RuntimeError(
        f"{fn}: no process group exists, but {launched.replace(' it ', ' this process ')}"
        ": as a world of one rank, every rank would silently work alone. Call "
        "dist.init_dist() (or torch.distributed.init_process_group) before the first "
        "collective; if these processes are meant to run independently, call "
        'dist.init_dist(launcher="none") or set DISTKIT_INDEPENDENT=1'
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
