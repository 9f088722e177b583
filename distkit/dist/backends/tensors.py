"""The backend that runs collectives on a torch.distributed process group.

Arguments arrive checked. Tensors are staged on the group's communication device
(contiguous, e.g. a CPU tensor under nccl goes to the current GPU) and results come back
to the caller's device. Wherever a rank's result comes from itself, it is the caller's
own tensor, not a copy, exactly as in :mod:`distkit.dist.backends.single`. Collectives carry no
autograd history: they read and write through ``detach()``ed aliases, and new results do
not require grad.

The object collectives are the other half of this backend, in
:mod:`distkit.dist.backends.objects`.
"""

from __future__ import annotations

import sys
import time
from threading import get_ident
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional, TypeVar, Union

import torch
import torch.distributed as td
from torch import Tensor

from distkit import _registry, _settings
from distkit._compat import (
    all_gather_single,
    coalescing,
    has_torch_function_unary,
    is_compiling,
    reduce_scatter_single,
)
from distkit.dist.backends import p2p as _p2p
from distkit.dist.backends import uneven as _uneven
from distkit.dist.backends.base import BROADCAST_BYTES, ObjectCall, Result
from distkit.dist.backends.objects import TorchObjects
from distkit.dist.codec import wire as _wire
from distkit.dist.core import args as _args
from distkit.dist.core import layouts
from distkit.dist.core.args import fail, mean_of
from distkit.dist.core.comm import _FACTS, Comm
from distkit.dist.guard import record as _record
from distkit.dist.guard.check import peek
from distkit.dist.guard.watch import _local, _on_error, watched
from distkit.dist.handle import Handle
from distkit.utils.groups import group_ranks

if TYPE_CHECKING:
    from distkit.dist.core.args import Op

T = TypeVar("T")


# Shapes travel in fixed rows (see distkit.dist.core.layouts)
INLINE_DIMS = layouts.INLINE_DIMS
HEADER = layouts.SHAPE_ROW


# -- helpers ---------------------------------------------------------------------------


def _untracked(t: Tensor) -> Tensor:
    """``t`` without autograd tracking (the same memory)."""
    return t.detach() if t.requires_grad else t


def _stage(comm: Comm, t: Tensor) -> tuple[Tensor, bool]:
    """``t`` contiguous on the comm device, untracked; ``True`` if that took a copy."""
    t = _untracked(t)
    plain = t.is_contiguous() and not t.is_conj() and not t.is_neg()
    if plain and t.is_cpu and comm.cpu_home:  # the common gloo case, decided cheaply
        return t, False
    dev = comm.device(t)
    if plain and t.device == dev:
        return t, False
    return t.resolve_conj().resolve_neg().to(dev).contiguous(), True


def _complete(works: list[Any], finish: Callable[[], T], async_op: bool) -> Result[T]:
    if async_op:
        return Handle(works, finish)
    for w in works:
        w.wait()
    return finish()


def _works(*items: Any) -> list[Any]:
    return [w for w in items if w is not None]


def _write(data: Tensor, result: Tensor, fn: str, comm: Comm) -> None:
    """Copy ``result`` (contiguous, ``data``'s shape) into ``data`` in place.

    ``data`` may be an ``expand()``ed view whose elements share memory: then every
    memory location takes the one value the result has for all the positions that share
    it, and if the result holds different values there (ranks passed tensors expanded
    differently), that is an error rather than an arbitrary pick.
    """
    target = _untracked(data)
    if target.is_contiguous() or 0 not in target.stride():
        target.copy_(result)
        return
    index = tuple(
        slice(0, 1) if stride == 0 and n > 1 else slice(None)
        for n, stride in zip(target.shape, target.stride())
    )
    result = result.view(target.shape)
    distinct = result[index]
    if not torch.equal(distinct.expand(target.shape), result):
        fail(
            ValueError,
            fn,
            comm,
            f"data is an expand()ed view of shape {tuple(target.shape)}, and the result "
            "differs along its expanded dimensions, so it cannot be written in place",
            "Pass data.clone(), or expand the same way on every rank",
        )
    target[index].copy_(distinct)


