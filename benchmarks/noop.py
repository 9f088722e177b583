"""Cost of distkit's single-process path, against a plain function call and mmengine.

    python benchmarks/noop.py

No process group exists here (the ``python train.py`` case). Each row times the same
call through a plain identity function, distkit.dist and mmengine.dist, and prints
nanoseconds per call and the ratio to the identity function.
"""

from __future__ import annotations

import os
import sys
import timeit
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import distkit.dist as dist

try:
    import mmengine.dist as mm
except ImportError:  # pragma: no cover
    mm = None


def identity(x: Any = None) -> Any:
    return x


def per_call(stmt: str, env: dict, number: int = 200_000, repeat: int = 7) -> float:
    """Nanoseconds per call of ``stmt``: the best of ``repeat`` runs of ``number`` calls."""
    return min(timeit.repeat(stmt, globals=env, number=number, repeat=repeat)) / number * 1e9


#: (case, statement); ``lib`` is distkit.dist or mmengine.dist.
CASES = [
    ("get_rank()", "lib.get_rank()"),
    ("get_world_size()", "lib.get_world_size()"),
    ("all_reduce(t)", "lib.all_reduce(t)"),
    ("all_reduce(t, op='mean')", "lib.all_reduce(t, op='mean')"),
    ("all_gather(t)", "lib.all_gather(t)"),
    ("broadcast(t)", "lib.broadcast(t)"),
    ("barrier()", "lib.barrier()"),
    ("all_gather_object(7)", "lib.all_gather_object(7)"),
    ("all_gather_object(small dict)", "lib.all_gather_object(small)"),
]


def measure() -> list[dict]:
    """One row per case: ns per call for identity, distkit, mmengine, and the ratios."""
    env = {"t": torch.ones(4), "small": {"loss": 0.25, "acc": 0.5}, "identity": identity}
    base = per_call("identity(t)", env)
    rows = []
    for name, stmt in CASES:
        ns = per_call(stmt, {**env, "lib": dist})
        row = {"case": name, "identity_ns": base, "distkit_ns": ns, "distkit_x": ns / base}
        if mm is not None:
            mm_ns = per_call(stmt, {**env, "lib": mm})
            row.update(mmengine_ns=mm_ns, mmengine_x=mm_ns / base)
        rows.append(row)
    return rows


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    assert not dist.is_distributed(), "run this without a launcher"
    table = Table(title="single process, no process group: ns per call (ratio to identity)")
    for col in ("case", "identity", "distkit", "mmengine.dist"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for row in measure():
        mm_cell = (
            f"{row['mmengine_ns']:.0f} ({row['mmengine_x']:.1f}x)"
            if "mmengine_ns" in row
            else "n/a"
        )
        table.add_row(
            row["case"],
            f"{row['identity_ns']:.0f}",
            f"{row['distkit_ns']:.0f} ({row['distkit_x']:.1f}x)",
            mm_cell,
        )
    Console().print(table)
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
