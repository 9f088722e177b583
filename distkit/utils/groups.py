"""Process groups by rank list, cached per world, and a gloo twin for CPU traffic.

Creating a process group is itself a collective: every rank of the default group must
call :func:`get_group` (or the first collective that names the rank list) with the same
arguments and in the same order, members of the new group or not. That is torch's
``new_group`` contract; distkit only remembers the result.

The cache belongs to one world. It is cleared by :func:`distkit.dist.destroy_dist`, and
also, lazily, whenever the default process group it was filled under is no longer the
current one (a user called ``torch.distributed.destroy_process_group`` and started a new
world), so a group from a destroyed world is never handed out.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, Callable, Optional, Union, cast

import torch.distributed as td
from torch.distributed.constants import default_pg_timeout

from distkit import _registry
from distkit._compat import ProcessGroup, backend_config, backend_name, group_timeout
from distkit._compat import destroy as destroy_groups

_Key = tuple[tuple[int, ...], str, Optional[float]]

#: Checks with every rank of the world, before a group is created, that each creates the
#: same one (``agree(ranks, backend, seconds)``, raises ``ValueError`` on every rank if
#: not). Set by distkit.dist's guard (:mod:`distkit.dist.guard.creation`); ``None`` until
#: distkit.dist is imported.
agree: Optional[Callable[[tuple[int, ...], str, Optional[float]], None]] = None

_groups: dict[_Key, Any] = {}
# the groups of get_group(ranks) with the default backend and timeout, by sorted ranks:
# what torch.compile's tracer looks up (cached_group) without creating anything
_by_ranks: dict[tuple[int, ...], Any] = {}
# gloo twin of a group whose backend cannot move CPU tensors (nccl, hccl, ...)
_cpu_twins: dict[Any, Any] = {}
# the default process group the cache was filled under, held weakly: a group distkit
# keeps alive past torch's destroy_process_group aborts the process at exit (see _comm)
_owner: Optional[weakref.ref] = None


def _cache_for(world: Any) -> dict[_Key, Any]:
    global _owner
    if _owner is None or _owner() is not world:
        _groups.clear()
        _by_ranks.clear()
        _cpu_twins.clear()
        _owner = weakref.ref(world)
    return _groups


def _normalize_ranks(ranks: Iterable[int], world_size: int) -> tuple[int, ...]:
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
        raise TypeError(
            f"get_group: ranks must be a list of global ranks, got {type(ranks).__name__}"
        )
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int):
            raise TypeError(f"get_group: ranks must hold ints, got {r!r} ({type(r).__name__})")
        if not 0 <= r < world_size:
            raise ValueError(
                f"get_group: rank {r} is out of range for a world of size {world_size} "
                f"(valid: 0..{world_size - 1})"
            )
        out.append(r)
    if not out:
        raise ValueError("get_group: ranks must not be empty")
    if len(set(out)) != len(out):
        raise ValueError(f"get_group: ranks must not repeat, got {out}")
    return tuple(sorted(out))


def cached_group(ranks: Iterable[int], world: Any) -> Any:
    """The group ``get_group(ranks)`` returns, if it exists already, else ``None``.

    Creates nothing, touches no weak reference: torch.compile's tracer runs this (a
    rank list it finds here is a constant of the graph). ``world`` is the default group.
    """
    key_ranks = _normalize_ranks(ranks, world.size())
    if key_ranks == tuple(range(world.size())):
        return world
    if _owner is None or _owner() is not world:
        return None
    return _by_ranks.get(key_ranks)


def supports_cpu(config: str) -> bool:
    """Whether a backend config (``gloo``, ``cpu:gloo,cuda:nccl``, ...) moves CPU tensors."""
    if ":" in config:
        return any(part.split(":")[0].strip() == "cpu" for part in config.split(","))
    return config in ("gloo", "mpi", "ucc", "fake")


def forked_error() -> tuple[str, str]:
    """What is wrong, and what to do, when a process a rank forked calls a collective or
    creates a group on what it inherited (see :func:`distkit._registry.inherited`)."""
    rank = ""
    try:
        rank = f"rank {td.get_rank()} "
    except Exception:  # the default group is gone: the rank is named by its pid alone
        pass
    return (
        f"this process was forked from {rank}(pid {_registry.forked_from}) after its "
        "process group was created, and a forked child cannot take part in its parent's "
        "collectives: the group's connections are the parent's",
        "Run collectives in the rank itself and hand data back to it (a DataLoader worker "
        "returns its batch, a multiprocessing child puts its result in a queue); a child "
        "that needs a world of its own is started with 'spawn' or 'forkserver' and calls "
        "init_dist",
    )


def get_group(
    ranks: Iterable[int],
    backend: Optional[str] = None,
    *,
    timeout: Union[timedelta, float, None] = None,
) -> Optional[ProcessGroup]:
    """Return the process group of ``ranks``, creating it on first use.

    Collective: the first call for a given ``(ranks, backend)`` creates the group, and
    every rank of the default group must make it, in the same order, members or not.
    Later calls return the cached group without communicating.
    Single process: ``ranks`` must be ``[0]``; returns ``None`` (the implicit world of
    one rank, which every collective accepts as ``group``).

    Args:
        ranks: Global ranks of the members, in any order (group ranks follow sorted
            order, as in ``torch.distributed.new_group``).
        backend: Backend of the new group; ``None`` uses the default group's.
        timeout: Timeout of the new group's collectives, in seconds or a timedelta;
            ``None`` gives it the default group's timeout (torch's own ``new_group``
            would take its 30-minute default instead).

    Returns:
        The cached group (one per ranks, backend and timeout). The whole world with the
        default backend and no timeout of its own is the default group itself. On a rank
        outside ``ranks`` this is torch's non-member marker, which collectives reject with
        a clear error.

    Raises:
        TypeError: ``ranks`` is not a list of ints.
        ValueError: A rank is out of range or repeated, or ``ranks`` is empty.

    Examples:
        >>> from distkit.utils import get_group
        >>> get_group([0]) is None
        True
    """
    world = _registry.current._default_pg
    if world is None:
        _normalize_ranks(ranks, 1)
        return None
    if _registry.inherited(world):  # creating a group meets on the parent's connections
        what, fix = forked_error()
        raise RuntimeError(f"get_group: {what} (on rank {world.rank()} of {world.size()}). {fix}")
    default_backend = backend_name(world)
    name = (backend or default_backend).lower()
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    key_ranks = _normalize_ranks(ranks, world.size())
    if key_ranks == tuple(range(world.size())) and name == default_backend and seconds is None:
        return world  # a timeout of its own needs a group of its own, even for everyone
    cache = _cache_for(world)
    key = (key_ranks, name, None if seconds is None else float(seconds))
    pg = cache.get(key)
    if pg is None:
        if agree is not None:  # every rank creates this very group (else: ValueError)
            agree(key_ranks, name, None if seconds is None else float(seconds))
        if seconds is not None:
            timeout = timedelta(seconds=seconds)
        else:  # the world's timeout, so a hang on a sub-group is reported as soon
            timeout = group_timeout(world) or default_pg_timeout
        pg = td.new_group(list(key_ranks), backend=backend, timeout=timeout)
        cache[key] = pg
        if name == default_backend and seconds is None:
            _by_ranks[key_ranks] = pg
        if isinstance(pg, ProcessGroup) and not supports_cpu(backend_config(pg)):
            # Object collectives want a CPU channel; build it now, while every rank is
            # here anyway, rather than later inside a collective that only members call.
            _cpu_twins[pg] = get_group(key_ranks, "gloo", timeout=timeout)
    # on a rank outside ``ranks`` this is torch's non-member marker, which every
    # collective refuses with a clear ValueError; typed as what members get
    return cast(Optional[ProcessGroup], pg)


def get_cpu_group(group: Any = None) -> Optional[ProcessGroup]:
    """Return a group over the same ranks as ``group`` that moves CPU tensors.

    For gloo, mpi and mixed ``cpu:gloo,cuda:nccl`` groups this is ``group`` itself. For
    nccl-like backends it is a cached gloo group over the same ranks: the default
    group's twin is created on first use (collective, like :func:`get_group`), a
    sub-group's when :func:`get_group` created it. Object collectives send their
    pickled skeleton through it, so they never need a GPU for plain Python objects.

    Collective: only when the gloo twin of the default group does not exist yet.
    Single process: returns ``None``.

    Args:
        group: ``None`` (default group), a ``ProcessGroup``, or a list of global ranks.

    Returns:
        The group to use for CPU tensors, or ``None`` where a sub-group created
        outside distkit has no gloo twin (callers then fall back to ``group``). On a
        rank outside a rank list, torch's non-member marker, as :func:`get_group`.

    Examples:
        >>> from distkit.utils import get_cpu_group
        >>> get_cpu_group() is None
        True
    """
    world = _registry.current._default_pg
    if world is None:
        return None
    if group is None:
        group = world
    elif not isinstance(group, ProcessGroup):
        group = get_group(group)
        if not isinstance(group, ProcessGroup):  # torch's non-member marker, as get_group
            return cast(Optional[ProcessGroup], group)  # gives (collectives refuse it)
    if supports_cpu(backend_config(group)):
        return group
    _cache_for(world)
    twin = _cpu_twins.get(group)
    if twin is None and group is world:
        twin = get_group(range(world.size()), "gloo")
        _cpu_twins[group] = twin
    return twin


def group_ranks(group: Any) -> list[int]:
    """Global ranks of ``group``'s members, in group-rank order."""
    return list(td.get_process_group_ranks(group))


def clear_group_cache(destroy: bool = False) -> None:
    """Forget every cached group; with ``destroy=True`` also destroy them in torch.

    :func:`distkit.dist.destroy_dist` calls this. Destroying is collective for some
    backends, so with ``destroy=True`` every rank must call it.

    Args:
        destroy: Also destroy the cached groups in torch (not the default group).
    """
    global _owner
    world = _registry.current._default_pg
    doomed = [
        pg
        for pg in _groups.values()
        if destroy and world is not None and isinstance(pg, ProcessGroup) and pg is not world
    ]
    _groups.clear()
    _by_ranks.clear()
    _cpu_twins.clear()
    _owner = None
    del world
    if doomed:
        destroy_groups(doomed)  # empties the list: the last references go inside


# Drop distkit's references before the interpreter finalizes, even when the user tore
# the world down with torch's own destroy_process_group and never called destroy_dist.
atexit.register(clear_group_cache)