def _reduced(data: Tensor, buf: Tensor, staged: bool, op: Op, fn: str, comm: Comm) -> Tensor:
    """Finish a reduction that ran in ``buf``: divide for mean, copy back to ``data``."""
    if op.divide:
        mean_of(buf, comm.size)
    if staged:
        _write(data, buf, fn, comm)
    return data


def _reduce_locally(chunks: Tensor, op: Op) -> Tensor:
    """Reduce ``chunks`` (one per rank, stacked on dim 0) the way the backend would."""
    name = op.name
    if name in ("sum", "mean"):
        return chunks.any(0) if chunks.dtype is torch.bool else chunks.sum(0, dtype=chunks.dtype)
    if name == "max":
        return chunks.amax(0)
    if name == "min":
        return chunks.amin(0)
    if name == "product":
        return chunks.all(0) if chunks.dtype is torch.bool else chunks.prod(0, dtype=chunks.dtype)
    combine = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[name]
    out = chunks[0].clone()
    for chunk in chunks[1:]:
        combine(out, chunk, out=out)
    return out


_header = layouts.shape_row
_parse = layouts.parse_shape_row


def _is_long(t: Tensor) -> bool:
    return t.dim() > INLINE_DIMS


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _same_dtype(fn: str, comm: Comm, dtypes: list[torch.dtype], what: str = "ranks sent") -> None:
    if any(dt != dtypes[0] for dt in dtypes):
        listing = ", ".join(f"rank {r}: {dt}" for r, dt in enumerate(dtypes))
        fail(
            TypeError,
            fn,
            comm,
            f"{what} different dtypes ({listing})",
            "Cast every rank's tensor to one dtype first",
        )


ROW_DIMS = layouts.ROW_DIMS
_row_header = layouts.row_header


def _show_rows(row: list[int]) -> str:
    """The row shape an all_to_all_single header row names."""
    ndim, dims = row[2], row[4 : 4 + ROW_DIMS]
    if ndim <= ROW_DIMS:
        return str(tuple(dims[:ndim]))
    return f"({', '.join(map(str, dims))}, ...) ({ndim} dims)"


def _same_rows(fn: str, comm: Comm, rows: list[list[int]]) -> None:
    """Every rank sent one dtype and one row shape (``rows``: the header rows received,
    which every rank receives from every rank, so all raise alike)."""
    first = rows[0][1:]
    if all(row[1:] == first for row in rows):
        return
    _same_dtype(fn, comm, [layouts.code_dtype(row[1]) for row in rows])
    if any(row[2:] != rows[0][2:] for row in rows):
        shown = [_show_rows(row) for row in rows]
        listing = ", ".join(f"rank {r}: {shape}" for r, shape in enumerate(shown))
        if len(set(shown)) == 1:  # the headers carry the first ROW_DIMS dims only
            listing += f"; they differ after dim {ROW_DIMS} of a row"
        fail(
            ValueError,
            fn,
            comm,
            f"ranks sent rows of different shapes ({listing})",
            "Every rank's data must have the same shape after dim 0 (only the row counts "
            "may differ)",
        )


def _infers_splits(
    output_split_sizes: Optional[list[int]], input_split_sizes: Optional[list[int]]
) -> bool:
    """Whether all_to_all_single learns its output sizes from the headers (bytes and
    headers through :func:`_uneven.all_to_all`)."""
    return output_split_sizes is None and input_split_sizes is not None


def _all_gather_rows(comm: Comm, row: list[int], dev: torch.device) -> list[list[int]]:
    """All-gather one small int64 row per rank (shapes, sizes)."""
    mine = torch.tensor(row, dtype=torch.int64, device=dev)
    out = torch.empty(comm.size * len(row), dtype=torch.int64, device=dev)
    all_gather_single(out, mine, group=comm.pg)
    flat = out.tolist()
    n = len(row)
    return [flat[r * n : (r + 1) * n] for r in range(comm.size)]


def _to(t: Tensor, device: torch.device) -> Tensor:
    return t if t.device == device else t.to(device)


def _gather_shapes(comm: Comm, data: Tensor, same_shape: bool, fn: str) -> list[tuple[int, ...]]:
    """Every rank's shape: ``data``'s, when promised, else one small all_gather's (and
    then every rank must send one dtype)."""
    if same_shape:
        return [tuple(data.shape)] * comm.size
    rows = _all_gather_rows(comm, _header(data), comm.device(data))
    return [shape for _, shape in _metas(comm, rows, data, fn)]


