"""distkit against raw torch.distributed and mmengine.dist, measured in the same run.

    python benchmarks/run.py [--world-size 2] [--only objects|p2p|...] [--quick] [--json out.json]
    distkit bench ...        (the same, through the command line)

It starts its own gloo world on this machine (a :class:`~distkit.testing.RankPool`, each
rank pinned to one CPU when there are enough, one intra-op thread each), runs every
implementation of a case on the same payload, interleaved call by call, and prints the
median seconds per call (the slowest rank of each iteration), the ratios torch/distkit and
mmengine/distkit (above 1: distkit is faster) and, for tensor collectives, bus bandwidth in
the nccl-tests convention (algorithm bandwidth S/t times 2(n-1)/n for all_reduce, (n-1)/n for
all_gather, reduce_scatter and all_to_all). The single-process rows time one call with no
process group against a plain identity function. Without NumPy (no dependency of distkit)
the implementations that need it, torch's object collectives and mmengine, are not run:
their columns say ``n/a (needs NumPy)``. ``--only scale`` runs 2, 4 and 8 ranks against
a cost model instead (:mod:`distkit.scale_bench`, docs/scale.md).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
import timeit
import types
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as td

import distkit.dist as dist
from distkit import _settings
from distkit._compat import all_gather_single, functional_collectives, reduce_scatter_single
from distkit.bench_peers import (
    NEEDS_NUMPY,
    MiB,
    Unavailable,
    _memory,
    _mmengine,
    _mmengine_absent,
    _torch_objects,
    interleaved_medians,
    tensor_dicts,
)


class Case(NamedTuple):
    name: str
    group: str  # objects, collect, tensors, uneven
    target: str
    check: str  # "vs": others/distkit >= goal; "overhead": distkit/torch <= goal; "info"
    goal: float


# -- payloads ----------------------------------------------------------------------------


def small_dicts(n: int, rank: int) -> list[dict]:
    return [{"id": i * 7 + rank, "score": i / 3.0, "label": "cat"} for i in range(n)]


def detections(n: int, rank: int) -> list[dict]:
    """Detection results as COCO evaluation gathers them: a box list in every dict, so
    (unlike :func:`small_dicts`) every dict is tracked by Python's garbage collector."""
    return [
        {"image_id": i * 7 + rank, "bbox": [i, 2.0, 30.5, 40.0], "score": i / 3.0} for i in range(n)
    ]


# -- timing ------------------------------------------------------------------------------


def _time(
    fns: dict[str, Callable[[], Any]],
    budget: float,
    min_iters: int = 5,
    max_iters: int = 2000,
    warmups: int = 2,
) -> dict[str, float]:
    """Median seconds per call of each implementation (the slowest rank of each call).

    Implementations run interleaved, in a rotating order, one call each per iteration, so
    drift in the machine's speed (frequent on a shared VM) hits them alike. Every call
    starts after a barrier, and every rank runs the same number of iterations.
    """
    names = list(fns)
    for _ in range(warmups):  # every call starts together (mmengine's CPU mode needs it)
        for name in names:
            td.barrier()
            fns[name]()
    probe = torch.zeros(1)
    for name in names:
        td.barrier()
        start = time.perf_counter()
        fns[name]()
        probe += time.perf_counter() - start
    td.all_reduce(probe, td.ReduceOp.MAX)
    iters = int(min(max_iters, max(min_iters, budget * len(names) / max(probe.item(), 1e-6))))
    return interleaved_medians(fns, iters)


