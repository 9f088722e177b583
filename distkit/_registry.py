"""torch's registry of process groups, read without importing torch until it matters.

``current._default_pg`` is the default process group, or ``None``: the one question
"is this process distributed?" that every part of distkit asks, always through this
module attribute.

A process group can only exist once ``torch.distributed`` has been imported, so until
then the answer is no, and ``import distkit.dist; dist.get_rank()`` never pays for
importing torch (over a second). Until torch's distributed module is loaded,
:data:`current` is a small stand-in that checks ``sys.modules``; from then on it is
torch's own registry object, read directly (18 ns, against 146 ns for
``torch.distributed.is_initialized()``). Readers must look it up through the module
(``_registry.current``), never bind it to a name of their own, so they see the switch;
the compiled shortcuts (:mod:`distkit.dist.core.shortcut`) hold it in a closure cell
registered with :func:`watch`, which the switch updates.

A process that a launcher started as one rank of several (torchrun, srun, mpirun) but
that never created a process group would run every collective as a world of one rank:
each rank would silently train alone. So the shortcuts of collectives read the question
through a *guard* instead (:func:`guard`): until the first collective it is an object that
decides, once, from the environment; then it is :data:`current` itself (no launcher, or
``DISTKIT_INDEPENDENT=1``: nothing more to pay) or a trap that sends every collective
without a process group to :func:`distkit.dist._route.resolve`, which raises.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

_C10D = "torch.distributed.distributed_c10d"


class _BeforeTorch:
    """Stands in for torch's registry until ``torch.distributed`` is imported."""

    __slots__ = ()

    @property
    def _default_pg(self) -> Any:
        if _C10D not in sys.modules:
            return None
        return bind()._default_pg


#: In a fork's child: the process groups its parent held when it forked (read from
#: torch's registry as Python objects), and the pid of the rank it descends from (the
#: first process of the line that held them). Empty and ``None`` elsewhere.
inherited_groups: list[Any] = []
forked_from: Optional[int] = None


def inherited(pg: Any) -> bool:
    """Whether ``pg`` is a process group this process, a fork's child, inherited: it
    shares its parent's connections, and cannot take part in its parent's collectives."""
    return forked_from is not None and any(pg is held for held in inherited_groups)


def _after_fork_in_child() -> None:
    # registered when distkit is imported (before torch may be), Python objects only
    global forked_from
    world = getattr(sys.modules.get(_C10D), "_world", None)
    inherited_groups[:] = getattr(world, "pg_map", None) or ()
    if inherited_groups and forked_from is None:  # a grandchild names the rank, not the
        forked_from = os.getppid()  # child between


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_cells: list[Any] = []  # closure cells holding ``current`` (see watch)
_guarded: list[Any] = []  # the cells of collectives, holding the guard (see guard)

#: Set by a rank once it has a process group, to its pid: its children inherit it.
RANK_PID = "DISTKIT_RANK_PID"

#: Launched without a process group: what the launcher set (a phrase), ``""`` when
#: collectives may run as a world of one rank, ``None`` until the first one decides.
alone: Optional[str] = None

#: What a collective's shortcut reads as the default group when there is none but a
#: launcher started this process as one of several ranks: not ``None``, so the call
#: leaves the shortcut for the checked path, which raises.
LAUNCHED_WITHOUT_GROUP = object()


class _Undecided:
    """In the cells of collectives until the first collective without a group."""

    __slots__ = ()

    @property
    def _default_pg(self) -> Any:
        pg = current._default_pg
        if pg is not None:
            return pg
        return None if not decide() else LAUNCHED_WITHOUT_GROUP


class _Trap:
    """In the cells of collectives while a launched process has no group."""

    __slots__ = ()

    @property
    def _default_pg(self) -> Any:
        pg = current._default_pg
        return LAUNCHED_WITHOUT_GROUP if pg is None else pg


_UNDECIDED = _Undecided()
_TRAP = _Trap()


