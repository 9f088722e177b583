"""torch.distributed collectives with return values, and a no-op single process.

Use it as ``import distkit.dist as dist``. Every name of ``mmengine.dist`` is here with a
compatible signature.

This module only re-exports, lazily: a submodule is imported the first time one of its
names is used. ``import distkit.dist; dist.get_rank()`` therefore never imports torch
(over a second) when no process group can exist yet; see :mod:`distkit._world`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distkit import _lazy

#: Public name -> the module that defines it.
_EXPORTS = {
    "CollectiveMismatchError": "distkit.dist._watch",
    "CollectiveTimeoutError": "distkit.dist._watch",
    "GroupLike": "distkit.dist._comm",
    "Handle": "distkit.dist._handle",
    "ReduceOp": "distkit._compat",
    "UnsafeObjectError": "distkit.dist._serial",
    "all_gather": "distkit.dist.tensor",
    "all_gather_object": "distkit.dist.objects",
    "all_reduce": "distkit.dist.tensor",
    "all_reduce_dict": "distkit.dist.helpers",
    "all_reduce_params": "distkit.dist.helpers",
    "all_to_all": "distkit.dist.tensor",
    "all_to_all_object": "distkit.dist.objects",
    "all_to_all_single": "distkit.dist.tensor",
    "barrier": "distkit.dist.tensor",
    "broadcast": "distkit.dist.tensor",
    "broadcast_object": "distkit.dist.objects",
    "broadcast_object_list": "distkit.dist.objects",
    "cast_data_device": "distkit.utils.device",
    "collect_results": "distkit.dist.evaluation",
    "collect_results_cpu": "distkit.dist.evaluation",
    "collect_results_gpu": "distkit.dist.evaluation",
    "default_backend": "distkit.dist.init",
    "destroy_dist": "distkit.dist.init",
    "gather": "distkit.dist.tensor",
    "gather_object": "distkit.dist.objects",
    "get_backend": "distkit.dist.world",
    "get_comm_device": "distkit.utils.device",
    "get_data_device": "distkit.utils.device",
    "get_debug": "distkit.dist._watch",
    "get_default_group": "distkit.dist.world",
    "get_dist_info": "distkit.dist.world",
    "get_local_group": "distkit.dist.world",
    "get_local_rank": "distkit.dist.world",
    "get_local_size": "distkit.dist.world",
    "get_rank": "distkit.dist.world",
    "get_serializer": "distkit.dist._serial",
    "get_world_size": "distkit.dist.world",
    "infer_launcher": "distkit.dist.init",
    "init_dist": "distkit.dist.init",
    "init_local_group": "distkit.dist.world",
    "is_distributed": "distkit.dist.world",
    "is_main_process": "distkit.dist.world",
    "master_only": "distkit.dist.world",
    "reduce": "distkit.dist.tensor",
    "reduce_scatter": "distkit.dist.tensor",
    "scatter": "distkit.dist.tensor",
    "scatter_object_list": "distkit.dist.objects",
    "set_debug": "distkit.dist._watch",
    "set_serializer": "distkit.dist._serial",
    "sync_random_seed": "distkit.dist.helpers",
}

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
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
    "get_debug",
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
    "set_debug",
    "set_serializer",
    "sync_random_seed",
]


__getattr__, __dir__ = _lazy.attach(__name__, _EXPORTS, torch_free={"distkit.dist.world"})


if TYPE_CHECKING:
    from distkit.dist._watch import (
        CollectiveMismatchError,
        CollectiveTimeoutError,
        get_debug,
        set_debug,
    )
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