def _object_cases(rank: int, size: int, quick: bool) -> list[tuple]:
    mm, mm_absent, torch_absent = _mmengine(), _mmengine_absent(), _torch_objects()
    big = 2 * MiB if quick else 32 * MiB
    n_small = 2_000 if quick else 20_000
    mid = 1 * MiB if quick else 4 * MiB
    payloads = [
        (f"{big // MiB} MiB of tensors in dicts", tensor_dicts(big, rank), 2.0),
        (f"{mid // MiB} MiB of tensors in dicts", tensor_dicts(mid, rank), 1.5),
        (f"{n_small // 1000}k small dicts", small_dicts(n_small, rank), 1.1),
        (f"{n_small // 1000}k detections (dicts with a box list)", detections(n_small, rank), 1.1),
        ("a small dict", {"loss": 0.25, "step": 10, "rank": rank}, 1.3),
    ]
    rows = []
    for label, obj, goal in payloads:

        def torch_all_gather(obj: Any = obj) -> Any:
            out = [None] * size
            td.all_gather_object(out, obj)
            return out

        def torch_broadcast(obj: Any = obj) -> Any:
            lst = [obj] if rank == 0 else [None]
            td.broadcast_object_list(lst, src=0)
            return lst

        def torch_gather(obj: Any = obj) -> Any:
            out = [None] * size if rank == 0 else None
            td.gather_object(obj, out, dst=0)
            return out

        impls = {
            "all_gather_object": {
                "distkit": lambda obj=obj: dist.all_gather_object(obj),
                "torch": torch_absent or torch_all_gather,
                "mmengine": (lambda obj=obj: mm.all_gather_object(obj)) if mm else mm_absent,
            },
            "broadcast_object_list": {
                "distkit": lambda obj=obj: dist.broadcast_object_list(
                    [obj] if rank == 0 else [None]
                ),
                "torch": torch_absent or torch_broadcast,
                "mmengine": (
                    lambda obj=obj: mm.broadcast_object_list([obj] if rank == 0 else [None])
                )
                if mm
                else mm_absent,
            },
            "gather_object": {
                "distkit": lambda obj=obj: dist.gather_object(obj),
                "torch": torch_absent or torch_gather,
                "mmengine": (lambda obj=obj: mm.gather_object(obj)) if mm else mm_absent,
            },
        }
        for op, fns in impls.items():
            case = Case(f"{op}: {label}", "objects", f">= {goal}x faster", "vs", goal)
            rows.append((case, fns, None))
        if label.endswith("small dicts"):
            # What no library that pickles without overlap can beat: the source pickles,
            # a 1-byte broadcast says it is done, the others unpickle (no payload moves).
            # Its time goes in the distkit column, against torch's real call.
            blob = pickle.dumps(obj, protocol=5)
            done = torch.zeros(1, dtype=torch.uint8)

            def floor(obj: Any = obj, blob: bytes = blob, done: torch.Tensor = done) -> Any:
                if rank == 0:
                    pickle.dumps(obj, protocol=5)
                    td.broadcast(done, 0)
                    return obj
                td.broadcast(done, 0)
                return pickle.loads(blob)

            case = Case(
                f"serial floor of broadcast_object_list: {label} (distkit column: pickle "
                "on src, a 1-byte broadcast, unpickle elsewhere; no payload moves)",
                "objects",
                "(information)",
                "info",
                0.0,
            )
            rows.append((case, {"distkit": floor, "torch": torch_absent or torch_broadcast}, None))
    return rows


def _collect_cases(rank: int, size: int, quick: bool) -> list[tuple]:
    mm, mm_absent = _mmengine(), _mmengine_absent()
    n = 10_000 if quick else 100_000
    results = small_dicts(n, rank)
    tmp = tempfile.mkdtemp(prefix="distkit-bench-") if rank == 0 else None
    tmp = dist.broadcast_object(tmp)
    fns = {
        "distkit": lambda: dist.collect_results(results, n * size),
        "mmengine cpu": (lambda: mm.collect_results(results, n * size, "cpu", tmp))
        if mm
        else mm_absent,
        "mmengine gpu": (lambda: mm.collect_results(results, n * size, "gpu")) if mm else mm_absent,
    }
    case = Case(
        f"collect_results: {n // 1000}k dicts per rank", "collect", ">= 1.5x faster", "vs", 1.5
    )
    return [(case, fns, None)]


