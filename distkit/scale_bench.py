"""How cost grows with ranks: ``distkit bench --only scale`` (see docs/scale.md).

For each world size (2, 4 and 8 gloo ranks by default, each world a fresh
:class:`~distkit.local.pool.RankPool`), every operation runs with distkit, raw
torch.distributed and mmengine.dist on the same payload, and two figures are taken per
implementation:

- **peak memory per rank**: the growth of the resident set's high-water mark (VmHWM)
  during one call over what the rank held just before it (after returning freed memory to
  the system with ``malloc_trim``; see :func:`fix_allocator`), the largest over ranks.
  The call's result counts (it is held until the peak is read).
- **time per call**: the median over a few calls (interleaved between implementations,
  each after a barrier) of the slowest rank's time.

Ranks are not pinned to CPUs: 8 ranks on a 2-core machine share them, so compare ratios
between implementations and world sizes, not times. Each row is printed next to what
:mod:`distkit.scale_model` predicts for its memory, and the model is carried to 1,024
ranks.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as td

import distkit.dist as dist
from distkit import scale_model
from distkit._compat import all_gather_single
from distkit.bench_peers import (
    MiB,
    Unavailable,
    _memory,
    _mmengine,
    _mmengine_absent,
    _torch_objects,
    interleaved_medians,
    tensor_dicts,
)

#: The tensor collectives' payloads, as a fraction of the object payload (a 64 MiB run:
#: all_reduce of 16 MiB, uneven all_gather of up to 16 MiB per rank)
TENSOR_SHARE = 4


def _tiny(rank: int) -> dict:
    """What a rank whose object is "tiny" holds (a few dozen bytes pickled)."""
    return {"rank": rank, "ok": True}


_TINY_BYTES = 64  # what the model counts for a tiny object


def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


#: glibc's mallopt parameter for the size from which blocks get memory maps of their own
M_MMAP_THRESHOLD = -3


def fix_allocator(threshold: int = 128 * 1024) -> None:
    """Give every block of ``threshold`` bytes or more a memory map of its own (glibc's
    default start), and keep it so.

    glibc otherwise raises the threshold to the size of each large block freed (up to
    32 MiB), after which blocks of that size come from the heap, where freed memory stays
    resident and a growing buffer is copied: the same call's peak then depends on what
    earlier calls freed (one payload's worth, between two runs).
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, threshold)


