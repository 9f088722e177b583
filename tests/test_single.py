"""The single-process fast path returns what the general path returns, and follows torch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as td

import distkit.dist as dist


def test_fast_path_equals_general_path():
    # group=[0] takes the general path (resolve, checks, single backend)
    t = torch.arange(3)
    assert dist.all_reduce(t) is t and dist.all_reduce(t, group=[0]) is t
    assert dist.all_gather(t)[0] is t and dist.all_gather(t, group=[0])[0] is t
    assert dist.broadcast(t) is t and dist.broadcast(t, group=[0]) is t
    assert dist.all_gather_object(3) == dist.all_gather_object(3, group=[0]) == [3]
    assert dist.get_rank() == dist.get_rank([0]) == 0
    assert dist.get_world_size() == dist.get_world_size([0]) == 1
    assert dist.get_dist_info() == dist.get_dist_info([0]) == (0, 1)
    assert dist.barrier() is None and dist.barrier([0]) is None


def test_fast_path_still_checks_arguments():
    with pytest.raises(TypeError, match=r"all_reduce: data must be a torch\.Tensor"):
        dist.all_reduce([1.0])
    with pytest.raises(TypeError, match=r"all_gather: data must be a torch\.Tensor"):
        dist.all_gather(None)
    with pytest.raises(ValueError, match="broadcast: src=1 is out of range"):
        dist.broadcast(torch.ones(1), src=1)
    with pytest.raises(TypeError, match="cannot be pickled"):
        dist.all_gather_object(lambda: 0)
    with pytest.raises(TypeError, match=r"data\['fn'\] \(function\) cannot be pickled"):
        dist.all_gather_object({"loss": 0.5, "fn": lambda: 0})
    metrics = {"loss": 0.5, 1: None}
    assert dist.all_gather_object(metrics)[0] is metrics


def test_single_process_follows_torch_init_and_destroy(tmp_path):
    assert not dist.is_distributed()
    td.init_process_group(
        "gloo", store=td.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        assert dist.is_distributed() and dist.get_backend() == "gloo"
        t = torch.ones(2)
        assert dist.all_reduce(t) is t and dist.all_gather(t)[0] is t
        assert dist.all_gather_object({"a": 1}) == [{"a": 1}]
    finally:
        dist.destroy_dist()
    assert not dist.is_distributed() and dist.get_backend() is None


def test_init_dist_none_and_auto_without_launcher(monkeypatch):
    for name in (
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_PROCID",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
    ):
        monkeypatch.delenv(name, raising=False)
    assert dist.init_dist() == (0, 1) and not dist.is_distributed()
    with pytest.raises(ValueError, match="launcher must be one of"):
        dist.init_dist("kubernetes")
    with pytest.raises(ValueError, match="init_backend='deepspeed' is not supported"):
        dist.init_dist("none", init_backend="deepspeed")


def test_distkit_never_keeps_a_destroyed_group_alive(tmp_path):
    # A process group that outlives destroy_process_group is finalized at interpreter exit,
    # where gloo aborts the process (pytorch#179291): distkit must hold none.
    import gc
    import weakref

    td.init_process_group(
        "gloo", store=td.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        world = weakref.ref(dist.get_default_group())
        dist.all_reduce(torch.ones(1))
        dist.all_gather_object({"x": torch.ones(2)})
        dist.get_comm_device()
        dist.init_local_group(0, 1)
        assert dist.get_local_group() is not None
    finally:
        td.destroy_process_group()  # torch's own teardown, not destroy_dist
    gc.collect()
    assert world() is None, gc.get_referrers(world()) if world() else None
    dist.destroy_dist()  # forgets the (now dead) local group