def _tensor_cases(rank: int, size: int, quick: bool) -> list[tuple]:
    mm, mm_absent = _mmengine(), _mmengine_absent()
    rows: list[tuple] = []
    sizes = [1, 4] if quick else [1, 4, 16, 64]
    for mib in sizes:
        n = mib * MiB // 4
        x = torch.ones(n)
        chunks = list(torch.ones(n).chunk(size)) if n % size == 0 else None
        rs_in = torch.ones(n * size)
        bus = {
            "all_reduce": (n * 4, 2 * (size - 1) / size),
            "all_gather": (n * 4 * size, (size - 1) / size),
            "reduce_scatter": (n * 4 * size, (size - 1) / size),
            "all_to_all": (n * 4, (size - 1) / size),
        }
        # torch allocates its outputs inside the timed call, as distkit (returning new
        # tensors) must: the comparison is of the same work, not of buffer reuse.
        impls: dict[str, dict[str, Any]] = {
            "all_reduce": {
                "distkit": lambda x=x: dist.all_reduce(x),
                "torch": lambda x=x: td.all_reduce(x),
                "mmengine": (lambda x=x: mm.all_reduce(x)) if mm else mm_absent,
            },
            "all_gather": {
                "distkit": lambda x=x: dist.all_gather(x, same_shape=True),
                "torch": lambda x=x, n=n: all_gather_single(torch.empty(n * size), x),
                "mmengine": (lambda x=x: mm.all_gather(x)) if mm else mm_absent,
            },
            "reduce_scatter": {
                "distkit": lambda i=rs_in: dist.reduce_scatter(i),
                "torch": lambda i=rs_in, n=n: reduce_scatter_single(torch.empty(n), i),
            },
            "all_to_all": {
                "distkit": lambda c=chunks: dist.all_to_all(c, same_shape=True),
                "torch": lambda c=chunks: _raw_all_to_all(c),
            },
        }
        for op, fns in impls.items():
            case = Case(f"{op}: {mib} MiB", "tensors", "<= 1.03x torch", "overhead", 1.03)
            rows.append((case, fns, bus[op]))
        # the same, when distkit is not told the shapes are equal (one extra small round)
        for op, call in (
            ("all_gather", lambda x=x: dist.all_gather(x)),
            ("all_to_all", lambda c=chunks: dist.all_to_all(c)),
        ):
            case = Case(
                f"{op}: {mib} MiB, shapes exchanged", "tensors", "(information)", "info", 0.0
            )
            rows.append((case, {"distkit": call, "torch": impls[op]["torch"]}, bus[op]))
    # uneven all_gather: ~1 MiB per rank, different sizes, against torch's even all_gather
    # of the same bytes (padded to the largest)
    n = MiB // 4 + rank * 1024
    uneven = torch.ones(n)
    longest = MiB // 4 + (size - 1) * 1024
    even = torch.ones(longest)
    fns = {
        "distkit": lambda: dist.all_gather(uneven),
        "torch": lambda: all_gather_single(torch.empty(longest * size), even),
    }
    case = Case(
        "all_gather: uneven ~1 MiB (torch: even, padded)",
        "uneven",
        "<= 1.3x torch",
        "overhead",
        1.3,
    )
    rows.append((case, fns, None))
    return rows


def _raw_all_to_all(chunks: list[torch.Tensor]) -> Any:
    """torch's all_to_all, as a user calls it (gloo before 2.13 has only the single form)."""
    outs = [torch.empty_like(t) for t in chunks]
    try:
        td.all_to_all(outs, chunks)
    except RuntimeError as exc:
        if "does not support alltoall" not in str(exc):
            raise
        flat = torch.empty(sum(t.numel() for t in chunks))
        td.all_to_all_single(flat, torch.cat(chunks))
        return flat
    return outs


