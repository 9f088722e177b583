"""Rank and world information: cheap, and correct with or without a process group.

Torch-free at import: ``import distkit.dist; dist.get_rank()`` must not pay for
importing torch (see :mod:`distkit._registry`). A ``group`` argument other than ``None``
imports the rest (:mod:`distkit.dist._route`) on first use.
"""

from __future__ import annotations

import atexit
import functools
import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from distkit import _registry
from distkit.dist.core.shortcut import shortcut

if TYPE_CHECKING:
    from distkit._compat import ProcessGroup
    from distkit.dist.core.comm import Comm, GroupLike

F = TypeVar("F", bound=Callable[..., Any])

# Both held weakly: distkit never keeps a process group alive (see dist/_comm.py). The
# group itself lives in the group cache (or is the world), the owner in torch.
_local_group: Optional[weakref.ref] = None
_local_owner: Optional[weakref.ref] = None  # the default group it was created under


def _resolve(group: Any, fn: str) -> Comm:
    # imported here: it needs torch, which an explicit group means is loaded anyway
    from distkit.dist._route import resolve

    return resolve(group, fn, collective=False)


def is_distributed() -> bool:
    """Whether a default process group exists (``init_dist`` or torch's init ran).

    Examples:
        >>> import distkit.dist as dist
        >>> dist.is_distributed()
        False
    """
    return _registry.current._default_pg is not None


def get_default_group() -> Optional[ProcessGroup]:
    """The default process group, or ``None`` in a single process.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_default_group() is None
        True
    """
    return _registry.current._default_pg


@shortcut("0", world="pg.rank()", group=None)
def get_rank(group: GroupLike = None) -> int:
    """This process's rank within ``group``.

    Single process: returns 0.

    Args:
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).

    Returns:
        The rank, from 0 to the group size minus one.

    Raises:
        ValueError: This rank is not a member of ``group``.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_rank()
        0
    """
    return _resolve(group, "get_rank").rank


@shortcut("1", world="pg.size()", group=None)
def get_world_size(group: GroupLike = None) -> int:
    """Number of ranks in ``group``.

    Single process: returns 1.

    Args:
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).

    Returns:
        The group size.

    Raises:
        ValueError: This rank is not a member of ``group``.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_world_size()
        1
    """
    return _resolve(group, "get_world_size").size


@shortcut("(0, 1)", world="(pg.rank(), pg.size())", group=None)
def get_dist_info(group: GroupLike = None) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group``.

    Single process: returns ``(0, 1)``.

    Args:
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).

    Returns:
        This process's rank in ``group`` and the size of ``group``.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_dist_info()
        (0, 1)
    """
    comm = _resolve(group, "get_dist_info")
    return comm.rank, comm.size


def is_main_process(group: GroupLike = None) -> bool:
    """Whether this is rank 0 of ``group``.

    Single process: returns True.

    Args:
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).

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


@shortcut("None", collective=False, group=None)
def get_backend(group: GroupLike = None) -> Optional[str]:
    """Lower-case backend name of ``group`` (``gloo``, ``nccl``, ``cpu:gloo,cuda:nccl``...).

    Single process: returns ``None`` (there is no backend).

    Args:
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_backend() is None
        True
    """
    return _resolve(group, "get_backend").backend_name


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    return int(value) if value else None


def _owned_local_group() -> Any:
    if _local_group is not None and _local_owner is not None:
        if _local_owner() is _registry.current._default_pg:
            return _local_group()
    return None


def _local(alone: int, group_value: Callable[[Any], int], env_name: str, fn: str) -> int:
    """``alone`` in a single process, else from the local group or ``env_name``."""
    if not is_distributed():
        return alone
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
    return _local(0, lambda g: g.rank(), "LOCAL_RANK", "get_local_rank")


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
    return _local(1, lambda g: g.size(), "LOCAL_WORLD_SIZE", "get_local_size")


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
    world = get_default_group()
    if world is None:
        return
    from distkit.utils.groups import get_group  # needs torch, loaded with the world

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
    if not is_distributed():
        return None
    group = _owned_local_group()
    if group is None:
        raise RuntimeError(
            "get_local_group: no local group; call init_local_group(node_rank, "
            "ranks_per_node) on every rank first"
        )
    return group


def forget_local_group() -> None:
    """Drop the local group (:func:`~distkit.dist.destroy_dist` and exit call this)."""
    global _local_group, _local_owner
    _local_group = None
    _local_owner = None


atexit.register(forget_local_group)  # never keep a group alive into interpreter shutdown
