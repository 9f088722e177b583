"""Collecting the results of a distributed evaluation, in dataset order."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import chain, zip_longest
from typing import Any, Optional

import torch

from distkit.dist import _args
from distkit.dist._comm import Comm, GroupLike, resolve
from distkit.dist.objects import all_gather_object, gather_object
from distkit.dist.tensor import all_reduce
from distkit.utils.console import track

ORDERS = ("interleaved", "contiguous")
#: Results per rank moved in one round: bounds memory per round, and paces the progress bar.
CHUNK_ITEMS = 65536


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
) -> Optional[list]:
    """Collect every rank's evaluation results, in dataset order, exactly ``size`` of them.

    Collective: every rank in ``group`` must call this.
    Single process: returns the first ``size`` results (reordered by ``indices`` if given).

    How the dataset was split decides the order; say which:

    - ``order="interleaved"`` (default): ``torch.utils.data.DistributedSampler`` without
      shuffling, where rank r evaluates samples r, r + n, r + 2n, ... and the last ranks
      repeat the first samples to even out the shards. Results are merged round-robin;
      the repeats fall past ``size`` and are cut.
    - ``order="contiguous"``: rank r evaluated one contiguous block, blocks in rank order.
    - ``indices``: the dataset index of each of this rank's results (e.g.
      ``list(sampler)`` for a shuffling sampler). Each result goes to its index; repeated
      indices keep the first result; every index below ``size`` must be present.

    Results that are ``None`` are kept. No temporary directory is ever used: results
    travel through the object collectives (tensors in them as raw bytes), in rounds of
    ``CHUNK_ITEMS`` results per rank; when that takes more than a second, the receiving
    process shows a progress bar.

    Args:
        results: This rank's results, in the order it evaluated its samples.
        size: Number of samples in the dataset.
        device: Accepted for mmengine compatibility (``"cpu"``/``"gpu"``) and ignored:
            tensors in the results travel on the backend's device either way.
        tmpdir: Accepted for mmengine compatibility and ignored.
        dst: Rank (within ``group``) that gets the results; ``None`` gives them to every
            rank.
        group: ``None`` (default group), a ``ProcessGroup``, a list of global ranks
            or a mesh dimension (``mesh["dp"]``, ``(mesh, "dp")``).
        order: ``interleaved`` or ``contiguous``; ignored when ``indices`` is given.
        indices: Dataset index of each of this rank's results.
        serializer: ``pickle`` or ``safe`` for the results received (see
            :func:`~distkit.dist.set_serializer`).

    Returns:
        On ``dst`` (every rank if ``dst`` is ``None``), the ``size`` results in dataset
        order; ``None`` on the other ranks.

    Raises:
        TypeError: ``results`` is not a sequence, ``size`` not an int, or a result cannot
            be pickled.
        ValueError: Fewer than ``size`` results arrived, an index is out of range or
            missing, ``order`` is unknown, or ``indices`` has the wrong length.

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
    if isinstance(results, (str, bytes)) or not isinstance(results, Sequence):
        _args.fail(TypeError, fn, comm, f"results must be a list, got {_args.show(results)}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        _args.fail(TypeError, fn, comm, f"size must be a non-negative int, got {_args.show(size)}")
    if dst is not None:
        _args.rank(dst, "dst", fn, comm)
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
    elif order not in ORDERS:
        _args.fail(
            ValueError,
            fn,
            comm,
            f"unknown order {order!r}",
            f"Use one of {', '.join(ORDERS)}, or pass indices",
        )

    # One tiny round tells every rank the longest shard, so all agree on the chunks.
    longest = int(all_reduce(torch.tensor([len(results)]), "max", group).item())
    steps: Iterable[int] = range(max(1, -(-longest // CHUNK_ITEMS)))
    receiver = comm.rank == dst or dst is None
    if comm.rank == (dst or 0):
        steps = track(steps, "collect_results", delay=1.0, main_only=False)
    parts: list[list] = [[] for _ in range(comm.size)]
    index_parts: list[list] = [[] for _ in range(comm.size)]
    for step in steps:
        window = slice(step * CHUNK_ITEMS, (step + 1) * CHUNK_ITEMS)
        payload = (results[window], None if indices is None else indices[window])
        gathered: Optional[list[Any]]
        if dst is None:
            gathered = all_gather_object(payload, group, serializer=serializer)
        else:
            gathered = gather_object(payload, dst, group, serializer=serializer)
        if receiver:
            assert gathered is not None
            for r, (res, idx) in enumerate(gathered):
                parts[r].extend(res)
                if idx is not None:
                    index_parts[r].extend(idx)
    if not receiver:
        return None
    if indices is not None:
        return _by_index(parts, index_parts, size, fn, comm)
    return _ordered(parts, size, order, fn, comm)


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