def _debug_cases(rank: int, size: int, quick: bool) -> list[tuple]:
    """What the collective debug mode costs per call (it adds one small exchange)."""
    small, big = torch.ones(4), torch.ones(MiB // 4)

    def debugged(call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            dist.set_debug(True)
            try:
                return call()
            finally:
                dist.set_debug(False)

        return run

    def unchecked(call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            _settings.set("check", False)
            try:
                return call()
            finally:
                _settings.set("check", True)

        return run

    calls = [
        ("all_reduce of 4 floats", lambda: dist.all_reduce(small)),
        ("all_reduce of 1 MiB", lambda: dist.all_reduce(big)),
        ("all_gather_object of a small dict", lambda: dist.all_gather_object({"loss": 0.5})),
    ]
    rows = []
    for label, call in calls:
        case = Case(f"debug mode: {label}", "debug", "(information)", "debug", 0.0)
        rows.append((case, {"distkit": debugged(call), "debug off": call}, None))
    # the default check (on unless DISTKIT_CHECK=0): the first calls at a call site, then
    # one in 1024; what it costs a loop, amortized, against the same loop without it
    for label, call in calls[:2]:
        case = Case(f"default check: {label}", "check", "(information)", "check", 0.0)
        rows.append((case, {"distkit": call, "check off": unchecked(call)}, None))
    # the communication profile (dist.profile): what recording costs each call while one
    # is open (the recorder is what an open profile installs; opening one synchronizes)
    from distkit.dist.guard import record

    recorder = record.Recorder(None)

    def profiled(call: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            record.active = recorder
            try:
                return call()
            finally:
                record.active = None
                if len(recorder.entries) > 10_000:
                    recorder.entries.clear()

        return run

    for label, call in calls:
        case = Case(f"profile: {label}", "profile", "(information)", "profile", 0.0)
        rows.append((case, {"distkit": profiled(call), "not profiled": call}, None))
    return rows


def _p2p_cases(rank: int, size: int, quick: bool) -> list[tuple]:
    """Point to point: distkit's recv of a tensor whose shape it does not know, against
    torch's recv into a tensor allocated once beforehand (what torch needs: the shape known
    in advance); an object of tensors, against torch's send_object_list (the ring is
    :func:`_p2p_ring_cases`)."""
    rows: list[tuple] = []
    sizes = [(1, "overhead", 1.1)] if quick else [(1, "overhead", 1.1), (16, "info", 0.0)]
    for mib, check, goal in [(1 / 16, "info", 0.0), *sizes]:
        n = int(mib * MiB) // 4
        x = torch.ones(n)
        pre = torch.empty(n)

        def ours(x: torch.Tensor = x) -> Any:
            if rank == 0:
                return dist.send(x, 1)
            return dist.recv(0) if rank == 1 else None

        def theirs(x: torch.Tensor = x, pre: torch.Tensor = pre) -> Any:
            if rank == 0:
                return td.send(x, 1)
            return td.recv(pre, 0) if rank == 1 else None

        label = f"{int(mib * 1024)} KiB" if mib < 1 else f"{int(mib)} MiB"
        target = f"<= {goal}x torch" if check == "overhead" else "(information)"
        case = Case(
            f"recv: {label} tensor, shape unknown (torch: recv into a tensor allocated before)",
            "p2p",
            target,
            check,
            goal,
        )
        rows.append((case, {"distkit": ours, "torch": theirs}, None))
        if mib != 1:
            continue

        def fresh(x: torch.Tensor = x) -> Any:  # a new tensor per message, as distkit's
            if rank == 0:
                return td.send(x, 1)
            return td.recv(torch.empty(x.shape), 0) if rank == 1 else None

        case = Case(
            f"recv: {label} tensor, shape unknown (torch: recv into a new tensor of the "
            "shape known in advance, as every result of distkit's recv is)",
            "p2p",
            "(information)",
            "info",
            0.0,
        )
        rows.append((case, {"distkit": ours, "torch": fresh}, None))

    total = 4 * MiB if quick else 64 * MiB
    obj = tensor_dicts(total, 0)

    def ours_obj() -> Any:
        if rank == 0:
            return dist.send(obj, 1)
        return dist.recv(0) if rank == 1 else None

    def theirs_obj() -> Any:
        if rank == 0:
            return td.send_object_list([obj], 1)
        out: list[Any] = [None]
        if rank == 1:
            td.recv_object_list(out, 0)
        return out[0]

    case = Case(
        f"recv: an object holding {total // MiB} MiB of tensors (torch: recv_object_list)",
        "p2p",
        ">= 2.0x faster",
        "vs",
        2.0,
    )
    rows.append((case, {"distkit": ours_obj, "torch": _torch_objects() or theirs_obj}, None))
    return rows


def _p2p_ring_cases(rank: int, size: int, quick: bool) -> list[tuple]:
    """A ring (each rank sends 1 MiB to the next and receives from the previous), on 3
    ranks or more: distkit's exchange, shapes unknown to the receivers, against torch's
    batch_isend_irecv into a tensor of the known shape (allocated inside the call too)."""
    if size < 3 and not quick:
        return []  # main() runs this group in a world of 3 ranks of its own
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    ring = torch.ones(MiB // 4)

    def ours_ring() -> Any:
        return dist.exchange({nxt: ring}, [prv])

    def theirs_ring() -> Any:
        out = torch.empty(MiB // 4)
        ops = [td.P2POp(td.isend, ring, nxt), td.P2POp(td.irecv, out, prv)]
        for work in td.batch_isend_irecv(ops):
            work.wait()
        return out

    case = Case(
        f"ring exchange, {size} ranks: 1 MiB to the next rank (torch: batch_isend_irecv, "
        "shape known)",
        "p2p_ring",
        "(information)",
        "info",
        0.0,
    )
    return [(case, {"distkit": ours_ring, "torch": theirs_ring}, None)]


def _p2p_memory(impl: str, total: int) -> int:
    """On rank 1 of a fresh world: how much the peak resident memory grew while receiving
    an object holding ``total`` bytes of tensors from rank 0 (held at the end)."""
    rank = dist.get_rank()
    obj = tensor_dicts(total, 0) if rank == 0 else None
    if rank == 1:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak, from now on
    before = _memory("VmRSS")
    dist.barrier()
    if rank == 0:
        if impl == "distkit":
            dist.send(obj, 1)
        else:
            td.send_object_list([obj], 1)
    elif rank == 1:
        if impl == "distkit":
            got = dist.recv(0)
        else:
            box: list[Any] = [None]
            td.recv_object_list(box, 0)
            got = box[0]
        assert len(got) == max(1, total // MiB), "not the whole object"
    peak = _memory("VmHWM") - before
    dist.barrier()
    return peak


def p2p_memory_rows(quick: bool, timeout: float) -> list[dict]:
    """The receiver's peak memory, distkit against torch's recv_object_list, each in a
    world of its own (memory a process freed earlier would hide what the next one takes)."""
    import os

    from distkit.local.pool import RankPool

    if not os.path.exists("/proc/self/clear_refs"):
        return []
    total = 4 * MiB if quick else 64 * MiB
    peaks: dict[str, int] = {}
    missing: dict[str, str] = {}
    for impl in ("distkit", "torch"):
        if impl == "torch" and _torch_objects() is not None:
            missing[impl] = NEEDS_NUMPY.reason
            continue
        with RankPool(2, timeout=timeout) as pool:
            peaks[impl] = pool.run(_p2p_memory, impl, total)[1]
    name = f"recv: an object holding {total // MiB} MiB of tensors"
    case = Case(name, "p2p", "<= 1.2x the payload", "memory", 1.2)
    return [{"case": case._asdict(), "bytes": peaks, "payload": total, "missing": missing}]


def _compile_cases(rank: int, size: int, quick: bool) -> list[tuple]:
    """A training step compiled with torch.compile (fullgraph) that all-reduces its loss.

    distkit against the same step written with torch's functional collective, with the
    c10d call (which torch.compile rewrites into the functional one), and with mmengine.
    """
    fc = functional_collectives()

    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13):
        return []  # distkit traces under torch.compile from torch 2.13 on
    mm = _mmengine()
    world = td.group.WORLD
    assert world is not None
    gen = torch.Generator().manual_seed(rank)
    x, w = torch.randn(256, 64, generator=gen), torch.randn(64, 64, generator=gen)

    def loss_of(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).tanh().pow(2).mean()

    def with_distkit(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return dist.all_reduce(loss_of(x, w), op="mean")

    def with_functional(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return fc.all_reduce(loss_of(x, w), "sum", world) / size

    def with_c10d(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        loss = loss_of(x, w)
        td.all_reduce(loss)
        return loss / size

    def with_mmengine(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        assert mm is not None
        return mm.all_reduce(loss_of(x, w), "mean")

    def compiled(fn: Callable[..., Any], fullgraph: bool = True) -> Callable[[], Any]:
        step = torch.compile(fn, backend="aot_eager", fullgraph=fullgraph)
        return lambda: step(x, w)

    ours = compiled(with_distkit)
    goal = 1.1
    return [
        (
            Case(
                "compiled step, all_reduce of the loss (torch: functional collective)",
                "compile",
                f"<= {goal}x torch",
                "overhead",
                goal,
            ),
            {
                "distkit": ours,
                "torch": compiled(with_functional),
                "mmengine": compiled(with_mmengine, fullgraph=False) if mm else _mmengine_absent(),
            },
            None,
        ),
        (
            Case(
                "compiled step, all_reduce of the loss (torch: c10d all_reduce)",
                "compile",
                f"<= {goal}x torch",
                "overhead",
                goal,
            ),
            {"distkit": ours, "torch": compiled(with_c10d)},
            None,
        ),
    ]


GROUPS = {
    "objects": _object_cases,
    "collect": _collect_cases,
    "tensors": _tensor_cases,
    "debug": _debug_cases,
    "compile": _compile_cases,
    "p2p": _p2p_cases,
    "p2p_ring": _p2p_ring_cases,
}


#: ``--quick``: a smoke test of every case (each implementation called a few times), so
#: the numbers it prints say nothing about speed.
QUICK = {"min_iters": 2, "max_iters": 2, "warmups": 1}


def run_rank(only: Optional[str], quick: bool, budget: float) -> list[dict]:
    """Run on every rank of the world: time each case, return the rows (rank 0)."""
    import warnings

    warnings.filterwarnings("ignore")
    rank, size = dist.get_rank(), dist.get_world_size()
    # One CPU per rank and one intra-op thread: with ranks and gloo threads floating over
    # few cores, scheduler waits of whole time slices made medians jump 30% between runs.
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= size:
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    torch.set_num_threads(1)
    rows = []
    for group, build in GROUPS.items():
        if only and group not in only.split(","):
            continue
        for case, fns, bus in build(rank, size, quick):
            # None: no such implementation; Unavailable: one that cannot run here
            impls = {n: fn for n, fn in fns.items() if callable(fn)}
            missing = {n: fn.reason for n, fn in fns.items() if isinstance(fn, Unavailable)}
            timings = _time(impls, budget, **(QUICK if quick else {}))
            rows.append(
                {"case": case._asdict(), "seconds": timings, "bus": bus, "missing": missing}
            )
    return rows


# -- single process ------------------------------------------------------------------------


def noop_rows(number: int = 200_000, repeat: int = 7) -> list[dict]:
    """Single process, no process group: ns per call, and the ratio to an identity call.

    Two controls, both called the way the libraries are (through a module attribute):
    ``identity(t)``, one positional argument, as every earlier figure was measured; and
    an identity called with the row's own arguments (``identity(t, op='mean')``), which
    pays CPython's keyword matching as the library call does. The ratio that judges a row
    is the one against the same-arguments control: what the library adds to a call.
    """
    mm, mm_absent = _mmengine(), _mmengine_absent()
    statements = [  # (row, statement, the same-arguments control)
        ("get_rank()", "lib.get_rank()", "lib.nothing()"),
        ("get_world_size()", "lib.get_world_size()", "lib.nothing()"),
        ("all_reduce(t)", "lib.all_reduce(t)", "lib.identity(t)"),
        ("all_reduce(t, op='mean')", "lib.all_reduce(t, op='mean')", "lib.identity(t, op='mean')"),
        ("all_gather(t)", "lib.all_gather(t)", "lib.identity(t)"),
        ("broadcast(t)", "lib.broadcast(t)", "lib.identity(t)"),
        ("barrier()", "lib.barrier()", "lib.nothing()"),
        ("all_gather_object(7)", "lib.all_gather_object(7)", "lib.identity(7)"),
        ("all_gather_object(t)", "lib.all_gather_object(t)", "lib.identity(t)"),
        ("all_gather_object(small dict)", "lib.all_gather_object(small)", "lib.identity(small)"),
    ]
    env = {"t": torch.ones(4), "small": {"loss": 0.25, "acc": 0.5}}
    plain: Any = types.ModuleType("plain")
    plain.identity = _identity
    plain.nothing = _nothing

    def per_call(stmt: str, lib: Any) -> float:
        runs = timeit.repeat(stmt, globals={**env, "lib": lib}, number=number, repeat=repeat)
        return min(runs) / number * 1e9

    # each control is re-measured next to every row that uses it and the fastest kept:
    # one slow sample of a 40 ns call (a frequency step, another process) would flatter
    # every ratio
    bases: list[float] = []
    same: dict[str, list[float]] = {}
    rows = []
    for name, stmt, control in statements:
        bases.append(per_call("lib.identity(t)", plain))
        same.setdefault(control, []).append(per_call(control, plain))
        row: dict[str, Any] = {"case": name, "distkit_ns": per_call(stmt, dist)}
        if mm is not None:
            row["mmengine_ns"] = per_call(stmt, mm)
        elif mm_absent is not None:
            row["missing"] = {"mmengine": mm_absent.reason}
        rows.append(row)
    for row, (_, _, control) in zip(rows, statements):
        row["identity_ns"] = min(bases)
        row["same_args_ns"] = min(same[control])
    return rows


def _identity(x: Any, op: Any = None) -> Any:
    return x


def _nothing() -> None:
    return None


# -- report --------------------------------------------------------------------------------


def _not_run(row: dict, prefix: str) -> str:
    """The cell of an implementation with no figure: ``n/a``, and why if it could not run."""
    why = sorted({r for n, r in row.get("missing", {}).items() if n.startswith(prefix)})
    return f"n/a ({', '.join(why)})" if why else "n/a"


def _fmt_s(seconds: Optional[float]) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} us"


def verdict(row: dict) -> tuple[dict, str]:
    """Ratios of the row and whether its target holds."""
    sec, case = row["seconds"], row["case"]
    ours = sec["distkit"]
    ratios = {name: t / ours for name, t in sec.items() if name != "distkit"}
    if case["check"] in ("info", "debug", "check", "profile"):
        return ratios, "-"
    if case["check"] == "vs":
        if not ratios:  # no peer ran here (see the row's missing reasons)
            return ratios, "n/a"
        met = min(ratios.values()) >= case["goal"]
    else:
        if "torch" not in sec:
            return ratios, "n/a"
        met = ours / sec["torch"] <= case["goal"]
    return ratios, "yes" if met else "NO"


Table = tuple[str, list[str], list[list[str]]]  # title, columns, rows of cells


def tables(rows: list[dict], noop: list[dict], world: int) -> list[Table]:
    """The report as plain tables; :func:`report` and :func:`markdown` render them."""
    out: list[Table] = []
    memory = [r for r in rows if r["case"]["check"] == "memory"]
    rows = [r for r in rows if r["case"]["check"] != "memory"]
    if memory:
        cells = []
        for row in memory:
            payload = row["payload"]
            shown = [
                f"{row['bytes'][n] / MiB:.0f} MiB ({row['bytes'][n] / payload:.2f}x)"
                if n in row["bytes"]
                else _not_run(row, n)
                for n in ("distkit", "torch")
            ]
            met = "yes" if row["bytes"]["distkit"] <= row["case"]["goal"] * payload else "NO"
            cells.append([row["case"]["name"], *shown, row["case"]["target"], met])
        out.append(
            (
                "the receiver's peak memory growth (x the payload), each in a fresh world",
                ["case", "distkit", "torch", "target", "met"],
                cells,
            )
        )
    debug = [r for r in rows if r["case"]["check"] == "debug"]
    checked = [r for r in rows if r["case"]["check"] == "check"]
    profiled = [r for r in rows if r["case"]["check"] == "profile"]
    rows = [r for r in rows if r["case"]["check"] not in ("debug", "check", "profile")]
    for found, off_key, prefix, title, headers in (
        (
            checked,
            "check off",
            "default check: ",
            "the default check (DISTKIT_CHECK=0 turns it off): a loop of calls",
            ["call (default check)", "check off", "check on (default)", "on / off"],
        ),
        (
            profiled,
            "not profiled",
            "profile: ",
            "the communication profile (dist.profile): a loop of calls",
            ["call (profile)", "not profiled", "profiled", "profiled / not"],
        ),
    ):
        if found:  # a loop with a safeguard against the same loop without it
            cells = []
            for row in found:
                off, on = row["seconds"][off_key], row["seconds"]["distkit"]
                name = row["case"]["name"].replace(prefix, "")
                cells.append([name, _fmt_s(off), _fmt_s(on), f"{on / off:.3f}x"])
            out.append((title, headers, cells))
    if debug:
        cells = []
        for row in debug:
            off, on = row["seconds"]["debug off"], row["seconds"]["distkit"]
            name = row["case"]["name"].replace("debug mode: ", "")
            cells.append([name, _fmt_s(off), _fmt_s(on), _fmt_s(on - off)])
        out.append(
            (
                "debug mode (DISTKIT_DEBUG=1): cost per call",
                ["call (debug mode)", "debug off", "debug on", "added per call"],
                cells,
            )
        )
    if rows:
        cells = []
        for row in rows:
            sec, case = row["seconds"], row["case"]
            ratios, met = verdict(row)
            mm_names = [n for n in sec if n.startswith("mmengine")]
            bus = ""
            if row["bus"]:
                nbytes, factor = row["bus"]
                bw = [nbytes / sec[n] * factor / 1e9 for n in ("distkit", "torch")]
                bus = f"{bw[0]:.2f} / {bw[1]:.2f} GB/s"
            cells.append(
                [
                    case["name"],
                    _fmt_s(sec["distkit"]),
                    _fmt_s(sec["torch"]) if "torch" in sec else _not_run(row, "torch"),
                    " / ".join(_fmt_s(sec[n]) for n in mm_names) or _not_run(row, "mmengine"),
                    f"{ratios['torch']:.2f}x" if "torch" in ratios else "n/a",
                    " / ".join(f"{ratios[n]:.2f}x" for n in mm_names) or "n/a",
                    bus,
                    case["target"],
                    met,
                ]
            )
        out.append(
            (
                f"gloo, {world} ranks: median seconds per call (slowest rank)",
                [
                    "case",
                    "distkit",
                    "torch",
                    "mmengine",
                    "torch/distkit",
                    "mmengine/distkit",
                    "busbw distkit / torch",
                    "target",
                    "met",
                ],
                cells,
            )
        )
    if noop:
        cells = []
        for row in noop:
            base, ours = row["identity_ns"], row["distkit_ns"]
            control = row.get("same_args_ns", base)
            theirs = row.get("mmengine_ns")
            cells.append(
                [
                    f"`{row['case']}`",
                    f"{base:.0f} ns",
                    f"{control:.0f} ns",
                    f"{ours:.0f} ns ({ours / base:.1f}x, {ours / control:.1f}x)",
                    f"{theirs:.0f} ns ({theirs / base:.1f}x, {theirs / control:.1f}x)"
                    if theirs
                    else _not_run(row, "mmengine"),
                    "<= 3x",
                    "yes" if ours / control <= 3 else "NO",
                ]
            )
        out.append(
            (
                "single process, no process group: ns per call (x identity(t), x the same "
                "call of an identity)",
                [
                    "call (no process group)",
                    "identity(t)",
                    "identity, same arguments",
                    "distkit",
                    "mmengine",
                    "target",
                    "met",
                ],
                cells,
            )
        )
    return out


_LEFT = {
    "case",
    "call (debug mode)",
    "call (default check)",
    "call (profile)",
    "call (no process group)",
    "target",
    "met",
}


def report(rows: list[dict], noop: list[dict], world: int, file: Any = None) -> None:
    """Print the tables with rich."""
    from rich.console import Console
    from rich.table import Table as RichTable

    console = Console(file=file or sys.stdout, width=160)
    for title, columns, cells in tables(rows, noop, world):
        table = RichTable(title=title)
        for col in columns:
            table.add_column(col, justify="left" if col in _LEFT else "right")
        for row in cells:
            table.add_row(*(c.strip("`") for c in row))
        console.print(table)
    console.print(
        f"torch {torch.__version__}, python {sys.version.split()[0]}, {os.cpu_count()} CPUs"
    )


def markdown(rows: list[dict], noop: list[dict], world: int = 2) -> str:
    """The same tables as :func:`report`, as Markdown (for the documentation)."""
    blocks = []
    for _, columns, cells in tables(rows, noop, world):
        # documentation shows figures and ratios; the goals are the terminal report's
        keep = [i for i, c in enumerate(columns) if c not in ("target", "met")]
        columns = [columns[i] for i in keep]
        cells = [[row[i] for i in keep] for row in cells]
        align = ["---" if c in _LEFT else "---:" for c in columns]
        lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join(align) + " |"]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="distkit bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks to start (2)")
    parser.add_argument(
        "--only",
        default=None,
        help="run these groups only, comma-separated: objects, collect, tensors, debug,"
        " compile, p2p, noop; and scale (2, 4 and 8 ranks, with the cost model: not in the"
        " default run, see docs/scale.md)",
    )
    parser.add_argument(
        "--ranks",
        default=None,
        help="scale: the world sizes, comma-separated (2,4,8; --quick: 2)",
    )
    parser.add_argument(
        "--payload-mib",
        type=int,
        default=None,
        help="scale: MiB of the large objects (64; --quick: 4)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: small payloads, each call made a few times (no useful timings)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=1.0,
        help="seconds of timed calls per implementation and case (1.0)",
    )
    parser.add_argument("--json", default=None, help="also write the raw figures here")
    parser.add_argument("--markdown", default=None, help="also write the tables as Markdown")
    parser.add_argument(
        "--timeout", type=float, default=3600, help="seconds before the run counts as hung (3600)"
    )
    args = parser.parse_args(argv)

    rows: list[dict] = []
    wanted = set(args.only.split(",")) if args.only else None
    scale: list[dict] = []
    if wanted and "scale" in wanted:  # worlds of their own, one per size
        from distkit import scale_bench

        ranks = [int(n) for n in (args.ranks or ("2" if args.quick else "2,4,8")).split(",")]
        payload = (args.payload_mib or (4 if args.quick else 64)) * MiB
        scale = scale_bench.run(ranks, payload, 1 if args.quick else 3, args.timeout)
        wanted.discard("scale")
        if not wanted:
            scale_bench.report(scale)
            _write(args, scale_bench.markdown(scale), {"scale": scale})
            return 0
    if wanted != {"noop"}:
        from distkit.local.pool import RankPool

        with RankPool(args.world_size, timeout=args.timeout, pg_timeout=600) as pool:
            only = None if wanted is None or "all" in wanted else set(wanted)
            if only and "p2p" in only:
                only.add("p2p_ring")  # in this world when it has 3 ranks or more (or --quick)
            rows = pool.run(run_rank, only and ",".join(sorted(only)), args.quick, args.budget)[0]
        if wanted is None or wanted & {"all", "p2p"}:
            if args.world_size < 3 and not args.quick:  # the ring: 3 ranks of its own
                with RankPool(3, timeout=args.timeout, pg_timeout=600) as pool:
                    rows += pool.run(run_rank, "p2p_ring", args.quick, args.budget)[0]
            rows += p2p_memory_rows(args.quick, args.timeout)
    noop = []
    if wanted is None or "noop" in wanted:
        noop = noop_rows(2_000, repeat=2) if args.quick else noop_rows()
    report(rows, noop, args.world_size)
    text = markdown(rows, noop, args.world_size)
    if scale:
        from distkit import scale_bench

        scale_bench.report(scale)
        text += "\n\n" + scale_bench.markdown(scale)
    _write(args, text, {"world_size": args.world_size, "rows": rows, "noop": noop, "scale": scale})
    return 0


def _write(args: argparse.Namespace, text: str, figures: dict) -> None:
    """The Markdown tables and the raw figures, to the files ``--markdown`` and ``--json``
    name."""
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
