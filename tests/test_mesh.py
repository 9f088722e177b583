"""DeviceMesh dimensions as ``group=``: ``mesh["dp"]``, ``(mesh, "dp")``, ``(mesh, 0)``."""

from __future__ import annotations

import pytest
import torch
from conftest import world

import distkit.dist as dist


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _every_mesh_form_names_the_same_group():
    rank, _ = world()
    mesh = _mesh()
    dp, tp = rank // 2, rank % 2  # row-major: rank = 2 * dp + tp
    for forms, mine, members in (
        ((mesh["dp"], (mesh, "dp"), (mesh, 0)), dp, [tp, 2 + tp]),
        ((mesh["tp"], (mesh, "tp"), (mesh, 1)), tp, [2 * dp, 2 * dp + 1]),
    ):
        for group in forms:
            assert dist.get_rank(group=group) == mine
            assert dist.get_world_size(group=group) == 2
            assert dist.get_dist_info(group=group) == (mine, 2)
            assert dist.is_main_process(group=group) == (mine == 0)
            t = torch.tensor([float(rank)])
            assert dist.all_reduce(t, group=group) is t
            assert t.item() == sum(members)
            got = dist.all_gather(torch.tensor([rank]), group=group)
            assert [x.item() for x in got] == members
            assert dist.broadcast(torch.tensor([rank]), src=1, group=group).item() == members[1]
            assert dist.all_gather_object({"r": rank}, group=group) == [{"r": m} for m in members]
            dist.barrier(group=group)


def _bad_mesh_groups_fail_clearly():
    mesh = _mesh()
    with pytest.raises(TypeError, match=r"2-D DeviceMesh.*mesh\[\"dp\"\]"):
        dist.all_reduce(torch.ones(1), group=mesh)
    with pytest.raises(TypeError, match="2-D DeviceMesh"):
        dist.get_rank(group=mesh)
    with pytest.raises(ValueError, match="no dimension 'pp'"):
        dist.all_gather(torch.ones(1), group=(mesh, "pp"))
    with pytest.raises(ValueError, match="has 2 dimension"):
        dist.all_gather(torch.ones(1), group=(mesh, 2))
    with pytest.raises(TypeError, match="dimension name or index"):
        dist.all_gather(torch.ones(1), group=(mesh, 1.0))
    # a plain pair of ranks is still a rank list (its group is created on every rank)
    if dist.get_rank() < 2:
        assert dist.get_world_size(group=(0, 1)) == 2
    else:
        with pytest.raises(ValueError, match="not a member of group"):
            dist.get_world_size(group=(0, 1))


def _one_dimensional_mesh_is_a_group():
    from torch.distributed.device_mesh import init_device_mesh

    rank, size = world()
    mesh = init_device_mesh("cpu", (size,))
    assert dist.get_rank(group=mesh) == rank
    t = torch.tensor([rank + 1])
    assert dist.all_reduce(t, group=mesh).item() == 3
    assert dist.all_reduce(torch.tensor([rank + 1]), group=(mesh, 0)).item() == 3


def test_a_mesh_without_a_process_group_fails_clearly():
    # A mesh needs a process group; one that outlived its world (destroyed) is refused
    # with a ValueError that says so, the same as a destroyed ProcessGroup.
    from torch.distributed.device_mesh import DeviceMesh

    fake = DeviceMesh.__new__(DeviceMesh)
    with pytest.raises(ValueError, match="DeviceMesh, but no process group exists"):
        dist.all_reduce(torch.ones(1), group=fake)
    with pytest.raises(ValueError, match="DeviceMesh, but no process group exists"):
        dist.get_rank(group=(fake, "dp"))


def _dtensor_checks():
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.tensor import Shard, distribute_tensor
    except ImportError:  # torch < 2.5: the private home
        from torch.distributed._tensor import Shard, distribute_tensor

    rank, size = world()
    mesh = init_device_mesh("cpu", (size,))
    dt = distribute_tensor(torch.arange(2.0 * size), mesh, [Shard(0)])
    for call in (
        lambda: dist.all_reduce(dt),
        lambda: dist.all_gather(dt),
        lambda: dist.broadcast(dt),
        lambda: dist.reduce_scatter([dt] * size),
        lambda: dist.all_gather(dt, group=mesh),
    ):
        with pytest.raises(TypeError, match=r"is a DTensor.*to_local\(\).*full_tensor\(\)"):
            call()
    mine = {"w": dt, "rank": rank}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pickling a DTensor whole warns about its mesh
        got = dist.all_gather_object(mine)
        one = dist.broadcast_object(dt, src=size - 1)
    assert got[rank] is mine  # this rank's own entry is what it passed, as always
    for r, g in enumerate(got):
        if r != rank:  # the others' DTensors arrive as their local shards
            assert type(g["w"]) is torch.Tensor and g["rank"] == r
            assert g["w"].tolist() == [2.0 * r, 2.0 * r + 1]
    if rank == size - 1:
        assert one is dt
    else:
        assert type(one) is torch.Tensor and one.tolist() == [2.0 * size - 2, 2.0 * size - 1]


@pytest.fixture(scope="module")
def mesh_worlds():
    """Worlds of their own for this module's eager mesh checks, one per size, shared by
    them (their meshes' groups live as long as the world and stay out of the session's
    shared pools); stopped when the module's tests are done. Starting a world of four
    ranks costs seconds of CPU: one per module, not one per test."""
    from distkit.local.pool import RankPool

    pools: dict[int, RankPool] = {}

    def run(body, size: int) -> list:
        if size not in pools:
            pools[size] = RankPool(size, timeout=300, pg_timeout=300)
        return pools[size].run(body)

    yield run
    for pool in pools.values():
        pool.close()


def test_every_mesh_form_names_the_same_group(mesh_worlds):
    mesh_worlds(_every_mesh_form_names_the_same_group, 4)


def test_bad_mesh_groups_fail_clearly(mesh_worlds):
    mesh_worlds(_bad_mesh_groups_fail_clearly, 4)


def test_one_dimensional_mesh_is_a_group(mesh_worlds):
    mesh_worlds(_one_dimensional_mesh_is_a_group, 2)


@pytest.mark.parametrize("size", [1, 2])
def test_dtensors_are_refused_by_tensor_collectives_and_travel_as_shards_in_objects(
    size, mesh_worlds
):
    mesh_worlds(_dtensor_checks, size)
