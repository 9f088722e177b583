"""The ``distkit`` command (also ``python -m distkit``).

distkit info                          the environment, and what init_dist("auto") would do
distkit launch -n N script.py ARGS    run a script on N local ranks (no torchrun needed)
distkit launch -n N -m module ARGS    the same for ``python -m module``
distkit bench [--world-size 2] ...    distkit vs torch.distributed vs mmengine.dist
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any, Optional

LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_STEP_ID",
    "SLURM_NODELIST",
    "SLURM_TASKS_PER_NODE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "DISTKIT_DEBUG",
    "DISTKIT_SERIALIZER",
)


def environment() -> list[tuple[str, str, str]]:
    """``(section, item, value)`` rows describing this machine for ``distkit info``."""
    import torch
    import torch.distributed as td

    import distkit
    from distkit.dist.init import default_backend
    from distkit.utils.environ import detect_launcher, launcher_env

    rows = [
        ("versions", "distkit", distkit.__version__),
        ("versions", "python", f"{platform.python_version()} ({sys.executable})"),
        ("versions", "torch", torch.__version__),
        ("versions", "platform", platform.platform()),
    ]
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        rows.append(
            (
                "accelerators",
                "cuda",
                f"{torch.cuda.device_count()} GPU(s): {names} (CUDA {torch.version.cuda})",
            )
        )
    else:
        built = "with" if torch.version.cuda else "without"
        rows.append(("accelerators", "cuda", f"not available (torch built {built} CUDA)"))
    mps = getattr(torch.backends, "mps", None)
    rows.append(("accelerators", "mps", "available" if mps and mps.is_available() else "no"))
    for name in ("xpu", "npu", "mlu", "musa"):
        module = getattr(torch, name, None)
        if module is not None and hasattr(module, "is_available"):
            ok = module.is_available()
            rows.append(
                ("accelerators", name, f"{module.device_count()} device(s)" if ok else "no")
            )
    for backend in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        check = getattr(td, f"is_{backend}_available", None)
        ok = check() if check else td.is_backend_available(backend)
        rows.append(("backends", backend, "available" if ok else "no"))
    env_rows = [("launcher variables", k, os.environ[k]) for k in LAUNCHER_VARS if k in os.environ]
    rows += env_rows or [("launcher variables", "(none set)", "")]

    launcher, reason = detect_launcher()
    rows.append(('init_dist("auto")', "launcher", f"{launcher}: {reason}"))
    if launcher == "none":
        rows.append(('init_dist("auto")', "would", "start nothing: a single process, rank 0 of 1"))
    else:
        try:
            env = launcher_env(launcher)
            local = int(env["LOCAL_WORLD_SIZE"])
            backend = default_backend(local)
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            why = (
                f"CUDA with {gpus} GPU(s) for {local} local rank(s)"
                if backend == "nccl"
                else "CUDA is not usable by every local rank"
                if gpus
                else "no CUDA"
            )
            rows.append(('init_dist("auto")', "backend", f"{backend} ({why})"))
            rows.append(
                (
                    'init_dist("auto")',
                    "rank",
                    f"{env['RANK']} of {env['WORLD_SIZE']} (local {env['LOCAL_RANK']} of {local})",
                )
            )
            rows.append(
                ('init_dist("auto")', "rendezvous", f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}")
            )
        except (RuntimeError, ValueError) as exc:
            rows.append(('init_dist("auto")', "would fail", str(exc)))
    from distkit.dist import get_debug, get_serializer

    rows.append(("distkit settings", "serializer", get_serializer()))
    rows.append(("distkit settings", "debug", "on" if get_debug() else "off"))
    return rows


def info(file: Any = None) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="distkit info")
    for column in ("section", "item", "value"):
        table.add_column(column, overflow="fold")
    last = None
    for section, item, value in environment():
        table.add_row(section if section != last else "", item, value)
        last = section
    Console(file=file or sys.stdout, width=max(100, min(160, _width()))).print(table)
    return 0


def _width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 120


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="distkit", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="the environment, and what init_dist('auto') would choose")
    launch = sub.add_parser("launch", help="run a script on N local ranks")
    launch.add_argument("-n", "--nprocs", type=int, default=2, help="number of ranks (2)")
    launch.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds before the run is stopped as hung (no limit)",
    )
    launch.add_argument("-m", dest="module", action="store_true", help="run a module, as python -m")
    launch.add_argument("target", help="the script (or module with -m)")
    launch.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    sub.add_parser("bench", help="benchmark (see distkit bench --help)", add_help=False)

    if argv and argv[0] == "bench":  # its own parser handles the rest
        from distkit.bench import main as bench

        return bench(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.nprocs < 1:
        parser.error("-n must be at least 1")
    from distkit.local.script import run_script

    return run_script(args.target, args.args, args.nprocs, args.timeout, module=args.module)


if __name__ == "__main__":
    sys.exit(main())
