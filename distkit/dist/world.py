"""Rank and world information: cheap, and correct with or without a process group."""

from __future__ import annotations

import atexit
import functools
import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

# Torch-free at import: ``import distkit.dist; dist.get_rank()`` must not pay for
# importing torch (see distkit/_world.py). Group arguments import the rest on demand.
from distkit import _world

if TYPE_CHECKING:
    from distkit._compat import ProcessGroup
    from distkit.dist._comm import GroupLike


def resolve(group: Any, fn: str) -> Any:
    from distkit.dist._comm import resolve as _resolve

    return _resolve(group, fn)

__all__ = [
    "get_backend",
    "get_default_group",
    "get_dist_info",
    "get_local_group",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "init_local_group",
    "is_distributed",
    "is_main_process",
    "master_only",
]

F = TypeVar("F", bound=Callable[..., Any])

# Both held weakly: distkit never keeps a process group alive (see dist/_comm.py). The
# group itself lives in the group cache (or is the world), the owner in torch.
_local_group: Optional[weakref.ref] = None
_local_owner: Optional[weakref.ref] = None  # the default group it was created under


def is_distributed() -> bool:
    """Whether a default process group exists (``init_dist`` or torch's init ran).

    Examples:
        >>> import distkit.dist as dist
        >>> dist.is_distributed()
        False
    """
    return _world.WORLD._default_pg is not None


def get_default_group() -> Optional[ProcessGroup]:
    """The default process group, or ``None`` in a single process.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_default_group() is None
        True
    """
    return _world.WORLD._default_pg


def get_rank(group: GroupLike = None) -> int:
    """This process's rank within ``group``.

    Single process: returns 0.

    Args:
        group: ``None`` (default group), a ``ProcessGroup`` or a list of global ranks.

    Returns:
        The rank, from 0 to the group size minus one.

    Raises:
        ValueError: This rank is not a member of ``group``.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_rank()
        0
    """
    if group is None:
        pg = _world.WORLD._default_pg
        return 0 if pg is None else pg.rank()
    return resolve(group, "get_rank").rank


def get_world_size(group: GroupLike = None) -> int:
    """Number of ranks in ``group``.

    Single process: returns 1.

    Args:
        group: ``None`` (default group), a ``ProcessGroup`` or a list of global ranks.

    Returns:
        The group size.

    Raises:
        ValueError: This rank is not a member of ``group``.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_world_size()
        1
    """
    if group is None:
        pg = _world.WORLD._default_pg
        return 1 if pg is None else pg.size()
    return resolve(group, "get_world_size").size


def get_dist_info(group: GroupLike = None) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group``.

    Single process: returns ``(0, 1)``.

    Args:
        group: ``None`` (default group), a ``ProcessGroup`` or a list of global ranks.

    Returns:
        This process's rank in ``group`` and the size of ``group``.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_dist_info()
        (0, 1)
    """
    if group is None:
        pg = _world.WORLD._default_pg
        return (0, 1) if pg is None else (pg.rank(), pg.size())
    comm = resolve(group, "get_dist_info")
    return comm.rank, comm.size


def is_main_process(group: GroupLike = None) -> bool:
    """Whether this is rank 0 of ``group``.

    Single process: returns True.

    Args:
        group: ``None`` (default group), a ``ProcessGroup`` or a list of global ranks.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.is_main_process()
        True
    """
    return get_rank(group) == 0


def master_only(func: F) -> F:
    """Decorate ``func`` to run only on the main process (global rank 0).

    The other ranks skip the call and get ``None``. Not a collective: do not call
    collectives inside ``func``, the other ranks would not join them.

    Args:
        func: The function to guard.

    Examples:
        >>> import distkit.dist as dist
        >>> @dist.master_only
        ... def save(path):
        ...     return f"saved {path}"
        >>> save("ckpt.pth")
        'saved ckpt.pth'
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if get_rank() == 0:
            return func(*args, **kwargs)
        return None

    return wrapper  # type: ignore[return-value]


def get_backend(group: GroupLike = None) -> Optional[str]:
    """Lower-case backend name of ``group`` (``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``...).

    Single process: returns ``None`` (there is no backend).

    Args:
        group: ``None`` (default group), a ``ProcessGroup`` or a list of global ranks.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_backend() is None
        True
    """
    if group is None and _world.WORLD._default_pg is None:
        return None
    return resolve(group, "get_backend").backend


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None  # type: ignore[arg-type]


def _owned_local_group() -> Any:
    if _local_group is not None and _local_owner is not None:
        if _local_owner() is _world.WORLD._default_pg:
            return _local_group()
    return None


def _local(group_value: Callable[[Any], int], env_name: str, fn: str) -> int:
    group = _owned_local_group()
    if group is not None:
        return group_value(group)
    value = _env_int(env_name)
    if value is not None:
        return value
    raise RuntimeError(
        f"{fn}: {env_name} is not set and no local group exists. Start with torchrun "
        "(or init_dist, which sets it for slurm and mpi), or call "
        "init_local_group(node_rank, ranks_per_node) on every rank"
    )


def get_local_rank() -> int:
    """This process's rank among the processes of its machine.

    Read from ``LOCAL_RANK`` (torchrun sets it; :func:`init_dist` sets it for slurm and
    mpi), or from the group made by :func:`init_local_group`.
    Single process: returns 0.

    Raises:
        RuntimeError: Distributed, but neither source is available.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_local_rank()
        0
    """
    if _world.WORLD._default_pg is None:
        return 0
    return _local(lambda g: g.rank(), "LOCAL_RANK", "get_local_rank")


def get_local_size() -> int:
    """Number of processes on this machine (``LOCAL_WORLD_SIZE`` or the local group).

    Single process: returns 1.

    Raises:
        RuntimeError: Distributed, but neither source is available.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_local_size()
        1
    """
    if _world.WORLD._default_pg is None:
        return 1
    return _local(lambda g: g.size(), "LOCAL_WORLD_SIZE", "get_local_size")


def init_local_group(node_rank: int, num_gpus_per_node: int) -> None:
    """Create the group of the ranks on this machine (mmengine compatible).

    Collective: every rank must call this. Ranks are assumed to be numbered machine by
    machine: machine ``node_rank`` holds ranks ``node_rank * num_gpus_per_node`` to
    ``(node_rank + 1) * num_gpus_per_node - 1``.
    Single process: does nothing.

    Args:
        node_rank: Index of this machine.
        num_gpus_per_node: Ranks per machine.
    """
    global _local_group, _local_owner
    world = _world.WORLD._default_pg
    if world is None:
        return
    from distkit.utils.groups import get_group

    groups = {}
    for node in range(world.size() // num_gpus_per_node):
        ranks = range(node * num_gpus_per_node, (node + 1) * num_gpus_per_node)
        groups[node] = get_group(ranks)
    _local_group = weakref.ref(groups[node_rank])
    _local_owner = weakref.ref(world)


def get_local_group() -> Optional[ProcessGroup]:
    """The group made by :func:`init_local_group`; ``None`` in a single process.

    Raises:
        RuntimeError: Distributed, but :func:`init_local_group` was not called.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_local_group() is None
        True
    """
    if _world.WORLD._default_pg is None:
        return None
    group = _owned_local_group()
    if group is None:
        raise RuntimeError(
            "get_local_group: no local group; call init_local_group(node_rank, "
            "ranks_per_node) on every rank first"
        )
    return group


def _forget_local_group() -> None:
    global _local_group, _local_owner
    _local_group = None
    _local_owner = None


atexit.register(_forget_local_group)  # never keep a group alive into interpreter shutdown
