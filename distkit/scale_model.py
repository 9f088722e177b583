"""What a collective costs as the world grows: a model of distkit's and torch's algorithms.

For each operation and implementation, :func:`cost` gives, as functions of the number of
ranks N and the bytes each rank holds:

- **rounds**: the library's collective calls one after another (each waits for the slowest
  rank), and **steps**: gloo's messages in sequence along the longest path (the latency
  term; a ring all_gather is N-1 steps, gloo's binomial-tree broadcast ceil(log2 N));
- **sent** and **received**: bytes on the wire per rank, the largest over ranks;
- **memory**: how much a rank's peak resident memory grows during the call, the largest
  over ranks (what was allocated and touched, including the result it returns).

It is read off the code, not fitted. distkit's object collectives send a fixed slot per
rank, then each large object at its exact size (:mod:`distkit.dist.backends.objects`); the
sender holds its object encoded once, and a receiver holds the receive buffer and, for an
object made of tensors each under half of it (the benchmark's: 1 MiB tensors in dicts),
a copy of each tensor taken out of it (``_shares`` in :mod:`distkit.dist.codec.wire`; a
tensor that is most of the buffer stays a view of it: ``views=True``). Uneven
``all_gather`` sends each rank's bytes as a frame at its own size
(:mod:`distkit.dist.backends.uneven`, in the steady state where sizes repeat). torch's
``all_gather_object`` and ``gather_object`` pad every rank's pickle to the largest;
pickling an object peaks at :data:`TORCH_PICKLE` times its size (the stream grows, then
is copied into a tensor, which stays), and turning a received row back into an object at
:data:`TORCH_UNPICKLE` times (``tobytes()``, the unpickler's reads, the tensors, which
stay); those two factors were measured on one object alone, outside any collective.
gloo's all_gather and gather receive into a flat buffer of their own and then copy it
into the caller's outputs (``AsyncAllgatherWork`` in ``ProcessGroupGloo.cpp``), so the
gathered rows are held twice while the call runs. Its ring all_reduce takes a scratch
buffer of 1/N of the tensor, at most :data:`GLOO_SCRATCH` (measured, not read off gloo).
mmengine.dist calls torch's collectives for all of these, so its model is torch's.
Pickle and table overheads (a few KiB) are left out: the model counts payload bytes. The
constants are distkit's own (imported), so the model follows the code.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from distkit.dist.backends.base import BROADCAST_BYTES
from distkit.dist.core import layouts

SLOT = layouts.SLOT_BYTES  # an object collective's first-round slot, per rank
INLINE = layouts.INLINE_BYTES  # an object whose bytes fit the slot needs no other round
SIZE = 8  # torch's size exchange: one int64 per rank
#: distkit's uneven all_gather frame header: the byte count, then the shape row (dtype,
#: ndim, a flag, INLINE_DIMS dims), int64s aligned
FRAME_HEAD = len(layouts.aligned([0] * (4 + layouts.INLINE_DIMS))) * 8

#: Peak memory of torch's pickling of an object (``_object_to_tensor``), in object sizes
TORCH_PICKLE = 2
#: Peak memory of torch's unpickling of a received row (``_tensor_to_object``)
TORCH_UNPICKLE = 3

#: The largest scratch buffer gloo's all_reduce took, measured (16 MiB on 2 to 8 ranks)
GLOO_SCRATCH = 2 << 20

OPS = (
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "broadcast",
    "all_reduce",
    "all_gather_uneven",
)
IMPLS = ("distkit", "torch", "mmengine")


class Cost(NamedTuple):
    rounds: int
    steps: int
    sent: int
    received: int
    memory: int


def tree_sends(n: int) -> list[int]:
    """Messages each virtual rank (0 = the root) sends in gloo's binomial-tree broadcast:
    in step i every rank below 2**i that has data sends it to its rank plus 2**i."""
    dim = math.ceil(math.log2(n)) if n > 1 else 0
    return [sum(1 for i in range(dim) if v < 2**i and v + 2**i < n) for v in range(n)]


def _depth(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def _broadcasts(sizes: dict[int, int], n: int, head: int = 0) -> tuple[int, int]:
    """(max sent, max received) over ranks when each rank ``b`` in ``sizes`` broadcasts
    ``head + sizes[b]`` bytes, all at once (distkit's exact-size rounds)."""
    if not sizes:
        return 0, 0
    fan = tree_sends(n)
    total = sum(head + s for s in sizes.values())
    sent = [sum(fan[(r - b) % n] * (head + s) for b, s in sizes.items()) for r in range(n)]
    received = [total - (head + sizes[r] if r in sizes else 0) for r in range(n)]
    return max(sent), max(received)


def cost(op: str, impl: str, sizes: list[int], root: int = 0, views: bool = False) -> Cost:
    """The cost of one call of ``op`` by ``impl`` in a world of ``len(sizes)`` ranks.

    Args:
        op: One of :data:`OPS`.
        impl: ``distkit``, ``torch`` or ``mmengine`` (modelled as torch, which it calls).
        sizes: Bytes each rank holds (objects: their tensor bytes). For the broadcasts and
            ``all_reduce`` only ``sizes[root]`` counts.
        root: The source of a broadcast, the destination of ``gather_object``.
        views: Objects are one large tensor each, which distkit's receivers keep as a view
            of the receive buffer (otherwise: many smaller tensors, each copied out).

    Returns:
        Rounds, steps, bytes sent and received and peak memory growth, per rank (the
        largest over ranks).
    """
    if op not in OPS or impl not in IMPLS:
        raise ValueError(f"no model for {impl}'s {op}")
    n, p = len(sizes), sizes[root]
    top, total = max(sizes), sum(sizes)
    ours = impl == "distkit"
    kept = 1 if views else 2  # what a distkit receiver holds per byte received
    if op == "all_gather_object":
        if ours:
            big = {r: s for r, s in enumerate(sizes) if s > INLINE}
            slots = (n - 1) * SLOT
            if len(big) > 1 and max(big.values()) < BROADCAST_BYTES:  # one padded all_gather
                pad = max(big.values())
                memory = 2 * n * pad + sum(big.values())
                return Cost(2, 2 * (n - 1), slots + (n - 1) * pad, slots + (n - 1) * pad, memory)
            sent, received = _broadcasts(big, n)
            steps = (n - 1) + (_depth(n) if big else 0)
            # its own object encoded once, and every other large one received and decoded
            own = big.values() if big else [0]
            memory = max(s + kept * (sum(big.values()) - s) for s in own)
            if len(big) < n:  # a rank with a small object receives them all
                memory = max(memory, kept * sum(big.values()))
            return Cost(1 + bool(big), steps, slots + sent, slots + received, memory)
        # torch: a size all_gather, then every pickle padded to the largest. Every rank
        # holds its own pickle and the n padded rows (twice, inside gloo), then the rows,
        # every object unpickled (its own too) and, while unpickling the largest, the
        # extra copies that takes.
        wire = (n - 1) * (SIZE + top)
        gathering = 2 * n * top + top
        unpickling = n * top + top + total + (TORCH_UNPICKLE - 1) * top
        memory = max(gathering, unpickling, TORCH_PICKLE * top)
        return Cost(2, 2 * (n - 1), wire, wire, memory)
    if op == "gather_object":
        others = {r: s for r, s in enumerate(sizes) if r != root}
        if ours:
            big = {r: s for r, s in others.items() if s > INLINE}
            received = (n - 1) * SLOT + sum(big.values())
            sent = SLOT + max(others.values(), default=0)
            memory = max(kept * sum(big.values()), max(big.values(), default=0))
            return Cost(1 + bool(big), 1 + bool(big), sent, received, memory)
        # torch: a size all_gather, a gather padded to the largest (held twice inside
        # gloo); root unpickles every row (its own too) and holds its own pickle
        gathering = 2 * n * top + p
        unpickling = n * top + p + total + (TORCH_UNPICKLE - 1) * top
        memory = max(gathering, unpickling, TORCH_PICKLE * top)
        return Cost(2, n, (n - 1) * SIZE + top, (n - 1) * (SIZE + top), memory)
    if op == "broadcast_object_list":
        d = _depth(n)
        if ours:  # a slot broadcast, then the exact bytes, decoded by each receiver
            return Cost(2, 2 * d, d * (SLOT + p), SLOT + p, max(p, kept * p))
        # torch: the source pickles; each receiver gets the bytes and unpickles them
        memory = max(TORCH_PICKLE * p, p + TORCH_UNPICKLE * p)
        return Cost(2, 2 * d, d * (SIZE + p), SIZE + p, memory)
    if op == "broadcast":  # a tensor, into a buffer every receiver allocated beforehand
        d = _depth(n)
        return Cost(1, d, d * p, p, 0)
    if op == "all_reduce":  # gloo's ring: a reduce-scatter, then an all_gather, in place
        ring = 2 * (n - 1) * p // n
        return Cost(1, 2 * (n - 1), ring, ring, min(p // n, GLOO_SCRATCH))
    # all_gather of uneven tensors
    if ours:  # steady sizes: every rank's frame at its own size, one round
        if top < BROADCAST_BYTES:  # one all_gather, padded to the largest frame
            wire = (n - 1) * (FRAME_HEAD + top)
            return Cost(1, n - 1, wire, wire, (2 * n + 1) * (FRAME_HEAD + top))
        sent, received = _broadcasts(dict(enumerate(sizes)), n, FRAME_HEAD)
        # a buffer per other rank, and this rank's own frame (its bytes copied behind
        # the header)
        return Cost(1, _depth(n), sent, received, total + n * FRAME_HEAD)
    # torch (and mmengine, whose all_gather wants equal shapes): exchange the sizes, pad
    # to the largest (a copy), all_gather (the rows held twice inside gloo), slice
    wire = (n - 1) * (SIZE + top)
    return Cost(2, 2 * (n - 1), wire, wire, (2 * n + 1) * top)


def agrees(model: int, measured: int, rel: float = 0.15, slack: int = 8 << 20) -> bool:
    """Whether a measured peak agrees with the model: within ``rel`` of it, plus ``slack``
    bytes (the interpreter, gloo's buffers and pickle overheads, which the model omits)."""
    return abs(measured - model) <= rel * model + slack


#: The tolerance :func:`agrees` applies, in words (for the reports)
TOLERANCE = "within 15% of the model plus 8 MiB"