def _trim() -> None:
    """Return freed memory to the system, so the next peak starts from what is held."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _peak(call: Callable[[], Any]) -> int:
    """How much this rank's peak resident memory grew during ``call()`` (its result held
    until the peak is read); -1 where the kernel cannot reset the peak."""
    _trim()
    td.barrier()
    if not os.path.exists("/proc/self/clear_refs"):
        call()
        return -1
    before = _memory("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark, from now on
    result = call()
    peak = _memory("VmHWM") - before
    del result
    td.barrier()
    return peak


def _cases(rank: int, size: int, payload: int) -> list[tuple[str, str, list[int], int, dict]]:
    """``(row name, model op, bytes per rank, root, {impl: call})`` for this world."""
    mm, mm_absent, torch_absent = _mmengine(), _mmengine_absent(), _torch_objects()
    last = size - 1
    mib = payload // MiB
    cases = []

    # all_gather_object and gather_object: the last rank's object holds the payload, the
    # others are tiny (torch pads every rank to the largest)
    big = tensor_dicts(payload, rank) if rank == last else _tiny(rank)
    sizes = [_TINY_BYTES] * last + [payload]

    def torch_all_gather() -> Any:
        out: list[Any] = [None] * size
        td.all_gather_object(out, big)
        return out

    def torch_gather() -> Any:
        out: Optional[list[Any]] = [None] * size if rank == 0 else None
        td.gather_object(big, out, dst=0)
        return out

    cases.append(
        (
            f"all_gather_object: {mib} MiB on one rank, tiny elsewhere",
            "all_gather_object",
            sizes,
            0,
            {
                "distkit": lambda: dist.all_gather_object(big),
                "torch": torch_absent or torch_all_gather,
                "mmengine": (lambda: mm.all_gather_object(big)) if mm else mm_absent,
            },
        )
    )
    cases.append(
        (
            f"gather_object to rank 0: {mib} MiB on one rank, tiny elsewhere",
            "gather_object",
            sizes,
            0,
            {
                "distkit": lambda: dist.gather_object(big),
                "torch": torch_absent or torch_gather,
                "mmengine": (lambda: mm.gather_object(big)) if mm else mm_absent,
            },
        )
    )

    # broadcast_object_list from rank 0, and a tensor broadcast of the same bytes into a
    # buffer every receiver allocated (and touched) beforehand: the wire alone
    obj = tensor_dicts(payload, 0) if rank == 0 else None

    def torch_broadcast_object() -> Any:
        box = [obj]
        td.broadcast_object_list(box, src=0)
        return box

    cases.append(
        (
            f"broadcast_object_list: {mib} MiB from rank 0",
            "broadcast_object_list",
            [payload] + [0] * last,
            0,
            {
                "distkit": lambda: dist.broadcast_object_list([obj]),
                "torch": torch_absent or torch_broadcast_object,
                "mmengine": (lambda: mm.broadcast_object_list([obj])) if mm else mm_absent,
            },
        )
    )
    flat = torch.ones(payload // 4) if rank == 0 else torch.zeros(payload // 4)
    cases.append(
        (
            f"broadcast: a {mib} MiB tensor from rank 0",
            "broadcast",
            [payload] + [0] * last,
            0,
            {
                "distkit": lambda: dist.broadcast(flat, 0),
                "torch": lambda: td.broadcast(flat, 0),
                "mmengine": (lambda: mm.broadcast(flat, 0)) if mm else mm_absent,
            },
        )
    )

    # all_reduce in place
    part = payload // TENSOR_SHARE
    summed = torch.ones(part // 4)
    cases.append(
        (
            f"all_reduce: {part // MiB} MiB",
            "all_reduce",
            [part] * size,
            0,
            {
                "distkit": lambda: dist.all_reduce(summed),
                "torch": lambda: td.all_reduce(summed),
                "mmengine": (lambda: mm.all_reduce(summed)) if mm else mm_absent,
            },
        )
    )

    # all_gather of uneven tensors: rank r holds (r + 1) / N of the largest. torch and
    # mmengine (whose all_gather wants equal shapes) exchange sizes, pad, gather, slice.
    counts = [part // 4 * (r + 1) // size for r in range(size)]
    mine = torch.ones(counts[rank])

    def padded(gather: Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]) -> Any:
        def run() -> Any:
            n = torch.tensor([mine.numel()])
            lengths = gather(n, torch.empty(size, dtype=torch.long))
            longest = int(max(t.item() for t in lengths))
            send = torch.zeros(longest)
            send[: mine.numel()] = mine
            rows = gather(send, torch.empty(size * longest))
            return [row[: int(k.item())] for row, k in zip(rows, lengths)]

        return run

    def torch_gather_rows(t: torch.Tensor, out: torch.Tensor) -> list[torch.Tensor]:
        all_gather_single(out, t)
        return list(out.chunk(size))

    def mm_gather_rows(t: torch.Tensor, out: torch.Tensor) -> list[torch.Tensor]:
        return list(mm.all_gather(t))

    cases.append(
        (
            f"all_gather: uneven, rank r holds (r+1)/N of {part // MiB} MiB",
            "all_gather_uneven",
            [c * 4 for c in counts],
            0,
            {
                "distkit": lambda: dist.all_gather(mine),
                "torch": padded(torch_gather_rows),
                "mmengine": padded(mm_gather_rows) if mm else mm_absent,
            },
        )
    )
    return cases


def run_rank(payload: int, iters: int, ops: Optional[tuple[str, ...]] = None) -> list[dict]:
    """On every rank: each case's peak memory and time per implementation (rank 0's
    return value holds the rows); ``ops``: only these operations of the model."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    fix_allocator()
    rank, size = dist.get_rank(), dist.get_world_size()
    rows = []
    for name, op, sizes, root, fns in _cases(rank, size, payload):
        if ops is not None and op not in ops:
            continue
        impls = {n: fn for n, fn in fns.items() if callable(fn)}
        missing = {n: fn.reason for n, fn in fns.items() if isinstance(fn, Unavailable)}
        if "mmengine" not in fns or fns["mmengine"] is None:
            missing.setdefault("mmengine", "not installed")
        if op == "all_gather_uneven":
            # distkit predicts each rank's size from the last calls: one call before the
            # measured ones puts it in the steady state a training loop is in
            impls["distkit"]()
        memory = {}
        for impl, fn in impls.items():  # the first call of each also warms it up
            peak = torch.tensor([_peak(fn)])
            td.all_reduce(peak, td.ReduceOp.MAX)
            memory[impl] = int(peak.item())
        seconds = interleaved_medians(impls, iters)
        rows.append(
            {
                "case": name,
                "op": op,
                "world": size,
                "sizes": sizes,
                "root": root,
                "seconds": seconds,
                "memory": memory,
                "missing": missing,
            }
        )
        _trim()
    return rows


