"""The backend that runs collectives on a torch.distributed process group.

Arguments arrive checked. Tensors are staged on the group's communication device
(contiguous, e.g. a CPU tensor under nccl goes to the current GPU) and results come back
to the caller's device. Wherever a rank's result comes from itself, it is the caller's
own tensor, not a copy, exactly as in :mod:`distkit.dist._single`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as td
from torch import Tensor

from distkit._compat import all_gather_single, reduce_scatter_single
from distkit.dist._checks import Op, fail
from distkit.dist._handle import Handle
from distkit.dist._watch import watched
from distkit.dist._torch_objects import (  # noqa: F401  (the object half of this backend)
    all_gather_object,
    all_to_all_object,
    broadcast_object,
    gather_object,
    scatter_object,
)

# gloo's ring all_gather moves large tensors 3-4x slower than one broadcast per rank
# (measured on this project's 2-core CI machine: 32 MiB x 2 ranks, 83 ms vs 22 ms), and
# broadcasts need no padding when shapes differ. CPU backends switch above this size.
BROADCAST_GATHER_BYTES = 256 * 1024

MAX_DIMS = 25
HEADER = 2 + MAX_DIMS  # dtype code, ndim, shape
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


# -- helpers ---------------------------------------------------------------------------


def _stage(comm: Any, t: Tensor) -> tuple[Tensor, bool]:
    """``t`` contiguous on the comm device; ``True`` if that took a copy."""
    plain = t.is_contiguous() and not t.is_conj() and not t.is_neg()
    if plain and t.is_cpu and comm.cpu_home:  # the common gloo case, decided cheaply
        return t, False
    dev = comm.device(t)
    if plain and t.device == dev:
        return t, False
    return t.detach().resolve_conj().resolve_neg().to(dev).contiguous(), True


def _complete(works: list, finish: Callable[[], Any], async_op: bool) -> Any:
    if async_op:
        return Handle(works, finish)
    for w in works:
        w.wait()
    return finish()


def _works(*items: Any) -> list:
    return [w for w in items if w is not None]


def _header(t: Tensor, fn: str, comm: Any) -> list[int]:
    if t.dim() > MAX_DIMS:
        fail(ValueError, fn, comm, f"tensors of more than {MAX_DIMS} dims are not supported")
    return [_DTYPE_CODE[t.dtype], t.dim(), *t.shape, *([0] * (MAX_DIMS - t.dim()))]


def _parse(row: list[int]) -> tuple[torch.dtype, tuple[int, ...]]:
    return _DTYPES[row[0]], tuple(row[2 : 2 + row[1]])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _same_dtype(fn: str, comm: Any, dtypes: list[torch.dtype], what: str = "ranks sent") -> None:
    if any(dt != dtypes[0] for dt in dtypes):
        listing = ", ".join(f"rank {r}: {dt}" for r, dt in enumerate(dtypes))
        fail(TypeError, fn, comm, f"{what} different dtypes ({listing})",
             "Cast every rank's tensor to one dtype first")


def _all_gather_rows(comm: Any, row: list[int], dev: torch.device) -> list[list[int]]:
    """All-gather one small int64 row per rank (shapes, sizes)."""
    mine = torch.tensor(row, dtype=torch.int64, device=dev)
    out = torch.empty(comm.size * len(row), dtype=torch.int64, device=dev)
    all_gather_single(out, mine, group=comm.pg)
    flat = out.tolist()
    n = len(row)
    return [flat[r * n : (r + 1) * n] for r in range(comm.size)]


def _to(t: Tensor, device: torch.device) -> Tensor:
    return t if t.device == device else t.to(device)


# -- tensor collectives ------------------------------------------------------------------


@watched("all_reduce")
def all_reduce(comm: Any, data: Tensor, op: Op, async_op: bool) -> Any:
    buf, staged = _stage(comm, data)
    work = td.all_reduce(buf, op.torch_op, group=comm.pg, async_op=async_op)

    def finish() -> Tensor:
        if op.divide:
            buf.div_(comm.size)
        if staged:
            data.copy_(buf)
        return data

    return _complete(_works(work), finish, async_op)


def _gather_sizes(comm: Any, data: Tensor, fn: str) -> list[tuple[torch.dtype, tuple]]:
    dev = comm.device(data)
    rows = _all_gather_rows(comm, _header(data, fn, comm), dev)
    metas = [_parse(r) for r in rows]
    _same_dtype(fn, comm, [m[0] for m in metas])
    return metas


@watched("all_gather")
def all_gather(comm: Any, data: Tensor, async_op: bool, same_shape: bool) -> Any:
    # gloo rejects uneven all_gather (pytorch#23299): exchange shapes, then either
    # broadcast each rank's exact bytes (large, CPU) or pad to the largest and trim.
    if same_shape:
        shapes = [tuple(data.shape)] * comm.size
    else:
        shapes = [s for _, s in _gather_sizes(comm, data, "all_gather")]
    buf, _ = _stage(comm, data)
    dev, size, rank = buf.device, comm.size, comm.rank
    numels = [_numel(s) for s in shapes]
    biggest = max(numels) * buf.element_size()

    if dev.type == "cpu" and biggest >= BROADCAST_GATHER_BYTES:
        outs = [
            buf.reshape(-1) if r == rank else torch.empty(numels[r], dtype=buf.dtype, device=dev)
            for r in range(size)
        ]
        works = [
            td.broadcast(outs[r], comm.global_rank(r), group=comm.pg, async_op=True)
            for r in range(size)
        ]

        def finish() -> list[Tensor]:
            return [
                data if r == rank else _to(outs[r].view(shapes[r]), data.device)
                for r in range(size)
            ]

        return _complete(works, finish, async_op)

    if all(s == shapes[0] for s in shapes):
        n = buf.numel()
        out = torch.empty(size * n, dtype=buf.dtype, device=dev)
        work = all_gather_single(out, buf.reshape(-1), group=comm.pg, async_op=async_op)

        def finish() -> list[Tensor]:
            return [
                data if r == rank else _to(out[r * n : (r + 1) * n].view(shapes[r]), data.device)
                for r in range(size)
            ]

        return _complete(_works(work), finish, async_op)

    longest = max(numels)
    send = torch.zeros(longest, dtype=buf.dtype, device=dev)
    send[: buf.numel()] = buf.reshape(-1)
    out = torch.empty(size * longest, dtype=buf.dtype, device=dev)
    work = all_gather_single(out, send, group=comm.pg, async_op=async_op)

    def finish() -> list[Tensor]:
        return [
            data
            if r == rank
            else _to(out[r * longest : r * longest + numels[r]].view(shapes[r]), data.device)
            for r in range(size)
        ]

    return _complete(_works(work), finish, async_op)


@watched("gather")
def gather(comm: Any, data: Tensor, dst: int, async_op: bool, same_shape: bool) -> Any:
    # Shapes go to every rank (one small all_gather), so all ranks agree on the plan and
    # a dtype mismatch fails everywhere instead of hanging the senders.
    if same_shape:
        shapes = [tuple(data.shape)] * comm.size
    else:
        shapes = [s for _, s in _gather_sizes(comm, data, "gather")]
    buf, _ = _stage(comm, data)
    dev, rank, dst_global = buf.device, comm.rank, comm.global_rank(dst)
    if rank != dst:
        if all(s == shapes[0] for s in shapes):
            work = td.gather(buf, None, dst=dst_global, group=comm.pg, async_op=async_op)
        else:
            work = td.isend(buf.reshape(-1), dst_global, group=comm.pg)
        return _complete(_works(work), lambda: [], async_op)

    outs = [
        buf if r == rank else torch.empty(shapes[r], dtype=buf.dtype, device=dev)
        for r in range(comm.size)
    ]
    if all(s == shapes[0] for s in shapes):
        works = _works(td.gather(buf, outs, dst=dst_global, group=comm.pg, async_op=async_op))
    else:
        works = [
            td.irecv(outs[r].reshape(-1), comm.global_rank(r), group=comm.pg)
            for r in range(comm.size)
            if r != rank
        ]

    def finish() -> list[Tensor]:
        return [data if r == rank else _to(outs[r], data.device) for r in range(comm.size)]

    return _complete(works, finish, async_op)


@watched("broadcast")
def broadcast(comm: Any, data: Tensor, src: int, async_op: bool) -> Any:
    buf, staged = _stage(comm, data)
    work = td.broadcast(buf, comm.global_rank(src), group=comm.pg, async_op=async_op)

    def finish() -> Tensor:
        if staged and comm.rank != src:
            data.copy_(buf)
        return data

    return _complete(_works(work), finish, async_op)


@watched("reduce")
def reduce(comm: Any, data: Tensor, dst: int, op: Op, async_op: bool) -> Any:
    buf, staged = _stage(comm, data)
    if comm.rank != dst and not staged:
        buf = buf.clone()  # gloo uses non-destination inputs as scratch space
    work = td.reduce(buf, comm.global_rank(dst), op.torch_op, group=comm.pg, async_op=async_op)

    def finish() -> Tensor:
        if comm.rank == dst:
            if op.divide:
                buf.div_(comm.size)
            if staged:
                data.copy_(buf)
        return data

    return _complete(_works(work), finish, async_op)


@watched("reduce_scatter")
def reduce_scatter(comm: Any, data: Union[Tensor, list], op: Op, async_op: bool) -> Any:
    if isinstance(data, list):
        chunks = [_stage(comm, t)[0] for t in data]
        home = data[0].device
        out = torch.empty_like(chunks[0])
        work = td.reduce_scatter(out, chunks, op.torch_op, group=comm.pg, async_op=async_op)
    else:
        buf, _ = _stage(comm, data)
        home = data.device
        out = torch.empty(
            (buf.shape[0] // comm.size, *buf.shape[1:]), dtype=buf.dtype, device=buf.device
        )
        work = reduce_scatter_single(out, buf, op.torch_op, group=comm.pg, async_op=async_op)

    def finish() -> Tensor:
        if op.divide:
            out.div_(comm.size)
        return _to(out, home)

    return _complete(_works(work), finish, async_op)


@watched("all_to_all")
def all_to_all(comm: Any, data: list, async_op: bool, same_shape: bool) -> Any:
    # gloo rejects uneven all_to_all lists, and its list all_to_all is 10-25% slower than
    # all_to_all_single even for equal shapes (measured on this project's machine): send
    # the shapes first (one small all_to_all, skipped with same_shape), then everything as
    # one flat buffer with per-rank split sizes.
    fn, size, rank = "all_to_all", comm.size, comm.rank
    staged = [_stage(comm, t)[0] for t in data]
    dev, home = staged[0].device, data[0].device
    if same_shape:
        metas = [(staged[0].dtype, tuple(staged[0].shape))] * size
    else:
        headers = torch.tensor([_header(t, fn, comm) for t in staged], dtype=torch.int64, device=dev)
        incoming = torch.empty_like(headers)
        td.all_to_all_single(incoming, headers, group=comm.pg)
        metas = [_parse(r) for r in incoming.tolist()]
        _same_dtype(fn, comm, [m[0] for m in metas] + [staged[0].dtype], what="ranks sent this rank")
    in_numels = [t.numel() for t in staged]
    out_numels = [_numel(s) for _, s in metas]
    send = torch.cat([t.reshape(-1) for t in staged]) if size > 1 else staged[0].reshape(-1)
    recv = torch.empty(sum(out_numels), dtype=send.dtype, device=dev)
    work = td.all_to_all_single(recv, send, out_numels, in_numels, group=comm.pg, async_op=async_op)

    def finish() -> list[Tensor]:
        parts = recv.split(out_numels)
        return [data[r] if r == rank else _to(parts[r].view(metas[r][1]), home) for r in range(size)]

    return _complete(_works(work), finish, async_op)


@watched("all_to_all_single")
def all_to_all_single(
    comm: Any,
    data: Tensor,
    output_split_sizes: Optional[list],
    input_split_sizes: Optional[list],
    async_op: bool,
) -> Any:
    buf, _ = _stage(comm, data)
    rows = buf.shape[0] if buf.dim() else 0
    if output_split_sizes is None:
        if input_split_sizes is None:
            output_split_sizes = [rows // comm.size] * comm.size
        else:
            sizes = torch.tensor(input_split_sizes, dtype=torch.int64, device=buf.device)
            received = torch.empty_like(sizes)
            td.all_to_all_single(received, sizes, group=comm.pg)
            output_split_sizes = received.tolist()
    out = torch.empty(
        (sum(output_split_sizes), *buf.shape[1:]), dtype=buf.dtype, device=buf.device
    )
    work = td.all_to_all_single(
        out, buf, output_split_sizes, input_split_sizes, group=comm.pg, async_op=async_op
    )
    return _complete(_works(work), lambda: _to(out, data.device), async_op)


@watched("scatter")
def scatter(comm: Any, data: Optional[list], src: int, async_op: bool) -> Any:
    fn, rank = "scatter", comm.rank
    dev = comm.device(data[0] if data else None)
    src_global = comm.global_rank(src)
    staged = [_stage(comm, t)[0] for t in data] if rank == src else None  # type: ignore[union-attr]
    if rank == src:
        headers = torch.tensor([_header(t, fn, comm) for t in staged], dtype=torch.int64,
                               device=dev)
    else:
        headers = torch.empty((comm.size, HEADER), dtype=torch.int64, device=dev)
    td.broadcast(headers, src_global, group=comm.pg)
    metas = [_parse(r) for r in headers.tolist()]
    even = all(m == metas[0] for m in metas)
    if rank == src:
        if even:
            out = torch.empty_like(staged[src])  # type: ignore[index]
            work = td.scatter(out, staged, src=src_global, group=comm.pg, async_op=async_op)
            works = _works(work)
        else:
            works = [
                td.isend(staged[r].reshape(-1), comm.global_rank(r), group=comm.pg)  # type: ignore[index]
                for r in range(comm.size)
                if r != rank
            ]
        return _complete(works, lambda: data[src], async_op)  # type: ignore[index]
    dtype, shape = metas[rank]
    out = torch.empty(shape, dtype=dtype, device=dev)
    if even:
        work = td.scatter(out, None, src=src_global, group=comm.pg, async_op=async_op)
    else:
        work = td.irecv(out.reshape(-1), src_global, group=comm.pg)
    return _complete(_works(work), lambda: out, async_op)


@watched("barrier")
def barrier(comm: Any) -> None:
    dev = comm.device()
    if dev.type == "cuda":
        td.barrier(group=comm.pg, device_ids=[dev.index])
    else:
        td.barrier(group=comm.pg)

