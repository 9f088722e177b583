"""Collectives of picklable Python objects, returning their result.

Tensors inside the objects (in lists, tuples, dicts, dataclasses, namedtuples) are not
pickled: they travel as raw bytes through tensor collectives, on the accelerator when the
backend has one, and arrive on the receiving rank's device (``map_location`` chooses
another). Only the rest of the object is pickled. Small objects take one round; see
:mod:`distkit.dist.backends.objects` for the protocol.

Aliasing, the same in every world: what comes back from this rank is the caller's own
object, not a copy (``all_gather_object(x)[rank] is x``); what comes from other ranks is
new.

Every object handed in must be picklable, on every rank, in every world: a single
process checks it too (with a pickling dry run that skips tensor data), so code that
would fail on 8 ranks fails in the debugger. When one rank's object cannot be pickled,
that rank raises ``TypeError`` naming the offending part, and the ranks that expected it
raise a ``TypeError`` naming that rank, instead of waiting forever.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor

from distkit.dist._route import refused, resolve, told
from distkit.dist.backends.base import ObjectCall, Refused
from distkit.dist.codec import pickling as _pickling
from distkit.dist.codec import policy
from distkit.dist.core import args as _args
from distkit.dist.core import spec
from distkit.dist.core.comm import Comm, GroupLike
from distkit.dist.core.shortcut import shortcut


def _call(fn: str, comm: Comm, map_location: Any, serializer_name: Optional[str]) -> ObjectCall:
    """Check the options every object collective takes (on a group, an error goes to the
    other ranks through the call before this rank raises it: see ``Refused``)."""
    try:
        device = _args.map_location(map_location, fn, comm)
        return ObjectCall(fn, device, policy.serializer_of(serializer_name, fn, comm))
    except (TypeError, ValueError) as exc:
        if comm.alone:
            raise
        told = Refused(exc, _args.refused(exc, fn, comm))
        return ObjectCall(fn, None, policy.serializer_of(None, fn, comm), told)


_ATOMS = _pickling.ATOMS
# atoms, and plain tensors (every torch.Tensor encodes: see _pickling.sendable). A bare
# tensor's own attributes are not looked at here: one that cannot be pickled raises on a
# group only (looking costs a third more per call; in a container, they are checked)
_ALWAYS = _ATOMS | {Tensor}


def _flat_dict(data: Any) -> bool:
    """A dict of atoms (a step's metrics): it always encodes."""
    if data.__class__ is not dict:
        return False
    for key, value in data.items():
        if type(key) not in _ATOMS or type(value) not in _ATOMS:  # see core.shortcut._test
            return False
    return True


def _never(data: Any) -> bool:
    return False


# The single-process shortcut returns atoms, tensors and flat dicts of atoms (a step's
# metrics) at once; nothing while DISTKIT_SERIALIZER is bad, so that the checked
# path raises the error a world of many ranks would.
_RETURNS, _WHEN = spec.shortcut_of(
    "all_gather_object", {"plain object": (_ALWAYS, _flat_dict) if policy.ENV_OK else _never}
)


@shortcut(_RETURNS, refused=refused, **_WHEN)
def all_gather_object(
    data: Any,
    group: GroupLike = None,
    map_location: Any = None,
    serializer: Optional[str] = None,
) -> list[Any]:
    """Gather a picklable object from every rank.

    Collective: every rank in ``group`` must call this.
    Single process: returns ``[data]``.

    Args:
        data: This rank's object.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        map_location: Device for received tensors; ``None`` puts CPU tensors on the CPU
            and accelerator tensors on this rank's current device of that type.
        serializer: ``pickle`` or ``safe`` for what this call receives; ``None`` uses
            the process-wide setting (see :func:`set_serializer`).

    Returns:
        One object per rank, in rank order; this rank's entry is ``data`` itself.

    Raises:
        TypeError: ``data`` (or another rank's object) cannot be pickled.
        UnsafeObjectError: ``serializer="safe"`` refused another rank's object.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.all_gather_object({"loss": 0.5})
        [{'loss': 0.5}]

        With 3 ranks (the mmengine documentation's example)::

            dist.all_gather_object(["foo", 12, {1: 2}][dist.get_rank()])
            # every rank: ['foo', 12, {1: 2}]
    """
    fn = "all_gather_object"
    comm = resolve(group, fn)
    call = _call(fn, comm, map_location, serializer)
    return comm.backend.all_gather_object(comm, data, call)


@told
def gather_object(
    data: Any,
    dst: int = 0,
    group: GroupLike = None,
    map_location: Any = None,
    serializer: Optional[str] = None,
) -> Optional[list[Any]]:
    """Gather a picklable object from every rank onto ``dst``.

    Collective: every rank in ``group`` must call this.
    Single process: returns ``[data]`` (``dst`` must be 0).

    Args:
        data: This rank's object.
        dst: Rank (within ``group``) that receives the objects.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        map_location: Device for received tensors (see :func:`all_gather_object`).
        serializer: ``pickle`` or ``safe`` for what this call receives; ``None`` uses
            the process-wide setting (see :func:`set_serializer`).

    Returns:
        On ``dst``, one object per rank in rank order (``data`` itself at ``dst``'s
        index); ``None`` on the other ranks.

    Raises:
        TypeError: ``data`` (or, on ``dst``, another rank's object) cannot be pickled.
        ValueError: ``dst`` is out of range.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.gather_object("only me")
        ['only me']

        With 2 ranks::

            dist.gather_object(dist.get_rank() * 10, dst=0)
            # rank 0: [0, 10]
            # rank 1: None
    """
    fn = "gather_object"
    comm = resolve(group, fn)
    dst = _args.rank(dst, "dst", fn, comm)
    call = _call(fn, comm, map_location, serializer)
    return comm.backend.gather_object(comm, data, dst, call)


@told
def broadcast_object_list(
    data: list[Any],
    src: int = 0,
    group: GroupLike = None,
    map_location: Any = None,
    serializer: Optional[str] = None,
) -> list[Any]:
    """Broadcast the list ``data`` from ``src``, filling every rank's list in place.

    Collective: every rank in ``group`` must call this.
    Single process: returns ``data`` unchanged (``src`` must be 0).

    Like ``torch.distributed.broadcast_object_list`` (and mmengine's) the list is filled
    in place, so existing code keeps working, and it is also returned. Unlike torch, the
    other ranks' lists may have any length: they are resized to ``src``'s.

    Args:
        data: On ``src``, the objects to send; elsewhere, the list to fill.
        src: Rank (within ``group``) whose list is sent.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        map_location: Device for received tensors (see :func:`all_gather_object`).
        serializer: ``pickle`` or ``safe`` for what this call receives; ``None`` uses
            the process-wide setting (see :func:`set_serializer`).

    Returns:
        ``data``, holding ``src``'s objects (the very same objects on ``src``).

    Raises:
        TypeError: ``data`` is not a list, or on ``src`` holds something unpicklable.
        ValueError: ``src`` is out of range.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.broadcast_object_list(["foo", 12, {1: 2}])
        ['foo', 12, {1: 2}]

        With 4 ranks (the torch documentation's example)::

            objects = ["foo", 12, {1: 2}] if dist.get_rank() == 0 else [None, None, None]
            dist.broadcast_object_list(objects, src=0)
            # every rank: ['foo', 12, {1: 2}], also now in ``objects``
    """
    fn = "broadcast_object_list"
    comm = resolve(group, fn)
    src = _args.rank(src, "src", fn, comm)
    if not isinstance(data, list):
        _args.fail(
            TypeError,
            fn,
            comm,
            f"data must be a list, got {_args.show(data)}",
            "Use broadcast_object to send a single object",
        )
    call = _call(fn, comm, map_location, serializer)
    received = comm.backend.broadcast_object(
        comm, data if comm.rank == src else None, src, "data", call
    )
    if comm.rank != src:
        data[:] = received
    return data


@told
def broadcast_object(
    obj: Any = None,
    src: int = 0,
    group: GroupLike = None,
    map_location: Any = None,
    serializer: Optional[str] = None,
) -> Any:
    """Send one picklable object from ``src`` to every rank and return it.

    Collective: every rank in ``group`` must call this.
    Single process: returns ``obj`` (``src`` must be 0).

    Args:
        obj: The object to send on ``src``; ignored elsewhere.
        src: Rank (within ``group``) whose object is sent.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        map_location: Device for received tensors (see :func:`all_gather_object`).
        serializer: ``pickle`` or ``safe`` for what this call receives; ``None`` uses
            the process-wide setting (see :func:`set_serializer`).

    Returns:
        ``src``'s object: ``obj`` itself on ``src``, a new object elsewhere.

    Raises:
        TypeError: On ``src``, ``obj`` cannot be pickled.
        ValueError: ``src`` is out of range.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.broadcast_object({"lr": 0.1})
        {'lr': 0.1}

        With 2 ranks::

            dist.broadcast_object({"seed": 42} if dist.get_rank() == 0 else None)
            # every rank: {'seed': 42}
    """
    fn = "broadcast_object"
    comm = resolve(group, fn)
    src = _args.rank(src, "src", fn, comm)
    call = _call(fn, comm, map_location, serializer)
    return comm.backend.broadcast_object(comm, obj, src, "obj", call)


@told
def scatter_object_list(
    data: Optional[list[Any]] = None,
    src: int = 0,
    group: GroupLike = None,
    map_location: Any = None,
    serializer: Optional[str] = None,
) -> Any:
    """Send ``data[r]`` from ``src`` to rank ``r`` and return this rank's object.

    Collective: every rank in ``group`` must call this.
    Single process: returns ``data[0]`` (``src`` must be 0).

    Args:
        data: On ``src``, one picklable object per rank; ignored elsewhere.
        src: Rank (within ``group``) that holds the objects.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        map_location: Device for received tensors (see :func:`all_gather_object`).
        serializer: ``pickle`` or ``safe`` for what this call receives; ``None`` uses
            the process-wide setting (see :func:`set_serializer`).

    Returns:
        This rank's object (``data[src]`` itself on ``src``).

    Raises:
        TypeError: On ``src``, ``data`` is not a list or holds something unpicklable.
        ValueError: ``src`` is out of range, or ``data`` does not hold one object per rank.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.scatter_object_list(["mine"])
        'mine'

        With 2 ranks::

            dist.scatter_object_list(["a", "b"] if dist.get_rank() == 0 else None)
            # rank 0: 'a'
            # rank 1: 'b'
    """
    fn = "scatter_object_list"
    comm = resolve(group, fn)
    src = _args.rank(src, "src", fn, comm)
    call = _call(fn, comm, map_location, serializer)
    error = None
    if comm.rank == src:  # only src has data: its mistakes must reach the other ranks
        try:
            data = _args.object_list(data, fn, comm)
        except (TypeError, ValueError) as exc:  # the others: "rank <src> passed bad arguments"
            error = exc if comm.alone else Refused(exc, _args.refused(exc, fn, comm))
    return comm.backend.scatter_object(comm, data, src, call, error)


@told
def all_to_all_object(
    data: list[Any],
    group: GroupLike = None,
    map_location: Any = None,
    serializer: Optional[str] = None,
) -> list[Any]:
    """Send the object ``data[r]`` to rank ``r``; return what each rank sent to this one.

    Collective: every rank in ``group`` must call this.
    Single process: returns ``[data[0]]``.

    Args:
        data: One picklable object per rank of ``group``.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        map_location: Device for received tensors (see :func:`all_gather_object`).
        serializer: ``pickle`` or ``safe`` for what this call receives; ``None`` uses
            the process-wide setting (see :func:`set_serializer`).

    Returns:
        One object per rank: element ``r`` came from rank ``r`` (``data[rank]`` itself at
        this rank's index).

    Raises:
        TypeError: ``data`` is not a list, or an object cannot be pickled.
        ValueError: ``data`` does not hold one object per rank.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.all_to_all_object([{"to": 0}])
        [{'to': 0}]

        With 2 ranks::

            rank = dist.get_rank()
            dist.all_to_all_object([f"{rank}->0", f"{rank}->1"])
            # rank 0: ['0->0', '1->0']
            # rank 1: ['0->1', '1->1']
    """
    fn = "all_to_all_object"
    comm = resolve(group, fn)
    data = _args.object_list(data, fn, comm)
    call = _call(fn, comm, map_location, serializer)
    return comm.backend.all_to_all_object(comm, data, call)
