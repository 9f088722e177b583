"""Collecting the results of a distributed evaluation, in dataset order."""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Generator, Iterable, Iterator, Sequence
from itertools import chain, zip_longest
from types import TracebackType
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from distkit.dist._route import resolve, untraced
from distkit.dist.backends import stream as _stream
from distkit.dist.backends.base import ObjectCall
from distkit.dist.codec import policy
from distkit.dist.codec import wire as _wire
from distkit.dist.core import args as _args
from distkit.dist.core import layouts
from distkit.dist.core.comm import Comm, GroupLike
from distkit.dist.errors import CollectiveMismatchError
from distkit.dist.guard import record as _record
from distkit.utils.console import track

ORDERS = ("interleaved", "contiguous")
#: Results per rank moved in one round: bounds memory per round, and paces the progress bar.
CHUNK_ITEMS = 65536
#: Default bytes of other ranks' results that ``iter_results`` holds on ``dst`` at once.
CHUNK_BYTES = 32 * 1024 * 1024
#: Results a rank encodes together in one message of ``iter_results`` (a larger result
#: travels alone): ``dst`` decodes one pack at a time.
PACK_BYTES = 1024 * 1024
#: Why the calls here run eagerly under torch.compile (see distkit.dist._route.untraced).
_PICKLES = "pickles objects, which cannot be traced"


def _ordered(parts: list[list], size: int, order: str, fn: str, comm: Comm) -> list:
    """Merge per-rank result lists into dataset order and cut them to ``size``."""
    if order == "contiguous":
        merged = list(chain.from_iterable(parts))
    elif len({len(p) for p in parts}) <= 1:  # the DistributedSampler case: equal shards
        merged = list(chain.from_iterable(zip(*parts)))
    else:
        gap = object()
        rounds = chain.from_iterable(zip_longest(*parts, fillvalue=gap))
        merged = [item for item in rounds if item is not gap]
    if len(merged) < size:
        counts = ", ".join(f"rank {r}: {len(p)}" for r, p in enumerate(parts))
        _args.fail(
            ValueError,
            fn,
            comm,
            f"the ranks returned {len(merged)} results in total ({counts}), fewer than size={size}",
            "Every sample must be evaluated by some rank: use a sampler without drop_last, "
            "or pass the number of samples actually evaluated as size",
        )
    return merged[:size]


def _by_index(parts: list[list], index_parts: list[list], size: int, fn: str, comm: Comm) -> list:
    """Place each result at its dataset index; the first copy of a repeated index wins."""
    out: list = [None] * size
    seen = [False] * size
    for r, (part, idx) in enumerate(zip(parts, index_parts)):
        for item, i in zip(part, idx):
            if not 0 <= i < size:
                _args.fail(
                    ValueError,
                    fn,
                    comm,
                    f"rank {r} reported dataset index {i}, outside 0..{size - 1}",
                )
            if not seen[i]:
                seen[i] = True
                out[i] = item
    missing = [i for i, s in enumerate(seen) if not s]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        _args.fail(
            ValueError,
            fn,
            comm,
            f"{len(missing)} dataset indices were evaluated by no rank: {shown}",
        )
    return out


def _sampler_indices(sampler: Any, results: Sequence, fn: str, comm: Comm) -> list[int]:
    """The dataset indices ``sampler`` gives this rank, in its order (one per result)."""
    from torch.utils.data import DistributedSampler

    if not isinstance(sampler, DistributedSampler) and not hasattr(sampler, "set_epoch"):
        _args.fail(
            TypeError,
            fn,
            comm,
            f"sampler must be a DistributedSampler (or a sampler with set_epoch whose order "
            f"depends only on its seed and epoch), got {_args.show(sampler)}",
            "For another sampler, record the dataset index of each result and pass "
            "indices= (e.g. the indices your dataset returns with each sample)",
        )
    indices = list(sampler)
    if len(indices) != len(results):
        _args.fail(
            ValueError,
            fn,
            comm,
            f"the sampler gives this rank {len(indices)} dataset indices but results has "
            f"{len(results)} entries",
            "Give one result per index the sampler yields, in its order (and do not call "
            "sampler.set_epoch between evaluating and collecting)",
        )
    return indices


def _integers(indices: list[Any], fn: str, comm: Comm) -> list[int]:
    """``indices`` as Python ints (NumPy and 0-dim tensor integers converted); anything
    else, a float or a bool among them, is a ``TypeError`` here, before any round."""
    if all(type(i) is int for i in indices):
        return indices
    out = []
    for k, i in enumerate(indices):
        try:
            if isinstance(i, bool):
                raise TypeError
            out.append(operator.index(i))
        except TypeError:
            _args.fail(
                TypeError,
                fn,
                comm,
                f"indices[{k}] must be an integer dataset index, got {_args.show(i)}",
            )
    return out


def _mixed(fn: str, comm: Comm, other: int, receiver: str) -> ValueError:
    """The error of a rank that passed indices (or a sampler) where another did not."""
    try:
        _args.fail(
            ValueError,
            fn,
            comm,
            f"rank {other} and {receiver} disagree: one passed indices (or sampler), the "
            "other did not",
            "Pass indices (or sampler) on every rank or on none",
        )
    except ValueError as exc:
        return exc


