"""What every benchmark shares: the peers (torch's object collectives and mmengine, when
they can run here), the payloads, and a process's resident memory."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as td

MiB = 1024 * 1024


class Unavailable(NamedTuple):
    """An implementation that cannot run on this machine, and why (shown in its column)."""

    reason: str


#: torch's object collectives read what they receive with ``tensor.numpy()``, and mmengine
#: imports NumPy: without NumPy (which distkit does not need) both columns say so
NEEDS_NUMPY = Unavailable("needs NumPy")


def _numpy_missing() -> bool:
    """Whether torch cannot reach NumPy here (``tensor.numpy()`` raises without it)."""
    try:
        torch.zeros(1).numpy()
    except RuntimeError:  # "Numpy is not available"
        return True
    return False


def _mmengine() -> Any:
    try:
        import mmengine.dist as mm
    except ImportError:
        return None
    return mm


def _mmengine_absent() -> Optional[Unavailable]:
    """Why mmengine's columns are empty: ``None`` when it is not installed (plain n/a)."""
    import importlib.util

    if _numpy_missing() and importlib.util.find_spec("mmengine") is not None:
        return NEEDS_NUMPY
    return None


def _torch_objects() -> Optional[Unavailable]:
    """Why torch's object collectives cannot run here, or ``None`` when they can."""
    return NEEDS_NUMPY if _numpy_missing() else None


def tensor_dicts(total_bytes: int, rank: int) -> list[dict]:
    """A list of dicts holding 1 MiB float tensors, ``total_bytes`` in all."""
    n = max(1, total_bytes // MiB)
    per = total_bytes // n // 4
    g = torch.Generator().manual_seed(rank)
    return [
        {"id": i, "name": f"sample-{i}", "feat": torch.randn(per, generator=g)} for i in range(n)
    ]


def _memory(field: str) -> int:
    """A field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def interleaved_medians(fns: dict[str, Callable[[], Any]], iters: int) -> dict[str, float]:
    """Each of ``fns`` called ``iters`` times, interleaved in a rotating order, each call
    after a barrier; the median over iterations of the slowest rank's time, per name (the
    same dict on every rank)."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(iters):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            td.barrier()
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    out = {}
    for name, values in times.items():
        slowest = torch.tensor(values)
        td.all_reduce(slowest, td.ReduceOp.MAX)
        out[name] = statistics.median(slowest.tolist())
    return out