def _metas(
    comm: Comm, rows: list[list[int]], data: Tensor, fn: str
) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """``(dtype, shape)`` of every rank's header row (all-gathered): shapes longer than
    the rows hold follow in one more small all_gather, and every rank must send one dtype.
    """
    longest = max(row[1] for row in rows)
    full: list[Optional[list[int]]] = [None] * comm.size
    if longest > INLINE_DIMS:  # some rank has an over-long shape: send all shapes whole
        padded = list(data.shape) + [0] * (longest - data.dim())
        full = list(_all_gather_rows(comm, padded, comm.device(data)))
    metas = [_parse(row, f) for row, f in zip(rows, full)]
    _same_dtype(fn, comm, [m[0] for m in metas])
    return metas


_bytes = _wire.uint8_view  # the bytes of a contiguous tensor, as a 1-D uint8 view


def _as(part: Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
    """Bytes received (1-D uint8) as a tensor of ``dtype`` and ``shape``."""
    return part.view(dtype).view(shape)


def _send_failure(error: Exception, src_global: int, dev: torch.device, comm: Comm) -> None:
    """On src of a scatter: broadcast a failed header row, then the error's message (as
    the others say it: ``src (rank 0) passed bad arguments: ...``)."""
    text = _args.refused(error, "scatter", comm).encode()
    headers = torch.zeros((comm.size, HEADER), dtype=torch.int64, device=dev)
    headers[0, 0], headers[0, 1] = layouts.FAILED_ROW, len(text)
    headers[0, 2] = _args.error_code(error)
    td.broadcast(headers, src_global, group=comm.pg)
    message = torch.tensor(list(text), dtype=torch.uint8, device="cpu")
    td.broadcast(message.to(dev), src_global, group=comm.pg)


def _receive_failure(
    row: list[int], fn: str, src: int, src_global: int, dev: torch.device, comm: Comm
) -> NoReturn:
    """On the other ranks: receive the message of src's failure, and raise it."""
    message = torch.empty(row[1], dtype=torch.uint8, device=dev)
    td.broadcast(message, src_global, group=comm.pg)
    text = bytes(message.cpu().tolist()).decode(errors="replace")
    _args.remote_failure(row[2], fn, comm, f"src (rank {src}) {text}")


# -- the lean lane ---------------------------------------------------------------------------
#
# The lean lane: ``all_reduce(t)`` with every default, on a CPU group, in few steps.
#
# ``dist.all_reduce(grads)`` with no other argument is the commonest call in a training
# step with many ranks. The checked path resolves the group, checks each argument, picks a
# backend, stages the tensor and dispatches through torch's own wrapper: about 16 us of
# Python when caches are warm, but 70-110 us between gloo calls, when the process has been
# blocked and every layer runs cold. This lane does only what that call needs: the
# conditions below are each a plain attribute test, and when one fails the checked path
# runs instead (the lane never raises an argument error of its own).
#
# It keeps what the watched backend gives every collective: the thread check and call
# number of :meth:`Comm.enter` (hang reports; inlined, and when another thread holds the
# group the checked path runs and says so), the note of the call the watchdog reads, the
# debug-mode check and the default check (by stepping aside when one of them is due), and
# the mapping of backend errors to distkit's (timeouts, ranks that went away).
#
# It calls the process group's ``allreduce`` directly, as ``torch.distributed.all_reduce``
# does after its own checks, which hold here: the tensor is a plain dense CPU tensor of a
# real dtype, the group is the default one (this rank is in it), no torch function mode is
# active, and the group is not inside torch's ``_coalescing_manager``.

#: dtypes every CPU backend sums natively (gloo's narrow ones go through distkit's
#: conversions in the checked path)
_DTYPES = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})
if torch.distributed.is_available():
    _SUM: Any = torch.distributed.ReduceOp.SUM  # a RedOpType: the options convert it
    _Options = torch.distributed.AllreduceOptions
    _SYNC = hasattr(_Options(), "asyncOp")
