"""Code as a user writes it: type-checked with mypy by tests/test_types.py, never run.

Each ``assert_type`` states what a user's type checker must infer from distkit's
annotations (``py.typed`` is shipped, so these are the types users see).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as td
from torch import Tensor
from typing_extensions import assert_type

import distkit
import distkit.dist as dist
from distkit.utils import get_cpu_group, get_group

t = torch.ones(2)

# blocking calls return their result; async_op=True returns a handle of it
assert_type(dist.all_reduce(t), Tensor)
assert_type(dist.all_reduce(t, op="mean", async_op=False), Tensor)
assert_type(dist.all_reduce(t, async_op=True), dist.Handle[Tensor])
assert_type(dist.all_reduce(t, async_op=True).wait(), Tensor)
assert_type(dist.all_reduce(t, op=dist.ReduceOp.MAX), Tensor)
assert_type(dist.all_gather(t), list[Tensor])
assert_type(dist.all_gather(t, async_op=True).wait(), list[Tensor])
assert_type(dist.all_gather(t, grad=True), list[Tensor])
assert_type(dist.all_reduce(t, grad=True), Tensor)
assert_type(dist.reduce_scatter(t, op="mean", grad=True), Tensor)
assert_type(dist.gather(t, dst=0), list[Tensor])
assert_type(dist.broadcast(t, src=0, async_op=True), dist.Handle[Tensor])
assert_type(dist.reduce(t, dst=0, op="max"), Tensor)
assert_type(dist.reduce_scatter([t, t]), Tensor)
assert_type(dist.all_to_all([t, t], async_op=True).wait(), list[Tensor])
assert_type(dist.all_to_all_single(t, input_split_sizes=[1, 1]), Tensor)
assert_type(dist.scatter([t, t] if dist.get_rank() == 0 else None), Tensor)
assert_type(dist.barrier(), None)


def flag_from_config(cfg: dict[str, Any]) -> bool:
    return bool(cfg.get("async"))


# a flag only known at run time: the result or a handle
maybe = dist.all_reduce(t, async_op=flag_from_config({}))
assert_type(maybe, Tensor | dist.Handle[Tensor])

# groups: torch's own process groups, rank lists, distkit's cache
pg = td.new_group([0, 1])
assert_type(dist.all_reduce(t, group=pg), Tensor)
assert_type(dist.all_gather(t, group=[0, 1]), list[Tensor])
assert_type(dist.get_rank(group=range(2)), int)
assert_type(get_group([0, 1]), Optional[td.ProcessGroup])
assert_type(get_cpu_group(pg), Optional[td.ProcessGroup])
assert_type(dist.get_default_group(), Optional[td.ProcessGroup])
assert_type(dist.get_dist_info(), tuple[int, int])

# object collectives
assert_type(dist.all_gather_object({"loss": 0.5}), list[Any])
assert_type(dist.gather_object("x", dst=0), Optional[list[Any]])
assert_type(dist.broadcast_object_list(["a", 1]), list[Any])
metrics = dist.all_reduce_dict({"loss": t}, op="mean")
assert_type(metrics["loss"], Tensor)
assert_type(dist.collect_results([1, 2], 2), Optional[list[Any]])
assert_type(dist.init_dist("none"), tuple[int, int])

# the top-level helpers
assert_type(distkit.launch(dist.get_rank, 2), list[Any])
distkit.print("hello", ranks="all")
assert_type(distkit.dist.get_world_size(), int)