def run(
    ranks: list[int],
    payload: int,
    iters: int,
    timeout: float,
    ops: Optional[tuple[str, ...]] = None,
) -> list[dict]:
    """Every world size in ``ranks``, each in a fresh pool of gloo ranks: the rows of
    :func:`run_rank`."""
    from distkit.local.pool import RankPool

    rows: list[dict] = []
    for n in ranks:
        with RankPool(n, timeout=timeout, pg_timeout=600) as pool:
            rows += pool.run(run_rank, payload, iters, ops)[0]
    return rows


# -- report ----------------------------------------------------------------------------


def _mb(n: Optional[int]) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e6:.0f} MB" if abs(n) >= 1e6 else f"{n / 1e3:.1f} kB"


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else _mb(n)


def _s(seconds: Optional[float]) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


Table = tuple[str, list[str], list[list[str]]]


def _model(row: dict, impl: str) -> scale_model.Cost:
    return scale_model.cost(row["op"], impl, row["sizes"], row["root"])


def tables(rows: list[dict]) -> list[Table]:
    """The measured table, the model-vs-measured check and the model at 1,024 ranks."""
    impls = ("distkit", "torch", "mmengine")
    measured = []
    for row in rows:
        sec, mem = row["seconds"], row["memory"]
        cells = [row["case"], str(row["world"])]
        cells += [_s(sec.get(i)) if i in sec else "n/a" for i in impls]
        cells += [f"{sec[i] / sec['distkit']:.2f}x" if i in sec else "n/a" for i in impls[1:]]
        cells += [_mb(mem[i]) if i in mem else "n/a" for i in impls]
        measured.append(cells)
    check = []
    for row in rows:
        for impl, got in row["memory"].items():
            want = _model(row, impl).memory
            ok = scale_model.agrees(want, got) if got >= 0 else False
            check.append(
                [row["case"], str(row["world"]), impl, _mb(want), _mb(got), "yes" if ok else "NO"]
            )
    return [
        (
            "gloo: median seconds per call (slowest rank) and peak memory growth per rank "
            "(largest over ranks)",
            ["case", "ranks", *(f"{i} time" for i in impls)]
            + ["torch/distkit", "mmengine/distkit"]
            + [f"{i} memory" for i in impls],
            measured,
        ),
        (
            f"peak memory per rank: the model against the measurement (agree: "
            f"{scale_model.TOLERANCE})",
            ["case", "ranks", "impl", "model", "measured", "agree"],
            check,
        ),
    ]