#: While a profile is open (:mod:`distkit.dist.profiling`), the collectives' cells hold the
#: trap even without a launcher, so that every call takes the checked path, where the
#: single-process backend records it (the trap raises only when :data:`alone` says so).
diverted = False


def guard() -> Any:
    """What the collectives' cells hold now (:data:`current` once nothing is trapped)."""
    if diverted:
        return _TRAP
    if alone is None:
        return _UNDECIDED
    return _TRAP if alone else current


def decide() -> str:
    """Decide, once, whether collectives without a process group are an error here.

    Returns:
        The launcher phrase when they are (see :func:`distkit.utils.environ.launched_as`),
        else ``""``.
    """
    global alone
    if alone is None:
        if _tracing():  # answered, not kept: the first eager call decides
            return probe_while_tracing()
        alone = probe()
        _retarget()
    return alone


def probe() -> str:
    """What :func:`decide` decides, read from the environment: the launcher phrase when
    collectives without a process group are an error in this process, else ``""``."""
    from distkit.utils.environ import launched_as  # torch-free

    independent = os.environ.get("DISTKIT_INDEPENDENT", "").strip().lower()
    allowed = independent in ("1", "true", "yes", "on")
    # a process a rank started (a subprocess, a DataLoader worker) inherits the
    # launcher's variables, but is no rank: the rank left its pid (see _board)
    parent = os.environ.get(RANK_PID)
    allowed = allowed or (parent is not None and parent != str(os.getpid()))
    return "" if allowed else (launched_as() or "")


#: :func:`probe` as ``torch.compile``'s tracer calls it: run once when the tracer meets
#: it, its answer a constant of the graph (see :func:`distkit._compat.run_at_trace_time`),
#: once torch._dynamo is loaded. Traced line by line instead, at every collective, the
#: environment lookups doubled the trace of a compiled step that holds the process's
#: first collectives (10 CPU-s against 5 for 394 calls on this project's machine).
probe_while_tracing = probe


def allow_alone() -> None:
    """Let collectives run as a world of one rank, launcher or not (``init_dist("none")``)."""
    global alone
    alone = ""
    _retarget()


def forget_alone() -> None:
    """Forget the decision (tests), so that the next collective decides again."""
    global alone
    alone = None
    _retarget()


def divert(on: bool) -> None:
    """Send every collective through the checked path (``on``), or stop (see :data:`diverted`)."""
    global diverted
    diverted = on
    _retarget()


def _retarget() -> None:
    target = guard()
    for cell in _guarded:
        cell.cell_contents = target


def _tracing() -> bool:
    """Whether ``torch.compile`` is tracing the caller. Then nothing here may write a
    closure cell: the compiler cannot follow a cell written through ``cell_contents`` that
    the code it traces reads (it fails with an internal ``AssertionError``), which a
    compiled step whose collectives were the process's first met. So while tracing,
    :func:`bind` and :func:`decide` answer without keeping the answer."""
    if "torch" not in sys.modules:  # no torch: nothing can be compiling
        return False
    from distkit._compat import is_compiling

    return is_compiling()


def bind() -> Any:
    """Point :data:`current` at torch's registry (importing torch.distributed if needed)."""
    global current
    # Imported here, not at the top: this module must stay importable without torch.
    from distkit._compat import torch_registry

    registry = torch_registry()
    if _tracing():  # read, not bound: the first eager call binds
        return registry
    current = registry
    for cell in _cells:
        cell.cell_contents = current
    _retarget()
    return current


def watch(cell: Any, collective: bool = False) -> None:
    """Keep the closure ``cell`` holding :data:`current`, now and after the switch.

    One attribute lookup fewer per call than ``_registry.current`` (a module attribute),
    for code where 20 ns count: the single-process shortcuts. A ``collective``'s cell
    holds the :func:`guard` instead, which is :data:`current` itself once decided.
    """
    if collective:
        cell.cell_contents = guard()
        _guarded.append(cell)
    else:
        cell.cell_contents = current
        _cells.append(cell)


#: ``current._default_pg`` is the default process group, or ``None``.
current: Any = _BeforeTorch()
