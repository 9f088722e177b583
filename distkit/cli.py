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


#: The name pip knows distkit by (``pip install torch-distkit``); the import name stays
#: ``distkit`` ('distkit' on PyPI is an unrelated package).
DISTRIBUTION = "torch-distkit"


def installed() -> str:
    """How distkit is installed, for ``distkit info``: the distribution's name and version,
    whether the install is editable, and whether it is stale (its version is not the one
    imported)."""
    import json
    from importlib import metadata

    import distkit

    candidates = list(metadata.distributions(name=DISTRIBUTION))
    if not candidates:
        return f"{DISTRIBUTION} is not installed (distkit is imported from a source tree)"
    # the first one an installer wrote: a build leaves an egg-info in the source tree, which
    # comes first on sys.path when Python runs there
    found = min(candidates, key=lambda d: d.read_text("INSTALLER") is None)
    how = f"{DISTRIBUTION} {found.version}"
    direct = json.loads(found.read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable"):
        how += f", an editable install of {direct.get('url', '?').removeprefix('file://')}"
    if found.version != distkit.__version__:
        how += f" (stale: the distkit imported is {distkit.__version__}; install it again)"
    return how


def environment() -> list[tuple[str, str, str]]:
    """``(section, item, value)`` rows describing this machine for ``distkit info``."""
    import torch
    import torch.distributed as td

    import distkit
    from distkit.dist.init import default_backend
    from distkit.utils.environ import detect_launcher, launcher_env

    rows = [
        ("versions", "distkit", f"{distkit.__version__} ({os.path.dirname(distkit.__file__)})"),
        ("versions", "installed as", installed()),
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


DESCRIPTION = "Tools for multi-rank PyTorch code on one machine."

EXAMPLES = """\
examples:
  distkit info
  distkit launch -n 4 train.py --lr 0.1
  distkit launch -n 2 -m mypackage.train
  distkit bench --quick
"""

LAUNCH_HELP = """\
Run a script (or, with -m, a module) on N ranks on this machine. Each rank is a
fresh interpreter with the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*), so the script's own
dist.init_dist() or torch.distributed.init_process_group() joins them. When a rank
fails, the others are stopped 3 s later and the failing rank's traceback is shown.
"""

LAUNCH_EPILOG = """\
exit status: 0 every rank succeeded, 1 a rank failed or the run timed out,
2 bad usage or no such script, 130 Ctrl-C, 143 SIGTERM.
Options after the script belong to the script: distkit launch -n 2 train.py --lr 0.1
"""


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``distkit`` parser, and its ``launch`` sub-parser (for its own errors)."""
    import distkit

    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="distkit", description=DESCRIPTION, epilog=EXAMPLES, formatter_class=raw
    )
    parser.add_argument("--version", action="version", version=f"distkit {distkit.__version__}")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    sub.add_parser(
        "info",
        help='versions, accelerators, backends, and what init_dist("auto") would do here',
        description="Describe this machine as distkit sees it.",
    )
    launch = sub.add_parser(
        "launch",
        help="run a script on N local ranks, as torchrun would (no port to pick)",
        description=LAUNCH_HELP,
        epilog=LAUNCH_EPILOG,
        formatter_class=raw,
        usage="distkit launch [-n N] [--timeout SECONDS] [--profile PATH] "
        "(script.py | -m module) [args ...]",
    )
    launch.add_argument("-n", "--nprocs", type=int, default=2, help="number of ranks (2)")
    launch.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop the run as hung after this long, showing each rank's stack (no limit)",
    )
    launch.add_argument(
        "--profile",
        default=None,
        metavar="PATH",
        help="profile the collectives of every rank from init_dist to destroy_dist: print "
        "where ranks waited for each other and write a Chrome trace to PATH",
    )
    launch.add_argument("-m", dest="module", action="store_true", help="run a module, as python -m")
    launch.add_argument("target", nargs="?", help="the script (or the module, with -m)")
    launch.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    sub.add_parser(
        "bench",
        help="time distkit against torch.distributed and mmengine.dist (bench --help)",
        add_help=False,
    )
    return parser, launch


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the ranks started (or in info, bench)
        print("distkit: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    parser, launch = _parsers()
    if not argv:  # what can I do here? the answer, rather than an error
        parser.print_help()
        return 0
    if argv[0] == "bench":  # its own parser handles the rest
        from distkit.bench import main as bench

        return bench(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.target is None:
        launch.error("give the script to run (or -m and a module)")
    if args.nprocs < 1:
        launch.error("-n must be at least 1")
    if args.profile is not None:  # every rank inherits it (see distkit.dist.profiling)
        os.environ["DISTKIT_PROFILE"] = os.path.abspath(args.profile)
    from distkit.local.script import run_script

    return run_script(args.target, args.args, args.nprocs, args.timeout, module=args.module)


if __name__ == "__main__":
    sys.exit(main())
