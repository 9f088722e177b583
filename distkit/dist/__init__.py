"""torch.distributed collectives with return values, and a no-op single process.

Use it as ``import distkit.dist as dist``. Every name of ``mmengine.dist`` is here with a
compatible signature. This module only re-exports; see the submodules for the code.
"""

from distkit._compat import ReduceOp
from distkit.dist._comm import GroupLike
from distkit.dist._handle import Handle
from distkit.dist._serial import UnsafeObjectError, get_serializer, set_serializer
from distkit.dist.evaluation import collect_results, collect_results_cpu, collect_results_gpu
from distkit.dist.helpers import all_reduce_dict, all_reduce_params, sync_random_seed
from distkit.dist.init import default_backend, destroy_dist, infer_launcher, init_dist
from distkit.dist.objects import (
    all_gather_object,
    all_to_all_object,
    broadcast_object,
    broadcast_object_list,
    gather_object,
    scatter_object_list,
)
from distkit.dist.tensor import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
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
    "GroupLike",
    "Handle",
    "ReduceOp",
    "UnsafeObjectError",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_reduce_dict",
    "all_reduce_params",
    "all_to_all",
    "all_to_all_object",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_object_list",
    "cast_data_device",
    "collect_results",
    "collect_results_cpu",
    "collect_results_gpu",
    "default_backend",
    "destroy_dist",
    "gather",
    "gather_object",
    "get_backend",
    "get_comm_device",
    "get_data_device",
    "get_default_group",
    "get_dist_info",
    "get_local_group",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_serializer",
    "get_world_size",
    "infer_launcher",
    "init_dist",
    "init_local_group",
    "is_distributed",
    "is_main_process",
    "master_only",
    "reduce",
    "reduce_scatter",
    "scatter",
    "scatter_object_list",
    "set_serializer",
    "sync_random_seed",
]
