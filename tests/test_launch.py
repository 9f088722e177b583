"""Launcher detection and SLURM/MPI environment parsing (no cluster needed)."""

from __future__ import annotations

import pytest

from distkit.utils.environ import (
    detect_launcher,
    expand_nodelist,
    launcher_env,
    parse_tasks_per_node,
)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
        ("node[01-03,7],gpu5", ["node01", "node02", "node03", "node7", "gpu5"]),
        ("a1,b[2-3]", ["a1", "b2", "b3"]),
        ("single", ["single"]),
        ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
        ("host-[098-101]", ["host-098", "host-099", "host-100", "host-101"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_parse_tasks_per_node():
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="cannot parse"):
        parse_tasks_per_node("two")


TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "1234",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
}
SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_NODELIST": "gpu[07-10]",
    "SLURM_TASKS_PER_NODE": "2(x4)",
    "SLURM_NODEID": "2",
}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "3",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}


@pytest.mark.parametrize(
    ("env", "launcher"),
    [
        ({}, "none"),
        (TORCHRUN, "pytorch"),
        (SLURM, "slurm"),
        ({**SLURM, **TORCHRUN}, "pytorch"),  # torchrun inside an allocation
        ({k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}, "none"),  # batch script
        ({**SLURM, "SLURM_NTASKS": "1"}, "none"),
        (OMPI, "mpi"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "mpi"),
        ({**OMPI, "OMPI_COMM_WORLD_SIZE": "1"}, "none"),
    ],
)
def test_detect_launcher(env, launcher):
    name, reason = detect_launcher(env)
    assert name == launcher and reason


def test_launcher_env_slurm():
    env = launcher_env("slurm", SLURM)
    assert env == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "gpu07",
        "MASTER_PORT": "29500",
    }
    assert launcher_env("slurm", {**SLURM, "MASTER_PORT": "4000"})["MASTER_PORT"] == "4000"
    assert launcher_env("slurm", SLURM, port=4100)["MASTER_PORT"] == "4100"


def test_launcher_env_mpi_and_pytorch():
    env = launcher_env("mpi", OMPI)
    assert env["RANK"] == "3" and env["MASTER_ADDR"] == "127.0.0.1"  # one node: loopback
    multi = {**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(RuntimeError, match="spans several nodes and MASTER_ADDR is not set"):
        launcher_env("mpi", multi)
    assert launcher_env("mpi", {**multi, "MASTER_ADDR": "h1"})["MASTER_ADDR"] == "h1"
    assert launcher_env("pytorch", TORCHRUN)["LOCAL_WORLD_SIZE"] == "2"


def test_launcher_env_missing_variables():
    with pytest.raises(RuntimeError, match="SLURM_LOCALID"):
        launcher_env("slurm", {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    with pytest.raises(RuntimeError, match="RANK"):
        launcher_env("pytorch", {})
    with pytest.raises(ValueError, match="launcher must be one of"):
        launcher_env("kubernetes", {})