_STRIDED = torch.strided
_DEBUG_DEFAULT = _settings.default("debug")
_CHECK_DEFAULT = _settings.default("check")
_NAME = "all_reduce"
# the call as the backend method would note it for the watchdog: (data, op, async_op)
_PARAMS = ("data", "op", "async_op")
_OP_SUM = _args.OPS["sum"]
_has_torch_function = has_torch_function_unary


def _all_reduce_lane(data: Any, pg: Any) -> Optional[Tensor]:
    """Sum ``data`` over ``pg`` (the default group, as the shortcut found it) in place and
    return it, or ``None`` when the call needs the checked path (which then runs it)."""
    world = _registry.current
    if (
        pg is None
        or is_compiling()  # first: while tracing, nothing below may touch the tensor
        or data.__class__ is not Tensor
        or not data.is_cpu
        or data.dtype not in _DTYPES
        or data.layout is not _STRIDED  # sparse, MKL-DNN: the checked path says what to do
        or data.is_nested
        or not data.is_contiguous()
        or data.is_neg()  # a lazily negated view: torch's call would reduce the raw memory
        or data.requires_grad  # the checked path detaches: autograd never sees the call
        or _has_torch_function is None
        or _has_torch_function(data)
        or getattr(_local, "depth", False)
        or _settings.values.get("debug", _DEBUG_DEFAULT)
        or coalescing(world, pg)
    ):
        return None
    facts = _FACTS.get(id(pg))
    if facts is None or facts.ref() is not pg or not facts.cpu_home or facts.broken:
        return None  # a new group (the checked path learns its facts), an accelerator's,
        # or a broken one (the checked path says so)
    group: Any = pg  # (mypy narrows pg to the weakref's Optional type above)
    me = get_ident()
    if facts.thread and facts.thread != me:
        return None  # another thread is in a collective on it: the checked path says so
    seq = facts.seq + 1
    if (
        facts.size > 1
        and _settings.values.get("check", _CHECK_DEFAULT)
        and peek(facts, seq, sys._getframe(1))
    ):
        return None  # the default check is due: the checked path runs it
    recorder = _record.active  # a profile is open (see distkit.dist.profiling)
    entered = time.time() if recorder is not None else 0.0
    # Comm.enter, inlined: this thread holds the group, and the call gets its number
    facts.thread = me
    facts.seq = seq
    facts.call = (_NAME, _NAME, _PARAMS, (data, _OP_SUM, False))
    try:
        opts: Any = _Options()  # Any: torch 2.4's stubs have no asyncOp
        opts.reduceOp = _SUM
        if _SYNC:
            opts.asyncOp = False  # as torch's own blocking call says (torch 2.7 and newer)
        group.allreduce([data], opts).wait()
    except Exception as exc:
        seq = facts.seq
        better = _on_error(Comm(pg, facts.rank, facts.size, facts.backend, facts), _NAME, seq)(exc)
        if better is not None:
            raise better from exc
        raise
    finally:
        facts.call = None
        facts.thread = 0
    if recorder is not None:
        if facts.ranks is None:
            facts.ranks = group_ranks(pg)
        recorder.add(facts.gid, facts.ranks, seq, _NAME, (data,), sys._getframe(1), entered)
    return data


# -- the backend ---------------------------------------------------------------------------