#: The payloads the model is carried to 1,024 ranks with
FAR = 1024


def far_tables(n: int = FAR, payload: int = 64 * MiB, even: int = 1 * MiB) -> list[Table]:
    """The model at ``n`` ranks: ``payload`` on one rank (tiny elsewhere), and ``even``
    bytes on every rank; and distkit's and torch's peak memory as the world grows."""
    cells = []
    one_big = [_TINY_BYTES] * (n - 1) + [payload]
    part = payload // TENSOR_SHARE
    many, one = "many small tensors", "one tensor"
    cases = [
        ("all_gather_object", f"{payload // MiB} MiB on one rank, tiny elsewhere", one_big, False),
        ("all_gather_object", f"{even // MiB} MiB on every rank, {many}", [even] * n, False),
        ("all_gather_object", f"{even // MiB} MiB on every rank, {one}", [even] * n, True),
        ("gather_object", f"{payload // MiB} MiB on one rank, tiny elsewhere", one_big, False),
        ("gather_object", f"{even // MiB} MiB on every rank, {many}", [even] * n, False),
        ("broadcast_object_list", f"{payload // MiB} MiB from rank 0", [payload] * n, False),
        ("broadcast", f"{payload // MiB} MiB tensor from rank 0", [payload] * n, False),
        ("all_reduce", f"{part // MiB} MiB", [part] * n, False),
        (
            "all_gather_uneven",
            f"rank r holds (r+1)/N of {part // MiB} MiB",
            [part * (r + 1) // n for r in range(n)],
            False,
        ),
    ]
    for op, label, sizes, views in cases:
        for impl in ("distkit", "torch"):
            c = scale_model.cost(op, impl, sizes, 0, views)
            cells.append(
                [
                    f"{op}: {label}",
                    impl,
                    str(c.rounds),
                    str(c.steps),
                    _gb(c.sent),
                    _gb(c.received),
                    _gb(c.memory),
                ]
            )
    grow = []
    worlds = [2, 4, 8, 64, 256, n]
    for op, label, sizes_of in (
        (
            "all_gather_object",
            f"{payload // MiB} MiB on one rank",
            lambda k: [_TINY_BYTES] * (k - 1) + [payload],
        ),
        (
            "all_gather_object",
            f"{even // MiB} MiB on every rank, many small tensors",
            lambda k: [even] * k,
        ),
    ):
        for impl in ("distkit", "torch"):
            grow.append(
                [f"{op}: {label}", impl]
                + [_gb(scale_model.cost(op, impl, sizes_of(k), 0).memory) for k in worlds]
            )
    return [
        (
            f"the model at {n} ranks, per rank (largest over ranks)",
            ["case", "impl", "rounds", "steps", "sent", "received", "peak memory"],
            cells,
        ),
        (
            "the model: peak memory per rank as the world grows",
            ["case", "impl", *(f"{k} ranks" for k in worlds)],
            grow,
        ),
    ]


def report(rows: list[dict], file: Any = None) -> None:
    """Print the measured rows, the model check and the model at 1,024 ranks with rich."""
    from rich.console import Console
    from rich.table import Table as RichTable

    console = Console(file=file or sys.stdout, width=200)
    for title, columns, cells in tables(rows) + far_tables():
        table = RichTable(title=title)
        for col in columns:
            table.add_column(col, justify="left" if col in ("case", "impl") else "right")
        for cell_row in cells:
            table.add_row(*cell_row)
        console.print(table)


def markdown(rows: list[dict]) -> str:
    """The same tables as Markdown (for docs/scale.md)."""
    blocks = []
    for title, columns, cells in tables(rows) + far_tables():
        align = ["---" if c in ("case", "impl") else "---:" for c in columns]
        lines = [f"**{title}**", "", "| " + " | ".join(columns) + " |"]
        lines += ["| " + " | ".join(align) + " |"]
        lines += ["| " + " | ".join(r) + " |" for r in cells]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
