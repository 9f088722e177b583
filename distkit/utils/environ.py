"""Reading what torchrun, SLURM and MPI launchers put in the environment.

Pure functions of an environment mapping, so they can be tested without a cluster:
:func:`detect_launcher` says which launcher started this process and why, and
:func:`launcher_env` translates its variables into torch's ``env://`` variables
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from typing import Optional

LAUNCHERS = ("pytorch", "slurm", "mpi", "none")
DEFAULT_PORT = 29500

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def detect_launcher(env: Optional[Mapping[str, str]] = None) -> tuple[str, str]:
    """Return ``(launcher, reason)`` for the launcher that started this process.

    Checked in this order: torchrun (or any launcher that sets ``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT``) is ``pytorch``; a ``srun`` job step with more
    than one task (``SLURM_PROCID``, ``SLURM_NTASKS`` > 1 and ``SLURM_STEP_ID``) is
    ``slurm``; Open MPI's ``OMPI_COMM_WORLD_*`` or MPICH/Intel MPI's ``PMI_*`` variables
    with more than one process are ``mpi``; anything else is ``none``. torchrun inside a
    SLURM allocation is ``pytorch``: its own variables win. A SLURM batch script
    (no ``SLURM_STEP_ID``) is ``none``, because only ``srun`` starts the other tasks.

    Args:
        env: Environment to read; ``None`` reads ``os.environ``.

    Returns:
        One of ``pytorch``, ``slurm``, ``mpi``, ``none``, and a sentence saying why.

    Examples:
        >>> from distkit.utils.environ import detect_launcher
        >>> detect_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"})
        ('slurm', 'SLURM_PROCID, SLURM_NTASKS=4 and SLURM_STEP_ID are set (a srun job step)')
    """
    env = os.environ if env is None else env
    if all(v in env for v in _TORCHRUN_VARS):
        return "pytorch", "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set (torchrun)"
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    ntasks = _int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS")))
    if "SLURM_PROCID" in env and ntasks and ntasks > 1 and step is not None:
        return (
            "slurm",
            f"SLURM_PROCID, SLURM_NTASKS={ntasks} and SLURM_STEP_ID are set (a srun job step)",
        )
    if "SLURM_PROCID" in env and ntasks and ntasks > 1:
        reason = "SLURM variables are set but SLURM_STEP_ID is not: a batch script, not a srun step"
        return "none", reason
    if "OMPI_COMM_WORLD_RANK" in env and (_int(env.get("OMPI_COMM_WORLD_SIZE")) or 1) > 1:
        return "mpi", "OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE are set (Open MPI)"
    if "PMI_RANK" in env and (_int(env.get("PMI_SIZE")) or 1) > 1:
        return "mpi", "PMI_RANK and PMI_SIZE are set (MPICH / Intel MPI)"
    return "none", "no launcher variables are set: a plain single process"


def launched_as(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """How a launcher started this process as one rank of several, or ``None``.

    ``None`` when :func:`detect_launcher` finds no launcher, or one that started a single
    process (``WORLD_SIZE=1``). Otherwise a phrase naming the launcher and the variables
    it set, for errors about a missing process group.

    Args:
        env: Environment to read; ``None`` reads ``os.environ``.

    Examples:
        >>> from distkit.utils.environ import launched_as
        >>> print(launched_as({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"}))
        srun started it as rank 3 of 4 (SLURM_PROCID=3, SLURM_NTASKS=4, SLURM_STEP_ID=0)
        >>> launched_as({}) is None
        True
    """
    env = os.environ if env is None else env
    launcher = detect_launcher(env)[0]
    names: tuple[str, ...]
    if launcher == "pytorch":
        names, who = _TORCHRUN_VARS, "torchrun (or another launcher)"
        rank, size = env["RANK"], env["WORLD_SIZE"]
    elif launcher == "slurm":
        step = "SLURM_STEP_ID" if "SLURM_STEP_ID" in env else "SLURM_STEPID"
        names, who = ("SLURM_PROCID", "SLURM_NTASKS", step), "srun"
        rank, size = env["SLURM_PROCID"], env["SLURM_NTASKS"]
    elif launcher == "mpi":
        who = "mpirun"
        if "OMPI_COMM_WORLD_RANK" in env:
            names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
        else:
            names = ("PMI_RANK", "PMI_SIZE")
        rank, size = env[names[0]], env[names[1]]
    else:
        return None
    if (_int(size) or 1) <= 1:
        return None
    shown = ", ".join(f"{n}={env[n]}" for n in names if n in env)
    return f"{who} started it as rank {rank} of {size} ({shown})"


def _int(value: Optional[str]) -> Optional[int]:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _expand_one(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    head, tail = name[: match.start()], name[match.end() :]
    values = []
    for item in match.group(1).split(","):
        item = item.strip()
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo)
            values += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        elif item:
            values.append(item)
    return [h for v in values for h in _expand_one(head + v + tail)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM node list such as ``node[01-03,7],gpu5`` into host names.

    ``scontrol show hostnames`` does this on a cluster; this parser works where
    ``scontrol`` is absent (containers, tests). Zero padding follows the range start, and
    several bracket groups in one name expand as a product (``r[1-2]n[1-2]``).

    Args:
        nodelist: The value of ``SLURM_NODELIST`` / ``SLURM_JOB_NODELIST``.

    Returns:
        Host names in SLURM's order.

    Examples:
        >>> from distkit.utils.environ import expand_nodelist
        >>> expand_nodelist("node[01-03,7],gpu5")
        ['node01', 'node02', 'node03', 'node7', 'gpu5']
    """
    return [host for part in _split_top(nodelist) for host in _expand_one(part)]


def _first_host(nodelist: str) -> str:
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout.split()
            if out:
                return out[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_nodelist(nodelist)[0]


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE`` (e.g. ``2(x3),1``) into one count per node.

    Args:
        value: The variable's value.

    Examples:
        >>> from distkit.utils.environ import parse_tasks_per_node
        >>> parse_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    counts = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            raise ValueError(f"cannot parse SLURM_TASKS_PER_NODE={value!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _need(env: Mapping[str, str], launcher: str, *names: str) -> list[str]:
    missing = [n for n in names if n not in env]
    if missing:
        raise RuntimeError(
            f"init_dist(launcher={launcher!r}): environment variable(s) "
            f"{', '.join(missing)} are not set. Start the script with the {launcher} launcher "
            "(torchrun, srun or mpirun), or call init_dist('auto') to detect the launcher"
        )
    return [env[n] for n in names]


def launcher_env(
    launcher: str, env: Optional[Mapping[str, str]] = None, port: Optional[int] = None
) -> dict[str, str]:
    """torch ``env://`` variables for a process started by ``launcher``.

    Args:
        launcher: ``pytorch``, ``slurm`` or ``mpi``.
        env: Environment to read; ``None`` reads ``os.environ``.
        port: Rendezvous port for slurm and mpi when ``MASTER_PORT`` is not set
            (default 29500).

    Returns:
        ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
        ``MASTER_PORT`` as strings.

    Raises:
        RuntimeError: A variable the launcher always sets is missing, or (mpi) the
            job spans several nodes and ``MASTER_ADDR`` is not set.
        ValueError: ``launcher`` is not one of those three.

    Examples:
        >>> from distkit.utils.environ import launcher_env
        >>> env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
        ...        "SLURM_NODELIST": "node[01-04]", "SLURM_TASKS_PER_NODE": "2(x4)",
        ...        "SLURM_NODEID": "2"}
        >>> launcher_env("slurm", env)["MASTER_ADDR"]
        'node01'
    """
    env = os.environ if env is None else env
    default_port = str(port or env.get("MASTER_PORT") or DEFAULT_PORT)
    if launcher == "pytorch":
        return _from_torchrun(env)
    if launcher == "slurm":
        return _from_slurm(env, default_port)
    if launcher == "mpi":
        return _from_mpi(env, default_port)
    raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)} or 'auto', got {launcher!r}")


def _from_torchrun(env: Mapping[str, str]) -> dict[str, str]:
    rank, world, addr, port = _need(env, "pytorch", *_TORCHRUN_VARS)
    local_rank = env.get("LOCAL_RANK", "0")
    local_size = env.get("LOCAL_WORLD_SIZE", world if addr in _LOOPBACK else "1")
    return _pack(rank, world, local_rank, local_size, addr, port)


def _from_slurm(env: Mapping[str, str], port: str) -> dict[str, str]:
    rank, world, local_rank = _need(env, "slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    nodelist = (
        env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    )
    if not nodelist:
        (nodelist,) = _need(env, "slurm", "SLURM_NODELIST")
    local_size = env.get("SLURM_NTASKS_PER_NODE") or "1"
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if tasks and "SLURM_NODEID" in env:
        local_size = str(parse_tasks_per_node(tasks)[int(env["SLURM_NODEID"])])
    addr = env.get("MASTER_ADDR") or _first_host(nodelist)
    return _pack(rank, world, local_rank, local_size, addr, port)


def _from_mpi(env: Mapping[str, str], port: str) -> dict[str, str]:
    if "OMPI_COMM_WORLD_RANK" in env:
        rank, world = _need(env, "mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
        local_rank = env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        local_size = env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1")
    else:
        rank, world = _need(env, "mpi", "PMI_RANK", "PMI_SIZE")
        local_rank = env.get("MPI_LOCALRANKID", "0")
        local_size = env.get("MPI_LOCALNRANKS", "1")
    addr = env.get("MASTER_ADDR")
    if not addr:
        if local_size != world:
            raise RuntimeError(
                "init_dist(launcher='mpi'): the job spans several nodes and MASTER_ADDR "
                "is not set. Export it to every rank, e.g. "
                "mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=29500 ..."
            )
        addr = "127.0.0.1"
    return _pack(rank, world, local_rank, local_size, addr, port)


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _pack(
    rank: str, world: str, local_rank: str, local_size: str, addr: str, port: str
) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_size),
        "MASTER_ADDR": str(addr),
        "MASTER_PORT": str(port),
    }