class TorchBackend(TorchObjects):
    """Collectives on a torch.distributed process group (see the module docstring)."""

    #: ``all_reduce(t)`` with every default, in few steps (see the lean lane above): the
    #: single-process shortcut of :func:`distkit.dist.all_reduce` calls it when a process
    #: group exists. Returns ``None`` when the call needs the checked path.
    lane = staticmethod(_all_reduce_lane)
    #: ``send(t, dst)`` and ``recv(src)`` with every default, likewise (their shortcuts
    #: call them when a process group exists); :data:`~distkit.dist.backends.p2p.MISS`
    #: when the call needs the checked path.
    send_lane = staticmethod(_p2p.send_lane)
    recv_lane = staticmethod(_p2p.recv_lane)

    @watched
    def all_reduce(self, comm: Comm, data: Tensor, op: Op, async_op: bool) -> Result[Tensor]:
        buf, staged = _stage(comm, data)
        work = td.all_reduce(buf, op.torch_op, group=comm.pg, async_op=async_op)
        return _complete(
            _works(work), lambda: _reduced(data, buf, staged, op, "all_reduce", comm), async_op
        )

    @watched
    def all_gather(
        self, comm: Comm, data: Tensor, async_op: bool, same_shape: bool
    ) -> Result[list[Tensor]]:
        buf, _ = _stage(comm, data)
        size, rank = comm.size, comm.rank
        if not same_shape:
            # gloo rejects uneven all_gather (pytorch#23299): the shapes travel beside the
            # bytes, at sizes predicted from the last calls (see _uneven)
            works, gathered = _uneven.all_gather(comm, _bytes(buf), _header(buf))
            # Complete now, async_op or not: finishing may take a second round and extends
            # the size history every rank must share, so it cannot wait for each rank's
            # own wait() order (which torch lets differ) without pairing up different
            # calls' second rounds or predicting different sizes for the next call.
            for work in works:
                work.wait()
            parts, rows = gathered()
            metas = _metas(comm, rows, buf, "all_gather")
            result = [
                data if r == rank else _to(_as(parts[r], *metas[r]), data.device)
                for r in range(size)
            ]
            return _complete([], lambda: result, async_op)
        shapes = [tuple(data.shape)] * size
        dev = buf.device
        numels = [_numel(s) for s in shapes]
        biggest = max(numels) * buf.element_size()

        if dev.type == "cpu" and biggest >= BROADCAST_BYTES:
            outs = [
                buf.reshape(-1)
                if r == rank
                else torch.empty(numels[r], dtype=buf.dtype, device=dev)
                for r in range(size)
            ]
            works = [
                td.broadcast(outs[r], comm.global_rank(r), group=comm.pg, async_op=True)
                for r in range(size)
            ]
            parts = outs
        else:
            longest = max(numels)
            if all(s == shapes[0] for s in shapes):
                send = buf.reshape(-1)
            else:
                send = torch.zeros(longest, dtype=buf.dtype, device=dev)
                send[: buf.numel()] = buf.reshape(-1)
            out = torch.empty(size * longest, dtype=buf.dtype, device=dev)
            works = _works(all_gather_single(out, send, group=comm.pg, async_op=async_op))
            parts = [out[r * longest : r * longest + numels[r]] for r in range(size)]

        def finish() -> list[Tensor]:
            return [
                data if r == rank else _to(parts[r].view(shapes[r]), data.device)
                for r in range(size)
            ]

        return _complete(works, finish, async_op)

    @watched
    def gather(
        self, comm: Comm, data: Tensor, dst: int, async_op: bool, same_shape: bool
    ) -> Result[list[Tensor]]:
        # Shapes go to every rank (one small all_gather), so all ranks agree on the plan
        # and a dtype mismatch fails everywhere instead of hanging the senders.
        shapes = _gather_shapes(comm, data, same_shape, "gather")
        buf, _ = _stage(comm, data)
        dev, rank, dst_global = buf.device, comm.rank, comm.global_rank(dst)
        even = all(s == shapes[0] for s in shapes)
        # the data moves as bytes (the shape round carried the real dtypes), so every dtype
        # travels: gloo refuses int16, the unsigned types wider than uint8 and float8, and
        # complex tensors in a gather (which, unlike torch's other collectives, does not
        # send them as pairs of reals)
        if rank != dst:
            if even:
                work = td.gather(
                    _bytes(buf), None, dst=dst_global, group=comm.pg, async_op=async_op
                )
            else:
                work = td.isend(_bytes(buf), dst_global, group=comm.pg)
            return _complete(_works(work), lambda: [], async_op)

        # dst's own slot is a buffer of its own: gathering into ``buf`` itself would write
        # the caller's tensor (a version bump autograd refuses; inference tensors raise)
        outs = [torch.empty(shapes[r], dtype=buf.dtype, device=dev) for r in range(comm.size)]
        if even:
            works = _works(
                td.gather(
                    _bytes(buf),
                    [_bytes(o) for o in outs],
                    dst=dst_global,
                    group=comm.pg,
                    async_op=async_op,
                )
            )
        else:
            works = [
                td.irecv(_bytes(outs[r]), comm.global_rank(r), group=comm.pg)
                for r in range(comm.size)
                if r != rank
            ]

        def finish() -> list[Tensor]:
            return [data if r == rank else _to(outs[r], data.device) for r in range(comm.size)]

        return _complete(works, finish, async_op)

    @watched
    def broadcast(self, comm: Comm, data: Tensor, src: int, async_op: bool) -> Result[Tensor]:
        buf, staged = _stage(comm, data)
        work = td.broadcast(buf, comm.global_rank(src), group=comm.pg, async_op=async_op)

        def finish() -> Tensor:
            if staged and comm.rank != src:
                _write(data, buf, "broadcast", comm)
            return data

        return _complete(_works(work), finish, async_op)

    @watched
    def reduce(self, comm: Comm, data: Tensor, dst: int, op: Op, async_op: bool) -> Result[Tensor]:
        buf, staged = _stage(comm, data)
        if comm.rank != dst and not staged:
            buf = buf.clone()  # gloo uses non-destination inputs as scratch space
        work = td.reduce(buf, comm.global_rank(dst), op.torch_op, group=comm.pg, async_op=async_op)

        def finish() -> Tensor:
            if comm.rank == dst:
                _reduced(data, buf, staged, op, "reduce", comm)
            return data

        return _complete(_works(work), finish, async_op)

    @watched
    def reduce_scatter(
        self, comm: Comm, data: Union[Tensor, list[Tensor]], op: Op, async_op: bool
    ) -> Result[Tensor]:
        size = comm.size
        if isinstance(data, list):
            home, chunk_shape = data[0].device, tuple(data[0].shape)
            staged = [_stage(comm, t)[0] for t in data]
            buf = torch.stack(staged) if staged[0].device.type == "cpu" else None
        else:
            home, chunk_shape = data.device, (data.shape[0] // size, *data.shape[1:])
            buf, _ = _stage(comm, data)
        if buf is not None and buf.device.type == "cpu":
            # On the CPU, every rank sends chunk r to rank r with one all_to_all_single and
            # reduces what it received: 1.3-1.9x faster than gloo's reduce_scatter (which
            # all-reduces everything), correct for every op (gloo's ignored op before 2.7
            # and had no list form), and the same on every torch release.
            received = torch.empty((size, *chunk_shape), dtype=buf.dtype, device="cpu")
            work = td.all_to_all_single(received, buf, group=comm.pg, async_op=async_op)

            def finish() -> Tensor:
                out = _reduce_locally(received, op)
                if op.divide:
                    mean_of(out, size)
                return _to(out, home)

            return _complete(_works(work), finish, async_op)
        if isinstance(data, list):
            chunks = [_stage(comm, t)[0] for t in data]
            out = torch.empty_like(chunks[0])
            work = td.reduce_scatter(out, chunks, op.torch_op, group=comm.pg, async_op=async_op)
        else:
            assert buf is not None
            out = torch.empty(chunk_shape, dtype=buf.dtype, device=buf.device)
            work = reduce_scatter_single(out, buf, op.torch_op, group=comm.pg, async_op=async_op)

        def finish_native() -> Tensor:
            if op.divide:
                mean_of(out, size)
            return _to(out, home)

        return _complete(_works(work), finish_native, async_op)

    @watched
    def all_to_all(
        self, comm: Comm, data: list[Tensor], async_op: bool, same_shape: bool
    ) -> Result[list[Tensor]]:
        # gloo rejects uneven all_to_all lists, and its list all_to_all is 10-25% slower
        # than all_to_all_single even for equal shapes (measured on this project's
        # machine): everything goes as one flat buffer with per-rank split sizes; uneven
        # shapes travel beside the bytes, at sizes predicted from the last calls
        fn, size, rank = "all_to_all", comm.size, comm.rank
        staged = [_stage(comm, t)[0] for t in data]
        dev, home = staged[0].device, data[0].device
        if not same_shape:
            long = any(_is_long(t) for t in staged)
            rows = [_header(t, long) for t in staged]
            parts, got = _uneven.all_to_all(comm, [_bytes(t) for t in staged], rows)
            full = self._long_shapes(comm, staged, got, dev) if any(r[2] for r in got) else None
            metas = [_parse(row, f) for row, f in zip(got, full or [None] * size)]
            # metas[rank] is this rank's own chunk: its dtype is compared too
            _same_dtype(fn, comm, [m[0] for m in metas], what="ranks sent this rank")
            out = [
                data[s] if s == rank else _to(_as(parts[s], *metas[s]), home) for s in range(size)
            ]
            return _complete([], lambda: out, async_op)
        metas = [(staged[0].dtype, tuple(staged[0].shape))] * size
        # this rank's own chunk comes back as passed: it is neither copied into the send
        # buffer nor through the collective (at 2 ranks, half of what the call moved)
        in_numels = [0 if r == rank else t.numel() for r, t in enumerate(staged)]
        out_numels = [0 if r == rank else _numel(s) for r, (_, s) in enumerate(metas)]
        others = [t.reshape(-1) for r, t in enumerate(staged) if r != rank]
        if len(others) == 1:  # 2 ranks: the peer's chunk itself, no copy
            send = others[0]
        else:  # a group of one rank sends nothing
            send = torch.cat(others) if others else staged[0].reshape(-1)[:0]
        recv = torch.empty(sum(out_numels), dtype=send.dtype, device=dev)
        work = td.all_to_all_single(
            recv, send, out_numels, in_numels, group=comm.pg, async_op=async_op
        )

        def finish() -> list[Tensor]:
            parts = recv.split(out_numels)
            return [
                data[r] if r == rank else _to(parts[r].view(metas[r][1]), home) for r in range(size)
            ]

        return _complete(_works(work), finish, async_op)

    @staticmethod
    def _long_shapes(
        comm: Comm, staged: list[Tensor], rows: list[list[int]], dev: torch.device
    ) -> list[Optional[list[int]]]:
        """The whole shapes of over-long tensors sent here, in one small all_to_all.

        Every rank takes this round when some rank's header rows carry the "long" flag,
        which every rank sees in the row it received from that rank.
        """
        out_sizes = [row[1] if row[1] > INLINE_DIMS else 0 for row in rows]
        sends = [
            torch.tensor(t.shape, dtype=torch.int64, device="cpu") for t in staged if _is_long(t)
        ]
        send = torch.cat(sends).to(dev) if sends else torch.empty(0, dtype=torch.int64, device=dev)
        in_sizes = [t.dim() if _is_long(t) else 0 for t in staged]
        recv = torch.empty(sum(out_sizes), dtype=torch.int64, device=dev)
        td.all_to_all_single(recv, send, out_sizes, in_sizes, group=comm.pg)
        return [part.tolist() for part in recv.split(out_sizes)]

    @watched
    def all_to_all_single(
        self,
        comm: Comm,
        data: Tensor,
        output_split_sizes: Optional[list[int]],
        input_split_sizes: Optional[list[int]],
        async_op: bool,
    ) -> Result[Tensor]:
        buf, _ = _stage(comm, data)
        rows = buf.shape[0] if buf.dim() else 0
        if _infers_splits(output_split_sizes, input_split_sizes):
            assert input_split_sizes is not None
            # the row counts travel beside the rows, at sizes predicted from the last
            # calls, with the dtype and row shape, which every rank checks before any
            # second round moves more data
            pieces = [_bytes(p) for p in buf.split(input_split_sizes)]
            same = _row_header(buf)
            heads = [[n, *same] for n in input_split_sizes]
            parts, got = _uneven.all_to_all(
                comm,
                pieces,
                heads,
                "all_to_all_single",
                lambda got: _same_rows("all_to_all_single", comm, got),
            )
            row_shape = tuple(buf.shape[1:])
            # the counts come from the headers: rows of 0 bytes have a count too
            out = torch.cat([_as(p, buf.dtype, (h[0], *row_shape)) for p, h in zip(parts, got)])
            return _complete([], lambda: _to(out, data.device), async_op)
        if output_split_sizes is None:
            output_split_sizes = [rows // comm.size] * comm.size
        out = torch.empty(
            (sum(output_split_sizes), *buf.shape[1:]), dtype=buf.dtype, device=buf.device
        )
        work = td.all_to_all_single(
            out, buf, output_split_sizes, input_split_sizes, group=comm.pg, async_op=async_op
        )
        return _complete(_works(work), lambda: _to(out, data.device), async_op)

    @watched
    def scatter(
        self,
        comm: Comm,
        data: Optional[list[Tensor]],
        src: int,
        async_op: bool,
        error: Optional[Exception] = None,
    ) -> Result[Tensor]:
        rank = comm.rank
        # data is src's alone (checked there; ignored, whatever it is, elsewhere)
        dev = comm.device(data[0] if error is None and rank == src and data else None)
        src_global = comm.global_rank(src)
        if error is not None:  # src's own arguments were bad: tell everyone, then raise
            _send_failure(error, src_global, dev, comm)
            raise error
        if rank == src:
            assert data is not None  # checked on src
            staged = [_stage(comm, t)[0] for t in data]
            rows = [_header(t) for t in staged]
            headers = torch.tensor(rows, dtype=torch.int64, device=dev)
        else:
            headers = torch.empty((comm.size, HEADER), dtype=torch.int64, device=dev)
        td.broadcast(headers, src_global, group=comm.pg)
        rows = headers.tolist()
        if rows[0][0] == layouts.FAILED_ROW:  # src failed before sending anything
            _receive_failure(rows[0], "scatter", src, src_global, dev, comm)
        longest = max(row[1] for row in rows)
        full: list[Optional[list[int]]] = [None] * comm.size
        if longest > INLINE_DIMS:  # an over-long shape: src sends every shape whole
            shapes = torch.zeros((comm.size, longest), dtype=torch.int64, device=dev)
            if rank == src:
                for r, t in enumerate(staged):
                    shapes[r, : t.dim()] = torch.tensor(t.shape, dtype=torch.int64, device=dev)
            td.broadcast(shapes, src_global, group=comm.pg)
            full = shapes.tolist()
        metas = [_parse(row, f) for row, f in zip(rows, full)]
        even = all(m == metas[0] for m in metas)
        # the data moves as bytes: the headers carry dtypes and shapes, and any dtype
        # travels (gloo refuses int16, uint16 and wider, float8)
        if rank == src:
            assert data is not None
            if even:
                out = torch.empty_like(_bytes(staged[src]))
                send = [_bytes(t) for t in staged]
                works = _works(
                    td.scatter(out, send, src=src_global, group=comm.pg, async_op=async_op)
                )
            else:
                works = [
                    td.isend(_bytes(staged[r]), comm.global_rank(r), group=comm.pg)
                    for r in range(comm.size)
                    if r != rank
                ]
            own = data[src]
            return _complete(works, lambda: own, async_op)
        dtype, shape = metas[rank]
        received = torch.empty(shape, dtype=dtype, device=dev)
        if even:
            work = td.scatter(
                _bytes(received), None, src=src_global, group=comm.pg, async_op=async_op
            )
        else:
            work = td.irecv(_bytes(received), src_global, group=comm.pg)
        return _complete(_works(work), lambda: received, async_op)

    @watched
    def barrier(self, comm: Comm) -> None:
        dev = comm.device()
        if dev.type == "cuda":
            td.barrier(group=comm.pg, device_ids=[dev.index])
        else:
            td.barrier(group=comm.pg)

    # -- point to point (see distkit.dist.backends.p2p) -------------------------------

    @watched
    def send(
        self, comm: Comm, data: Any, dst: int, tag: int, async_op: bool, call: ObjectCall
    ) -> Result[None]:
        if not async_op and _p2p.send_fast(comm, data, dst, tag, call.fn):
            return None
        waiter = _p2p.start(comm, call.fn, {dst: data}, [], tag, call, not async_op)
        return _p2p.result(waiter, async_op, lambda: None)

    @watched
    def recv(self, comm: Comm, src: int, tag: int, async_op: bool, call: ObjectCall) -> Result[Any]:
        if not async_op:
            got = _p2p.recv_fast(comm, src, tag, call)
            if got is not _p2p.MISS:
                return got
        waiter = _p2p.start(comm, call.fn, {}, [src], tag, call, not async_op)
        return _p2p.result(waiter, async_op, lambda: waiter.results[src])

    @watched
    def exchange(
        self, comm: Comm, sends: dict[int, Any], recv_from: list[int], tag: int, call: ObjectCall
    ) -> dict[int, Any]:
        waiter = _p2p.start(comm, call.fn, sends, recv_from, tag, call, True)
        waiter.wait()
        me = comm.rank
        return {src: sends[src] if src == me else waiter.results[src] for src in recv_from}


TORCH = TorchBackend()
