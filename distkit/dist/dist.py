"""The collectives under ``mmengine.dist.dist``'s path, for code that imports from it.

``from mmengine.dist.dist import sync_random_seed`` becomes
``from distkit.dist.dist import sync_random_seed``. Prefer ``import distkit.dist as dist``.
"""

from distkit.dist.evaluation import collect_results, collect_results_cpu, collect_results_gpu
from distkit.dist.helpers import all_reduce_dict, all_reduce_params, sync_random_seed
from distkit.dist.objects import all_gather_object, broadcast_object_list, gather_object
from distkit.dist.tensor import all_gather, all_reduce, broadcast, gather

__all__ = [
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_reduce_dict",
    "all_reduce_params",
    "broadcast",
    "broadcast_object_list",
    "collect_results",
    "collect_results_cpu",
    "collect_results_gpu",
    "gather",
    "gather_object",
    "sync_random_seed",
]
