"""Rank, world and device helpers under ``mmengine.dist.utils``'s path, for code that
imports from it (``from distkit.dist.utils import get_dist_info``).

Prefer ``import distkit.dist as dist``; distkit's own utilities are :mod:`distkit.utils`.
"""

from distkit.dist.init import infer_launcher, init_dist
from distkit.dist.tensor import barrier
from distkit.dist.world import (
    get_backend,
    get_default_group,
    get_dist_info,
    get_local_group,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    init_local_group,
    is_distributed,
    is_main_process,
    master_only,
)
from distkit.utils.device import cast_data_device, get_comm_device, get_data_device

__all__ = [
    "barrier",
    "cast_data_device",
    "get_backend",
    "get_comm_device",
    "get_data_device",
    "get_default_group",
    "get_dist_info",
    "get_local_group",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "infer_launcher",
    "init_dist",
    "init_local_group",
    "is_distributed",
    "is_main_process",
    "master_only",
]