def _check(
    fn: str,
    comm: Comm,
    results: Any,
    size: Any,
    order: str,
    indices: Optional[Sequence[int]],
    sampler: Any,
) -> Optional[list[int]]:
    """The checks both collectors run before any communication; the indices to use."""
    if isinstance(results, (str, bytes)) or not isinstance(results, Sequence):
        _args.fail(TypeError, fn, comm, f"results must be a list, got {_args.show(results)}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        _args.fail(TypeError, fn, comm, f"size must be a non-negative int, got {_args.show(size)}")
    if sampler is not None:
        if indices is not None:
            _args.fail(
                ValueError,
                fn,
                comm,
                "both sampler and indices were given",
                "Pass one: indices are read from the sampler",
            )
        return _sampler_indices(sampler, results, fn, comm)
    if indices is not None:
        indices = list(indices)
        if len(indices) != len(results):
            _args.fail(
                ValueError,
                fn,
                comm,
                f"indices has {len(indices)} entries but results has {len(results)}",
                "Give one dataset index per result",
            )
        return _integers(indices, fn, comm)
    if order not in ORDERS:
        _args.fail(
            ValueError,
            fn,
            comm,
            f"unknown order {order!r}",
            f"Use one of {', '.join(ORDERS)}, or pass indices",
        )
    return None


class _Checked(NamedTuple):
    """The arguments both collectors check before any communication, checked."""

    indices: Optional[list[int]]
    serializer: str
    chunk_bytes: int
    refused: Optional[Exception]  # on a group: this rank's error, raised after telling
    dst: Optional[int]  # checked (a refused one: 0, the default, to take part with)


def _checked(
    fn: str,
    comm: Comm,
    results: Any,
    size: Any,
    order: str,
    indices: Optional[Sequence[int]],
    sampler: Any,
    serializer: Optional[str],
    dst: Any,
    chunk_bytes: Any = CHUNK_BYTES,
    dst_may_be_none: bool = True,
) -> _Checked:
    """:func:`_check`, the serializer, ``dst`` (``None``, where it may be: every rank
    receives) and ``chunk_bytes``; on a group of several ranks an error they raise is
    kept, for this rank to raise once it has told the others in the call's first round:
    raised at once, it left them waiting in that round, to pair it with this rank's next
    call (defaults stand in for the arguments meanwhile, dst 0 for a refused ``dst``)."""
    dst_error: Optional[Exception] = None
    try:
        if dst is not None or not dst_may_be_none:
            dst = _args.rank(dst, "dst", fn, comm)
    except Exception as exc:  # raised in its turn below, after the other arguments'
        dst, dst_error = 0, exc
    try:
        checked = _check(fn, comm, results, size, order, indices, sampler)
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            _args.fail(
                TypeError,
                fn,
                comm,
                f"chunk_bytes must be a positive int, got {_args.show(chunk_bytes)}",
            )
        name = policy.serializer_of(serializer, fn, comm)
        if dst_error is not None:
            raise dst_error
        return _Checked(checked, name, chunk_bytes, None, dst)
    except Exception as exc:  # a sampler or a results sequence may raise anything
        if comm.alone:
            raise
        return _Checked(None, policy.serializer_of(None, fn, comm), CHUNK_BYTES, exc, dst)


@untraced("collect_results", _PICKLES)
def collect_results(
    results: Sequence,
    size: int,
    device: Optional[str] = None,
    tmpdir: Optional[str] = None,
    *,
    dst: Optional[int] = 0,
    group: GroupLike = None,
    order: str = "interleaved",
    indices: Optional[Sequence[int]] = None,
    serializer: Optional[str] = None,
    sampler: Any = None,
) -> Optional[list]:
    """Collect every rank's evaluation results, in dataset order, exactly ``size`` of them.

    Collective: every rank in ``group`` must call this.
    Single process: returns the first ``size`` results (reordered by ``indices`` if given).

    **A shuffling sampler needs** ``sampler=`` **(or** ``indices=``**).** Without them the
    results are placed by rank and position alone, which cannot tell a shuffled shard
    from an ordered one: the results come back shuffled and nothing fails. Pass the
    evaluation's ``DistributedSampler`` as ``sampler=`` and its own order puts every
    result back at its dataset index (``examples/eval.py --shuffle``).

    How the dataset was split decides the order; say which:

    - ``order="interleaved"`` (default): ``torch.utils.data.DistributedSampler`` without
      shuffling, where rank r evaluates samples r, r + n, r + 2n, ... and the last ranks
      repeat the first samples to even out the shards. Results are merged round-robin;
      the repeats fall past ``size`` and are cut.
    - ``order="contiguous"``: rank r evaluated one contiguous block, blocks in rank order.
    - ``sampler``: the ``DistributedSampler`` (shuffling or not) that gave this rank its
      samples; its indices, ``list(sampler)``, are used as ``indices``. Do not call
      ``sampler.set_epoch`` between evaluating and collecting.
    - ``indices``: the dataset index of each of this rank's results. Each result goes
      to its index; repeated indices keep the first result; every index below ``size``
      must be present.

    Results that are ``None`` are kept. No temporary directory is ever used: results
    travel through the object collectives (tensors in them as raw bytes), in rounds of
    ``CHUNK_ITEMS`` results per rank; when that takes more than a second, the receiving
    process shows a progress bar. ``results`` may be any sequence: one that is not a
    list or tuple (a lazy dataset of predictions) is read one result at a time.

    Each round ends with a small status from ``dst`` (from every rank with
    ``dst=None``), so an error anywhere raises on every rank within seconds, and no rank
    goes on to its next collective with a round left behind: a rank whose result cannot
    be read or pickled, or whose arguments are wrong (``indices`` of another length than
    its results, say), raises its own error and the others one naming it; an object the
    ``safe`` serializer refuses raises ``UnsafeObjectError`` on every rank, naming the
    rank that sent it.

    Args:
        results: This rank's results, in the order it evaluated its samples.
        size: Number of samples in the dataset.
        device: Accepted for mmengine compatibility (``"cpu"``/``"gpu"``) and ignored:
            tensors in the results travel on the backend's device either way.
        tmpdir: Accepted for mmengine compatibility and ignored.
        dst: Rank (within ``group``) that gets the results; ``None`` gives them to every
            rank, and then every rank must pass the same ``size`` and ``order``.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        order: ``interleaved`` or ``contiguous``; ignored when ``indices`` is given.
        indices: Dataset index of each of this rank's results.
        serializer: ``pickle`` or ``safe`` for the results received (see
            :func:`~distkit.dist.set_serializer`).
        sampler: The ``DistributedSampler`` this rank evaluated with (or a sampler with
            ``set_epoch`` whose order depends only on seed and epoch); its indices
            place the results. Takes the place of ``indices``.

    Returns:
        On ``dst`` (every rank if ``dst`` is ``None``), the ``size`` results in dataset
        order; ``None`` on the other ranks.

    Raises:
        TypeError: ``results`` is not a sequence, ``size`` not an int, ``sampler`` not a
            replayable sampler, an index is not an integer, or a result cannot be
            pickled (every rank raises).
        ValueError: Fewer than ``size`` results arrived, an index is out of range or
            missing, some ranks passed ``indices`` (or ``sampler``) and others did not
            (every rank raises), with ``dst=None`` the ranks passed different ``size``
            or ``order`` (every rank raises), ``order`` is unknown, ``indices``
            (or the sampler's) has the wrong length, or both ``indices`` and ``sampler``
            were given.
        UnsafeObjectError: ``serializer="safe"`` refused what a rank sent (every rank
            raises it, naming that rank).
        RuntimeError: A rank could not read one of its results: that rank raises its
            own error, the others a ``RuntimeError`` naming the rank, the index and the
            error (or one of its class, for a ``TypeError`` or ``ValueError``).

    Examples:
        >>> import distkit.dist as dist
        >>> dist.collect_results(["a", None, "c", "pad"], size=3)
        ['a', None, 'c']

        With 2 ranks and a DistributedSampler over 5 samples (rank 0 evaluated 0, 2, 4;
        rank 1 evaluated 1, 3 and the repeat of 0)::

            dist.collect_results(results, size=5)
            # rank 0: [r0, r1, r2, r3, r4]
            # rank 1: None
    """
    fn = "collect_results"
    comm = resolve(group, fn)
    with _record.collector(fn):  # one call in a profile, its rounds inside
        indices, name, _, refused, dst = _checked(
            fn, comm, results, size, order, indices, sampler, serializer, dst
        )
        call = ObjectCall(fn, None, name)
        # order is ignored with indices (or a sampler)
        shape = (size, order if indices is None else "") if dst is None else None
        collected = _Collected(comm, call, dst, results, indices, refused, shape)
        steps: Iterable[int] = range(1, collected.step(0))  # the first round tells the rest
        if comm.rank == (dst or 0):
            steps = track(steps, "collect_results", delay=1.0, main_only=False)
        for step in steps:
            collected.step(step)
        if not collected.receiver:
            return None
        if indices is not None:
            return _by_index(collected.parts, collected.index_parts, size, fn, comm)
        return _ordered(collected.parts, size, order, fn, comm)


def _same_shape(fn: str, comm: Comm, shapes: list[Optional[tuple[int, str]]]) -> None:
    """Raise on every rank (each compares them all) if the ranks' ``(size, order)``
    differ; with ``dst=None`` each rank orders and cuts the results by its own."""
    for what, at in (("size", 0), ("order", 1)):
        seen = {r: repr(shape[at]) for r, shape in enumerate(shapes) if shape is not None}
        if len(set(seen.values())) > 1:
            said = _args.by_value(seen)
            _args.fail(
                ValueError,
                fn,
                comm,
                f"the ranks passed different {what}s: {what}={said}, and with dst=None every "
                f"rank orders and cuts the results by its own",
                f"Pass the same {what} on every rank (e.g. len(dataset))"
                if what == "size"
                else "Pass the same order on every rank",
            )


_IN_WINDOW = re.compile(r"\[0\]\[(\d+)\]")


def _result_named(start: int, path: str) -> str:
    """What an error calls the part at ``path`` of a round's payload (its results from
    ``start`` on are its first element): ``results[start + i]...``, as the user passed them."""
    found = _IN_WINDOW.match(path)
    if found is None:
        return "data" + path  # not a result (the rest of a payload is ints and strings)
    return f"results[{start + int(found[1])}]{path[found.end() :]}"


def _window(results: Sequence, start: int, stop: int) -> Sequence:
    """``results[start:stop]``, read one result at a time unless it is a list or tuple
    (a lazy sequence need not slice; a read that fails raises ``_stream.ReadFailed``)."""
    if isinstance(results, (list, tuple)):
        return results[start:stop]
    return list(_stream.reading(results, range(start, min(stop, len(results)))))


#: Bytes of the status every round of ``collect_results`` ends with (longer error
#: messages are cut).
STATUS_BYTES = 4096


class _Collected:
    """``collect_results``' rounds: each moves ``CHUNK_ITEMS`` results per rank, then a
    status (how many rounds in all, or the error that stops the call) reaches every rank.

    So every rank raises when one fails: a rank whose results cannot be read or pickled
    raises its own error, ``dst`` (every rank with ``dst=None``) the error it found
    (another rank's failure, an object its serializer refuses), and the others that
    error, of the same class, "rank <dst> stopped the call: ...". Nobody goes on to its
    next collective with a round left behind.
    """

    def __init__(
        self,
        comm: Comm,
        call: ObjectCall,
        dst: Optional[int],
        results: Sequence,
        indices: Optional[list[int]],
        refused: Optional[Exception] = None,
        shape: Optional[tuple[int, str]] = None,
    ) -> None:
        self.comm, self.call, self.dst = comm, call, dst
        self.results, self.indices = results, indices
        # (size, order), which every rank compares in the first round with dst=None: each
        # orders and cuts the results by its own, so ranks that differ would return
        # different lists (or one of them raise alone that it got fewer than its size)
        self.shape = shape
        self.refused = refused  # this rank's bad arguments: its first round tells them
        self.receiver = dst is None or comm.rank == dst
        self.parts: list[list] = [[] for _ in range(comm.size)]
        self.index_parts: list[list] = [[] for _ in range(comm.size)]

    def step(self, step: int) -> int:
        """Run round ``step``; the number of rounds in all."""
        comm, call, fn, results = self.comm, self.call, self.call.fn, self.results
        start, stop = step * CHUNK_ITEMS, (step + 1) * CHUNK_ITEMS
        own: Optional[BaseException] = None  # this rank's error (raised here as it is)
        found: Optional[BaseException] = None  # what this rank found wrong elsewhere
        told: Optional[_stream.Failure] = None  # what the others hear of it
        payload: tuple
        try:
            if self.refused is not None:  # the first round says so, and ends the call
                own = self.refused
                text = f"rank {comm.rank} {_args.refused(own, fn, comm)}"
                told = _stream.Failure(_args.error_code(own), text)
                payload = ([], None, 0, (told.code, told.text), None)
            else:
                items = _window(results, start, stop)
                idx = None if self.indices is None else self.indices[start:stop]
                shape = self.shape if step == 0 else None
                payload = (items, idx, len(results), None, shape)
        except _stream.ReadFailed as failed:
            own = failed.error
            told = _stream.read_error(failed.position, failed.error)
            told = told._replace(text=f"rank {comm.rank} {told.text}")
            payload = ([], None, len(results), (told.code, told.text), None)
        gathered: Optional[list[Any]] = None
        call = call._replace(name=functools.partial(_result_named, start))
        try:
            if self.dst is None:
                gathered = comm.backend.all_gather_object(comm, payload, call)
            else:
                gathered = comm.backend.gather_object(comm, payload, self.dst, call)
        except CollectiveMismatchError:  # the ranks' checks disagree on the call (its
            raise  # dst...): each raises that, and no round ran; the status would mismatch
        except Exception as exc:  # the round is over on every rank: tell, then raise
            if own is None:
                own, told = exc, _stream.Failure.of(exc, fn)
        rounds = 0
        if gathered is not None:
            try:
                rounds = self._take(gathered, step)
            except Exception as exc:  # a failure another rank sent
                found = exc
                told = told or _stream.Failure.of(exc, fn)
        status = self._status(rounds, told)
        if own is not None:
            raise own
        if found is not None:
            raise found
        if status[1] is not None:
            culprit, failure = status[1]
            failure.raise_as(fn, comm, f"rank {culprit} stopped the call: {failure.text}")
        return status[0]

    def _take(self, gathered: list[Any], step: int) -> int:
        """Keep a round's results (on receivers); the number of rounds in all."""
        comm, fn = self.comm, self.call.fn
        for r, payload in enumerate(gathered):
            failure = payload[3] if isinstance(payload, tuple) and len(payload) == 5 else None
            if failure is not None and r != comm.rank:
                code, text = failure
                _stream.Failure(code, text).raise_as(fn, comm, text)
        if step == 0:  # indices on some ranks only: every rank hears it from this round
            passed = [idx is not None for _, idx, _, _, _ in gathered]
            mixed = [r for r, p in enumerate(passed) if p != (self.indices is not None)]
            if mixed:
                who = f"dst (rank {comm.rank})" if self.dst is not None else f"rank {comm.rank}"
                raise _mixed(fn, comm, mixed[0], who)
            if self.shape is not None:
                _same_shape(fn, comm, [shape for _, _, _, _, shape in gathered])
        for r, (res, idx, _, _, _) in enumerate(gathered):
            self.parts[r].extend(res)
            if idx is not None:
                self.index_parts[r].extend(idx)
        longest = max(count for _, _, count, _, _ in gathered)
        return max(1, -(-longest // CHUNK_ITEMS))

    def _status(
        self, rounds: int, failure: Optional[_stream.Failure]
    ) -> tuple[int, Optional[tuple[int, _stream.Failure]]]:
        """Share this round's outcome: ``dst``'s, or with ``dst=None`` every rank's
        (then the first failure, by rank, counts). (rounds, (rank, failure) or None)."""
        comm = self.comm
        raw = bytearray(STATUS_BYTES)
        head = layouts.ROUND_STATUS.size
        text = b"" if failure is None else failure.encode(STATUS_BYTES - head)
        layouts.ROUND_STATUS.pack_into(raw, 0, rounds, len(text))
        raw[head : head + len(text)] = text
        mine = _wire.owned_bytes(raw)
        rows: dict[int, Tensor]
        if self.dst is not None:
            rows = {self.dst: comm.backend.broadcast(comm, mine, self.dst, False)}
        else:
            everyone = comm.backend.all_gather(comm, mine, False, True)
            rows = dict(enumerate(everyone))
        outcome: Optional[tuple[int, _stream.Failure]] = None
        total = 0
        for r, row in rows.items():
            got = _wire.bytes_view(row.cpu().contiguous())
            n_rounds, n = layouts.ROUND_STATUS.unpack_from(got, 0)
            total = max(total, n_rounds)
            if n and outcome is None:
                body = got[head : head + min(n, STATUS_BYTES)]
                outcome = (r, _stream.Failure.decode(bytes(body)))
        return total, outcome


def _layout(
    counts: list[int],
    index_parts: Optional[list[Tensor]],
    size: int,
    order: str,
    fn: str,
    comm: Comm,
) -> tuple[Tensor, Tensor]:
    """Which rank's result, at which position, each of the ``size`` outputs is.

    The same rules as :func:`_ordered` and :func:`_by_index`, computed on the counts
    (and indices) alone, so no result needs to be at hand.
    """
    n = len(counts)
    if index_parts is None:
        total = sum(counts)
        if total < size:
            listed = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
            _args.fail(
                ValueError,
                fn,
                comm,
                f"the ranks returned {total} results in total ({listed}), fewer than size={size}",
                "Every sample must be evaluated by some rank: use a sampler without drop_last, "
                "or pass the number of samples actually evaluated as size",
            )
        if order == "interleaved" and n > 1 and len(set(counts)) == 1:
            slots = torch.arange(size, device="cpu")  # the DistributedSampler case: equal shards
            return slots % n, slots // n
    ranks = torch.repeat_interleave(
        torch.arange(n, device="cpu"), torch.tensor(counts, dtype=torch.int64, device="cpu")
    )
    positions = (
        torch.cat([torch.arange(c, device="cpu") for c in counts])
        if counts
        else torch.empty(0, device="cpu")
    )
    positions = positions.long()
    if index_parts is not None:
        idx = (
            torch.cat(index_parts).long()
            if index_parts
            else torch.empty(0, dtype=torch.long, device="cpu")
        )
        bad = ((idx < 0) | (idx >= size)).nonzero()
        if bad.numel():
            k = int(bad[0])
            _args.fail(
                ValueError,
                fn,
                comm,
                f"rank {int(ranks[k])} reported dataset index {int(idx[k])}, outside 0..{size - 1}",
            )
        ordered, perm = torch.sort(idx, stable=True)
        first = torch.ones(len(ordered), dtype=torch.bool, device="cpu")
        first[1:] = ordered[1:] != ordered[:-1]  # the first copy of a repeated index wins
        present = torch.zeros(size, dtype=torch.bool, device="cpu")
        present[ordered[first]] = True
        missing = (~present).nonzero().flatten().tolist()
        if missing:
            shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
            _args.fail(
                ValueError,
                fn,
                comm,
                f"{len(missing)} dataset indices were evaluated by no rank: {shown}",
            )
        pick = perm[first]
        return ranks[pick], positions[pick]
    if order == "interleaved" and n > 1:  # round-robin, skipping short ranks
        pick = torch.sort(positions * n + ranks).indices[:size]
        return ranks[pick], positions[pick]
    return ranks[:size], positions[:size]


class ResultStream(Iterator[Any]):
    """What :func:`iter_results` returns: an iterator, and a context manager that closes it.

    On ``dst`` it yields the results in dataset order; closing it early (``break`` in a
    ``with`` block, an exception, :meth:`close`) tells the other ranks to stop. On the
    other ranks it yields nothing: iterating it (or closing it) answers ``dst``'s
    requests until ``dst`` is done.
    """

    def __init__(self, items: Iterator[Any], finish: Any, dropped: Any = None) -> None:
        self._items = items
        self._finish = finish  # closes the protocol: tells the others, or serves to the end
        self._dropped = dropped  # on dst: tells the others to stop (never blocks for long)

    def __del__(self) -> None:
        # dst's stream dropped unfinished (a bare ``for ... break``): the others stop.
        # Nothing may wait here on the other ranks, so they never serve from here.
        if self._dropped is not None:
            try:
                self._dropped()
            except Exception:  # the world is going away: nothing left to tell
                pass

    def __iter__(self) -> ResultStream:
        return self

    @untraced("ResultStream.__next__", _PICKLES)
    def __next__(self) -> Any:
        return next(self._items)

    @untraced("ResultStream.close", _PICKLES)
    def close(self) -> None:
        """Stop: on ``dst`` the other ranks are told to stop; elsewhere, serve ``dst`` to
        the end (which returns once ``dst`` has finished or closed its iterator)."""
        self._finish()

    def __enter__(self) -> ResultStream:
        return self

    def __exit__(
        self,
        kind: Optional[type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        self.close()


@untraced("iter_results", _PICKLES)
def iter_results(
    results: Sequence,
    size: int,
    *,
    dst: int = 0,
    group: GroupLike = None,
    order: str = "interleaved",
    indices: Optional[Sequence[int]] = None,
    sampler: Any = None,
    chunk_bytes: int = CHUNK_BYTES,
    serializer: Optional[str] = None,
) -> ResultStream:
    """Iterate over every rank's evaluation results on ``dst``, in dataset order, holding
    only about ``chunk_bytes`` of other ranks' results at a time.

    The streaming form of :func:`collect_results`, for predictions too large to hold
    all at once on one rank: the same layouts (``order``, ``indices``, ``sampler``), the
    same ``None`` results and padding rules, the same errors. On ``dst`` it yields
    exactly ``size`` results; the other ranks get an empty iterator.

    Collective: every rank in ``group`` must call this (the call shares each rank's
    result count and sizes), and then **every rank must iterate or close what it
    returned**: the other ranks answer ``dst``'s requests while they iterate. Use it
    as a context manager so that an early ``break`` or an exception on ``dst`` tells the
    others to stop (their iteration then ends)::

        with dist.iter_results(results, len(dataset)) as stream:
            for result in stream:  # on ranks other than dst: no items, serves dst
                write(result)

    Do not run other collectives on ``group`` while iterating. Several streams may be
    open at once when they all go to one ``dst``: ``zip(iter_results(preds, n),
    iter_results(targets, n))`` pairs each prediction with its target (a rank serving
    one stream serves every stream open in its process). Opening a stream to another
    ``dst`` while one is still open raises ``ValueError`` on every rank, before any
    result moves: two ranks each serving the other's stream would wait forever.
    Single process: yields the first ``size`` results (reordered by ``indices``).

    ``dst`` asks for the results in rounds: each round holds the other ranks' results
    for the next stretch of the dataset, at most ``chunk_bytes`` of them (at least one
    result), received as pickled bytes and unpickled a pack (about 1 MiB) at a time.
    A rank whose results are small (together at most ``chunk_bytes`` divided by the
    number of ranks, and 1 MiB, pickled) sends them in the call itself: a stream of
    small results needs no round, and costs about what :func:`collect_results` does.
    Results from ``dst`` itself are its own objects; the rest are new objects.
    ``results`` may be any sequence (a lazy one that reads each result from disk when
    indexed, too): each result is read when it is sized and when it is sent.

    No rank waits for another inside a collective between rounds: ``dst`` may take as
    long as it likes over each result (longer than the group's timeout, too), the other
    ranks wait for its next request. ``dst`` waits for a rank's answer at most the
    group's timeout, then every rank raises ``CollectiveTimeoutError``, the one on
    ``dst`` naming the rank and what it does (``rank 1 created iter_results at
    eval.py:12 but has not iterated it``); a rank waiting for ``dst`` while ``dst``
    waits in another collective raises ``CollectiveTimeoutError`` saying where.

    Args:
        results: This rank's results, in the order it evaluated its samples.
        size: Number of samples in the dataset.
        dst: Rank (within ``group``) that gets the results.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        order: ``interleaved`` or ``contiguous``; ignored when ``indices`` is given.
        indices: Dataset index of each of this rank's results.
        sampler: The ``DistributedSampler`` this rank evaluated with; its indices place
            the results (see :func:`collect_results`).
        chunk_bytes: About how many bytes of other ranks' (pickled) results ``dst``
            holds at once.
        serializer: ``pickle`` or ``safe`` for the results received (see
            :func:`~distkit.dist.set_serializer`). Only the results count against the
            safe serializer's ``max_bytes``, never what the ranks tell each other.

    Returns:
        A :class:`ResultStream`: on ``dst``, the ``size`` results in dataset order;
        on the other ranks, nothing.

    Raises:
        TypeError: A bad argument (as in :func:`collect_results`), ``chunk_bytes`` is
            not a positive int, or a result cannot be pickled (every rank raises).
        ValueError: Fewer than ``size`` results, an index out of range or missing (an
            index past int64 too), ``indices`` (or ``sampler``) on some ranks only, a
            stream to another ``dst`` still open (every rank raises), or another
            argument error as in :func:`collect_results`.
        UnsafeObjectError: ``serializer="safe"`` refused what a rank sent (every rank
            raises it, naming that rank).
        RuntimeError: A rank could not read one of its results (``results[i]``
            raised): that rank raises its own error, the others a ``RuntimeError``
            naming the rank, the index and the error (or one of its class, for a
            ``TypeError`` or ``ValueError``).
        CollectiveTimeoutError: A rank did not serve ``dst`` within the group's timeout,
            or ``dst`` waits in another collective (see above).

    Errors raise on every rank within seconds, wherever they happen: while the stream
    opens (from the call, on every rank), or while ``dst`` iterates (a rank's result
    cannot be read or sent, ``dst`` cannot decode it or read its own): ``dst`` raises
    the error and every rank still serving it raises one of the same class, ``rank
    <dst> stopped the call: ...``. An early ``break``, ``close()`` or an exception of
    the consumer's own ends the other ranks' iteration normally.

    Examples:
        >>> import distkit.dist as dist
        >>> list(dist.iter_results(["a", None, "c", "pad"], size=3))
        ['a', None, 'c']
    """
    fn = "iter_results"
    comm = resolve(group, fn)
    with _record.collector(fn):  # one call in a profile, its rounds inside
        indices, name, chunk_bytes, refused, checked_dst = _checked(
            fn, comm, results, size, order, indices, sampler, serializer, dst, chunk_bytes, False
        )
        assert checked_dst is not None  # iter_results has one dst
        call = ObjectCall(fn, None, name)
        if comm.alone:
            plan, error, _ = _plan(fn, comm, results, size, indices, 0, "")
            if error is not None:
                raise error
            own = None if plan.indices is None else [plan.indices]
            ranks, positions = _layout([len(results)], own, size, order, fn, comm)
            return _alone(results, ranks, positions)
        # The stream's number on the group (hang reports) is that of its first collective
        # (the plans' gather). It takes none of its own: collect_results takes none, and
        # a rank in one of them while another is in the other would be a call apart, so
        # the check could not pair (and refuse) them, and both waited out the timeout.
        seq = comm.enter(fn, count=False) + 1
        try:
            opened = _stream.Opened(comm, fn, seq, checked_dst)
            return _open(opened, results, size, order, indices, chunk_bytes, call, refused)
        finally:
            comm.leave()


def _plan(
    fn: str,
    comm: Comm,
    results: Sequence,
    size: int,
    indices: Optional[list[int]],
    inline_bytes: int,
    open_to: str,
    refused: Optional[Exception] = None,
) -> tuple[_stream.Plan, Optional[BaseException], list[int]]:
    """This rank's plan, the error to raise here once ``dst`` has it, and the sizes.

    Reads every result once (twice if they are small enough to travel in the plan).
    """
    sizes: list[int] = []
    mine: Optional[Tensor] = None
    if refused is not None:  # its arguments (see _checked)
        failure = _stream.Failure(_args.error_code(refused), _args.refused(refused, fn, comm))
        return _stream.Plan(0, None, None, failure, None), refused, []
    try:
        if open_to:
            _args.fail(
                ValueError,
                fn,
                comm,
                f"rank {comm.rank} has {open_to} still open, and streams open at the same "
                "time must all go to one dst",
                "Finish or close it first (with dist.iter_results(...) as stream: closes "
                "it at the end of the block)",
            )
        sizes = _wire.encoded_sizes(_stream.reading(results), "results", fn, comm)
        if indices is not None:
            mine = _int64(indices, size, fn, comm)
        data = None
        if inline_bytes and sum(sizes) <= inline_bytes:
            data = _wire.encode(list(_stream.reading(results)), "results", fn, comm).cpu
    except _stream.ReadFailed as failed:
        failure = _stream.read_error(failed.position, failed.error)
        return _stream.Plan(len(results), None, None, failure, None), failed.error, []
    except Exception as exc:  # told as "rank <r> ...": the rank is named there
        text = _args.bare(exc, fn, comm)
        if isinstance(exc, TypeError):  # a result that cannot be pickled
            text = f"could not send its results: {text}"
        else:  # the rank's own report (an index, a stream still open)
            text = text.removeprefix(f"rank {comm.rank} ")
        failure = _stream.Failure(_args.error_code(exc), text)
        return _stream.Plan(len(results), None, None, failure, None), exc, []
    sizes_t = None if data is not None else torch.tensor(sizes, dtype=torch.int64, device="cpu")
    return _stream.Plan(len(results), sizes_t, mine, None, data), None, sizes


def _int64(indices: list[int], size: int, fn: str, comm: Comm) -> Tensor:
    """``indices`` as an int64 tensor; an index past int64 is refused as out of range
    (as ``dst`` refuses any other, naming this rank)."""
    try:
        return torch.tensor(indices, dtype=torch.int64, device="cpu")
    except (OverflowError, RuntimeError, ValueError):  # which one depends on torch
        bad = next(i for i in indices if not -(2**63) <= i < 2**63)
        _args.fail(
            ValueError,
            fn,
            comm,
            f"rank {comm.rank} reported dataset index {bad}, outside 0..{size - 1}",
        )


def _alone(
    results: Sequence,
    ranks: Tensor,
    positions: Tensor,
    inline: Optional[dict[int, list]] = None,
    rank: int = 0,
    held: Optional[_stream.Held] = None,
) -> ResultStream:
    """A stream that needs no rounds: this rank's own results and those that came in
    the plans (``inline``, by rank), laid out; ``held`` says it is open meanwhile."""

    def items() -> Generator[Any, None, None]:
        try:
            if not inline:
                for p in positions.tolist():
                    yield results[p]
                return
            for r, p in zip(ranks.tolist(), positions.tolist()):
                yield results[p] if r == rank else inline[r][p]
        finally:
            if held is not None:
                held.open = False

    it = items()
    return ResultStream(it, it.close)


def _open(
    opened: _stream.Opened,
    results: Sequence,
    size: int,
    order: str,
    indices: Optional[list[int]],
    chunk_bytes: int,
    call: ObjectCall,
    refused: Optional[Exception] = None,
) -> ResultStream:
    """Open a stream on a group of several ranks (see :mod:`distkit.dist.backends.stream`)."""
    comm, fn, dst = opened.comm, opened.fn, opened.dst
    rank = comm.rank
    inline_bytes = min(PACK_BYTES, chunk_bytes // comm.size) if rank != dst else 0
    open_to = _stream.open_elsewhere(comm.global_rank(dst))
    plan, error, sizes = _plan(fn, comm, results, size, indices, inline_bytes, open_to, refused)
    plans = _stream.gather_plans(comm, plan, dst)
    if rank != dst:
        kind, stream, tag, asked = _stream.verdict(opened, error)
        if kind != _stream.GO:
            return ResultStream(iter(()), lambda: None)
        pack_bytes = min(PACK_BYTES, chunk_bytes)
        server = _stream.Server(opened, stream, tag, results, sizes, asked, pack_bytes)
        return _served(server)

    assert plans is not None
    try:
        inline, ranks, positions = _decide(opened, plans, size, order, call)
    except Exception as exc:  # every rank raises too
        if error is not None and plan.failure is not None:
            told = plan.failure._replace(text=f"rank {rank} {plan.failure.text}")
        else:
            told = _stream.Failure.of(exc, fn)
        _stream.announce(opened, told)
        if error is not None:
            raise error from None
        raise
    serving = [r for r, p in enumerate(plans) if r != rank and r not in inline and p.length]
    wanted: Sequence[Tensor] = ()
    if serving:  # which positions of each rank's results dst will ask for, in order
        counts = torch.bincount(ranks, minlength=comm.size).tolist()
        wanted = positions[torch.sort(ranks, stable=True).indices].split(counts)
        serving = [r for r in serving if counts[r]]
    stream, tag = _stream.nonce(), _stream.new_tag()
    _stream.announce(opened, None, stream, tag, {r: wanted[r] for r in serving})
    if not serving:  # everything is here already: no rounds
        return _alone(results, ranks, positions, inline, rank, _stream.Held(comm))
    none = torch.zeros(0, dtype=torch.int64, device="cpu")
    costs = torch.cat(
        [
            p.sizes if r in serving and p.sizes is not None else none.new_zeros(p.length)
            for r, p in enumerate(plans)
        ]
    )
    starts = torch.tensor([0] + [p.length for p in plans], device="cpu").cumsum(0)[:-1]
    cost = (
        costs[starts[ranks] + positions]
        if size
        else torch.zeros(0, dtype=torch.int64, device="cpu")
    )
    receiver = _stream.Receiver(
        opened, stream, tag, results, ranks, positions, cost, chunk_bytes, call, inline, serving
    )
    items = receiver.run()  # refers to the receiver, never the other way: no cycle, so
    # dropping the stream finalizes the generator at once (its finally tells the others)

    def finish() -> None:
        items.close()  # runs the generator's finally if it started
        receiver.stop()

    return ResultStream(items, finish, receiver.stop)


def _decide(
    opened: _stream.Opened, plans: list[_stream.Plan], size: int, order: str, call: ObjectCall
) -> tuple[dict[int, list], Tensor, Tensor]:
    """On ``dst``: check every rank's plan, lay the outputs out, decode the results that
    came in the plans. Raises what any rank's plan says is wrong, naming the rank."""
    comm, fn, rank = opened.comm, opened.fn, opened.comm.rank
    own = plans[rank].failure
    if own is not None:
        own.raise_as(fn, comm, f"rank {rank} {own.text}")
    for r, p in enumerate(plans):
        if p.failure is not None:
            p.failure.raise_as(fn, comm, f"rank {r} {p.failure.text}")
    mine = plans[rank].indices
    mixed = [r for r, p in enumerate(plans) if (p.indices is None) != (mine is None)]
    if mixed:
        raise _mixed(fn, comm, mixed[0], f"dst (rank {rank})")
    parts = None if mine is None else [p.indices for p in plans if p.indices is not None]
    ranks, positions = _layout([p.length for p in plans], parts, size, order, fn, comm)
    inline: dict[int, list] = {}
    for r, p in enumerate(plans):
        if p.data is not None and r != rank:
            enc = _wire.Encoded(p.data, None)
            got = _wire.decode(enc, call.map_location, call.serializer, r, fn, comm)
            if not isinstance(got, list) or len(got) != p.length:
                _args.fail(
                    RuntimeError,
                    fn,
                    comm,
                    f"rank {r} sent {p.length} results in its plan, but they decode to "
                    f"{_args.show(got)}",
                )
            inline[r] = got
    return inline, ranks, positions


def _served(server: _stream.Server) -> ResultStream:
    """A serving rank's stream: iterating it (or closing it) serves until dst is done."""

    def items() -> Generator[Any, None, None]:
        _stream.serve(server)
        return
        yield

    it = items()

    def finish() -> None:
        for _ in it:  # serves, unless that happened already
            pass

    return ResultStream(it, finish)


def collect_results_cpu(
    result_part: Sequence, size: int, tmpdir: Optional[str] = None
) -> Optional[list]:
    """mmengine's name for :func:`collect_results` (results on rank 0; no tmpdir used).

    Args:
        result_part: This rank's results (interleaved, as a DistributedSampler splits).
        size: Number of samples in the dataset.
        tmpdir: Accepted for mmengine compatibility and ignored.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.collect_results_cpu([1, 2, 3], 2)
        [1, 2]
    """
    return collect_results(result_part, size)


def collect_results_gpu(result_part: Sequence, size: int) -> Optional[list]:
    """mmengine's name for :func:`collect_results` (results on rank 0).

    Args:
        result_part: This rank's results (interleaved, as a DistributedSampler splits).
        size: Number of samples in the dataset.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.collect_results_gpu([1, 2, 3], 3)
        [1, 2, 3]
    """
    return collect_results(result_part, size)
