"""The one place that decides "distributed or not", and which backend runs a call.

Every collective resolves its ``group`` argument with :func:`resolve` into a
:class:`~distkit.dist.core.comm.Comm`: the process group, this rank's place in it, and
``backend``, the object that runs the collective
(:data:`~distkit.dist.backends.single.SINGLE` when there is no process group,
:data:`~distkit.dist.backends.tensors.TORCH` or
:data:`~distkit.dist.backends.gloo.GLOO` otherwise, and
:data:`~distkit.dist.backends.traced.TRACED` while ``torch.compile`` traces). All
implement :class:`~distkit.dist.backends.base.Backend`, and arguments are checked before
any of them runs, so a bad argument fails the same way in a debugger as on 8 ranks.

Whether a process group exists is read from one place, :data:`distkit._registry.current`,
here and in the compiled shortcuts of :mod:`distkit.dist.core.shortcut` that let the
hottest calls skip this resolution when there is nothing to resolve.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, NoReturn, Optional, TypeVar

from distkit import _registry
from distkit._compat import (
    ProcessGroup,
    after_import,
    backend_name,
    c10d,
    disable,
    functional_collectives,
    get_process_group_ranks,
    group_name,
    is_compiling,
    is_registered,
    real_object,
    run_at_trace_time,
    under_compile,
)
from distkit.dist.backends.gloo import GLOO
from distkit.dist.backends.single import SINGLE
from distkit.dist.backends.tensors import TORCH
from distkit.dist.backends.traced import TRACED
from distkit.dist.core import comm as _comm
from distkit.dist.core import spec
from distkit.dist.core.args import fail
from distkit.dist.core.comm import _FACTS, _TRACED, Comm, TracedComm, _GroupFacts, refuse_forked
from distkit.dist.core.shortcut import shortcut
from distkit.dist.guard import creation as _creation  # noqa: F401 (checks group creations)
from distkit.dist.guard import watch as _watch
from distkit.dist.guard import watchdog as _watchdog
from distkit.utils.groups import cached_group, get_group


def _facts(pg: ProcessGroup) -> _GroupFacts:
    """What is known of ``pg``, learned on its first collective: then its backend is
    chosen (gloo cannot carry some dtypes: its backend carries them in others, see
    :mod:`distkit.dist.backends.gloo`), and a group of several ranks starts the watchdog."""
    facts = _FACTS.get(id(pg))
    if facts is None or facts.ref() is not pg:
        facts = _FACTS[id(pg)] = _GroupFacts(pg)
        facts.backend = GLOO if "gloo" in facts.backend_name else TORCH
        if facts.size > 1 and facts.broken is None:  # (a fork's child: FORKED, no watchdog)
            _watchdog.ensure(_FACTS)
    return facts


def _run_eager_impl(group: Any, method: str, *args: Any) -> Any:
    comm = resolve(group, method)
    return getattr(comm.backend, method)(comm, *args)


def _facts_eager_impl(group: Any, fn: str) -> tuple[int, int, list[int]]:
    comm = resolve(group, fn)
    return comm.rank, comm.size, comm.global_ranks()


def _eager_runner(method: str) -> Callable[..., Any]:
    def run(group: Any, *args: Any) -> Any:
        return _run_eager_impl(group, method, *args)

    return disable(run, spec.eager_reason(method))


def _mark_traced(pg: ProcessGroup) -> tuple[int, int, tuple[int, ...], bool]:
    """Note, while tracing, that ``pg``'s collectives are traced (see _GroupFacts.traced),
    and return what a :class:`TracedComm` needs of it: this rank, the size, the members'
    global ranks, and whether the eager backend would carry some dtypes as bytes (gloo).

    Run once per call site at trace time (see :data:`_traced_once`), so that dynamo
    traces none of it: plain constants, no reference to ``pg`` kept in the graph."""
    if _registry.inherited(real_object(pg)):  # a fork's child: the graph would wait for ever
        where = Comm(None, pg.rank(), pg.size(), None)
        refuse_forked("torch.compile", where)
    name = group_name(pg)
    _TRACED.add(name)
    for facts in list(_FACTS.values()):
        if facts.gid == name:
            facts.traced = True
    ranks = tuple(get_process_group_ranks(pg))
    return pg.rank(), pg.size(), ranks, "gloo" in backend_name(pg)


#: Per backend method, the call that runs it eagerly (a graph break that says why). Built
#: when torch._dynamo is imported (torch.compile imports it before it traces anything):
#: building it needs torch._dynamo, whose import would otherwise cost every process that
#: never compiles 70 to 170 MB and a second on its first collective.
_EAGER = _comm.EAGER


_EAGER_METHODS = tuple(spec.SPECS)


F = TypeVar("F", bound=Callable[..., Any])

#: Public calls that no backend method runs and torch.compile cannot trace (helpers made
#: of several collectives, or that draw at run time), by name: the function and why.
_UNTRACED: dict[str, tuple[Callable[..., Any], str]] = {}
#: Their eager runners (graph breaks that say why), built once torch._dynamo is imported.
_EAGER_CALLS: dict[str, Callable[..., Any]] = {}


def _build_eager_call(name: str) -> None:
    fn, reason = _UNTRACED[name]
    why = f"distkit.dist.{name} {reason}: it runs eagerly between graphs"
    _EAGER_CALLS[name] = disable(fn, why)


def untraced(name: str, reason: str) -> Callable[[F], F]:
    """Decorate the public call ``name``, which torch.compile cannot trace: while tracing,
    the whole call runs eagerly between two graphs, with a process group or without one
    (a clean graph break whose reason is ``distkit.dist.<name> <reason>``), instead of
    the tracer stepping into distkit's bookkeeping; run eagerly inside a compiled
    function (after a graph break), the same, so that the tracer's hook does not
    compile its functions one by one. Outside torch.compile it costs about 0.1 us (0.25 us
    once torch._dynamo is imported)."""

    def wrap(fn: F) -> F:
        _UNTRACED[name] = (fn, reason)
        if "torch._dynamo" in sys.modules:  # else built by _with_dynamo, on its import
            _build_eager_call(name)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            # empty until torch._dynamo is imported: nothing can trace before then
            if _EAGER_CALLS and under_compile():  # tracing, or eager under its hook
                return _EAGER_CALLS[name](*args, **kwargs)
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap


#: _facts_eager_impl as a graph break; the same, with no graph to break, until then
_facts_eager: Callable[..., Any] = _facts_eager_impl


#: _mark_traced, run once while tracing (its result a constant of the graph), once
#: torch._dynamo is loaded
_traced_once: Callable[..., Any] = _mark_traced


def _with_dynamo() -> None:
    global _facts_eager, _traced_once
    _traced_once = run_at_trace_time(_mark_traced)
    _registry.probe_while_tracing = run_at_trace_time(_registry.probe)
    _EAGER.update({name: _eager_runner(name) for name in _EAGER_METHODS})
    for name in _UNTRACED:
        _build_eager_call(name)
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
    return Comm(pg, facts.rank, facts.size, facts.backend, facts)


def _traced_comm(pg: ProcessGroup, group: Any) -> Comm:
    if functional_collectives() is None:  # this torch cannot trace collectives: eagerly
        ranks = get_process_group_ranks(pg)
        return TracedComm(None, pg.rank(), pg.size(), TRACED, group, ranks)
    rank, size, ranks, gloo = _traced_once(pg)
    return TracedComm(pg, rank, size, TRACED, group, list(ranks), gloo)


_MESH_MODULE = "torch.distributed.device_mesh"


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
    :data:`~distkit.dist.backends.traced.TRACED` (functional collectives, no bookkeeping).

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
                    return TracedComm(None, rank, size, TRACED, group, ranks)
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


def refused(fn: str, error: BaseException, group: Any) -> None:
    """The checks of collective ``fn`` refused this rank's arguments (``error``): tell
    the other ranks of ``group`` where they check the call (see
    :func:`distkit.dist.guard.watch.refused`), so that they raise too instead of pairing
    this call with this rank's next one."""
    if under_compile():  # a traced call: its group's ranks are not counted
        return
    try:
        comm = resolve(group, fn)  # the group the call resolved before its checks
    except Exception:  # the group itself was refused: nothing to tell
        return
    if comm.pg is not None and not comm.alone:
        _watch.refused(comm, fn, error, sys._getframe(1))


#: For a collective without a shortcut (the shortcuts take ``refused=refused``): the
#: arguments it refuses told to the other ranks
told = shortcut(None, refused=refused)
