"""Point-to-point messages that return what was sent: no shapes to know in advance.

``recv`` returns what its peer sent: a tensor with the sender's shape and dtype, or any
picklable object (tensors inside it travel as tensors, as in the object collectives).
``exchange`` posts a rank's sends and receives together, so a ring or any pairing never
deadlocks on the order of the calls. How a message travels (a small head in front of a
tensor's bytes, in one message at a size both ends predict from their last messages) is
in :mod:`distkit.dist.backends.p2p`.

**Ordering and tags.** Messages between a pair arrive in the order they were sent, and
each receive takes the next message of its peer on its tag. On gloo, each tag is a stream
of its own: messages on tag 1 never pair with receives on tag 0. NCCL ignores tags: the
messages between a pair form one stream whatever their tags, so post them in the same
order on both ranks (tags still keep distkit's own numbering of the messages apart, which
then fails loudly instead of pairing the wrong messages). A rank cannot send to itself
(torch refuses it too); ``exchange`` returns a rank's own entry as passed.

**Blocking.** ``send`` returns once its peer took the message (gloo's send waits for the
receiver's ``recv``); two ranks that each ``send`` to the other first wait forever (debug
mode says so: see :func:`set_debug`). ``exchange``, or ``isend`` before ``recv``, avoids
that. On NCCL, ``isend`` and ``irecv`` to one peer share its stream, so two ranks
exchanging large tensors that way may block each other (as with torch's own); use
``exchange``, which batches each round.

A ``recv`` whose peer never sends raises :class:`CollectiveTimeoutError` at the group's
timeout, saying where the peer is; an object that cannot be pickled raises on the sender,
and the receiver raises too instead of waiting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable, Literal, TypeVar, Union, overload

from torch import Tensor

from distkit._compat import in_compiled_eager
from distkit.dist._route import resolve
from distkit.dist.backends import p2p as _p2p
from distkit.dist.backends.tensors import TORCH
from distkit.dist.core import args as _args
from distkit.dist.core import layouts, spec
from distkit.dist.core.comm import EAGER, Comm, GroupLike
from distkit.dist.core.shortcut import shortcut
from distkit.dist.handle import Handle

_TAGS = layouts.P2P_TAGS


_F = TypeVar("_F", bound=Callable[..., Any])
_MISS = _p2p.MISS


def _data(data: Any, name: str, fn: str, comm: Comm) -> None:
    """A tensor to send is checked as the tensor collectives check theirs (dense, not a
    DTensor); anything else travels as an object."""
    if isinstance(data, Tensor):
        _args.tensor(data, name, fn, comm)


def _backend(comm: Comm, method: str) -> Callable[..., Any]:
    """``comm``'s backend ``method``; when this runs eagerly inside a compiled function
    (see :func:`distkit._compat.in_compiled_eager`), where the hook would otherwise try to
    compile the backend's functions one by one, the method's eager runner instead (a
    graph break, built once torch._dynamo is imported, as it is under a hook)."""
    if not in_compiled_eager():
        return getattr(comm.backend, method)
    eager = EAGER[method]
    return lambda _comm, *args: eager(comm.pg, *args)


def _lane(method: str, peer: str, fn: Callable[..., Any]) -> Callable[[_F], _F]:
    """The shortcut the spec of ``method`` declares, in front of the public function: the
    plain blocking call on a gloo group takes the torch backend's lane ``fn`` (see
    :mod:`distkit.dist.backends.p2p`); with no process group the checked path raises."""
    returns, when = spec.shortcut_of(method, {})
    return shortcut(returns, lane=(peer, int, fn, _MISS), **when)


@overload
def send(
    data: Any, dst: int, group: GroupLike = ..., tag: int = ..., async_op: Literal[False] = ...
) -> None: ...
@overload
def send(
    data: Any, dst: int, group: GroupLike = ..., tag: int = ..., *, async_op: Literal[True]
) -> Handle[None]: ...
@overload
def send(
    data: Any, dst: int, group: GroupLike = ..., tag: int = ..., async_op: bool = ...
) -> Union[Handle[None], None]: ...
@_lane("send", "dst", TORCH.send_lane)
def send(
    data: Any, dst: int, group: GroupLike = None, tag: int = 0, async_op: bool = False
) -> Union[Handle[None], None]:
    """Send ``data`` (a tensor, or any picklable object) to rank ``dst``.

    Point to point: ``dst`` must call :func:`recv` (or :func:`irecv`, :func:`exchange`)
    with this rank as ``src`` and the same ``tag``.
    Single process: there is no other rank: ``ValueError``, as with any ``dst``.

    Unlike ``torch.distributed.send``, the receiver needs to know nothing in advance: a
    tensor travels with its dtype and shape (any dtype, including bool, complex,
    bfloat16, float8; non-contiguous tensors are sent contiguous), and anything else is
    pickled, with the tensors inside it sent as tensors. The tensor is staged on the
    group's communication device; autograd does not follow it.

    Args:
        data: A tensor, or any picklable object.
        dst: The receiving rank, within ``group``; not this rank.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        tag: An int from 0 to 2**30 - 1 that pairs this message with ``dst``'s receive
            on the same tag (gloo keeps one stream per tag; NCCL ignores tags: see
            :mod:`distkit.dist.p2p`).
        async_op: Return a :class:`~distkit.dist.Handle` at once; its ``wait()`` returns
            ``None`` once the message went out. Keep ``data`` unchanged until then.

    Returns:
        ``None`` once ``dst`` took the message, or a handle with ``async_op=True``.

    Raises:
        TypeError: ``data`` is a tensor without one dense block of memory (sparse, a
            DTensor), or an object that cannot be pickled (``dst`` raises too), or an
            argument has the wrong type.
        ValueError: ``dst`` is out of range or this rank, or ``tag`` is out of range.
        CollectiveTimeoutError: ``dst`` did not take the message within the group's
            timeout; the message says where ``dst`` is.

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> dist.send(torch.ones(2), dst=0)
        Traceback (most recent call last):
        ...
        ValueError: send: dst=0 is this rank: a rank cannot send to or receive from itself ...

        With 2 ranks (the receiver knows nothing of the shape)::

            if dist.get_rank() == 0:
                dist.send(torch.arange(3.0), dst=1)
            else:
                dist.recv(src=0)
            # rank 0: None
            # rank 1: tensor([0., 1., 2.])
    """
    return _send(data, dst, group, tag, async_op, "send")


def _send(data: Any, dst: int, group: GroupLike, tag: int, async_op: Any, fn: str) -> Any:
    comm = resolve(group, fn)
    _data(data, "data", fn, comm)
    tag = _args.tag(tag, fn, comm, _TAGS)
    async_op = _args.flag(async_op, "async_op", fn, comm)
    dst = _args.peer(dst, "dst", fn, comm)  # last: any dst fails in a world of one rank
    return _backend(comm, "send")(comm, data, dst, tag, async_op, _p2p.call_of(fn, comm))


@overload
def recv(
    src: int, group: GroupLike = ..., tag: int = ..., async_op: Literal[False] = ...
) -> Any: ...
@overload
def recv(
    src: int, group: GroupLike = ..., tag: int = ..., *, async_op: Literal[True]
) -> Handle[Any]: ...
@overload
def recv(src: int, group: GroupLike = ..., tag: int = ..., async_op: bool = ...) -> Any: ...
@_lane("recv", "src", TORCH.recv_lane)
def recv(src: int, group: GroupLike = None, tag: int = 0, async_op: bool = False) -> Any:
    """Receive what rank ``src`` sends: a tensor of the sender's shape and dtype, or the
    object.

    Point to point: ``src`` must call :func:`send` (or :func:`isend`, :func:`exchange`)
    with this rank as ``dst`` and the same ``tag``.
    Single process: there is no other rank: ``ValueError``, as with any ``src``.

    Unlike ``torch.distributed.recv``, nothing is pre-allocated: the message carries its
    dtype and shape, and a tensor that has the same size as the last few from ``src``
    arrives in one message, as with torch.

    Args:
        src: The sending rank, within ``group``; not this rank.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        tag: The tag ``src`` sends on (an int from 0 to 2**30 - 1; see :func:`send`).
        async_op: Return a :class:`~distkit.dist.Handle` at once; its ``wait()`` returns
            what ``src`` sent. Receives from one ``src`` on one tag take its messages in
            the order they were made, whatever order their handles are waited in.

    Returns:
        A new tensor (contiguous, on this rank's communication device: the CPU under
        gloo, the current GPU under nccl), or the object (its tensors where the object
        collectives put them), or a handle with ``async_op=True``. The tensor's memory
        is its own: a later message may land in memory an earlier result used only
        once nothing holds that memory any more (the result, a view or array of it, its
        storage), as torch's ``recv`` into one tensor allocated once would.

    Raises:
        TypeError: An argument has the wrong type, or ``src`` sent an object it could not
            pickle (it raises too).
        ValueError: ``src`` is out of range or this rank, or ``tag`` is out of range.
        CollectiveTimeoutError: Nothing came within the group's timeout; the message says
            where ``src`` is (waiting in a recv from this rank, in a collective, ...).
        RankGoneError: ``src`` went away before sending.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.recv(src=1)
        Traceback (most recent call last):
        ...
        ValueError: recv: src=1 is out of range for a group of size 1 (on rank 0 of 1). ...

        With 2 ranks::

            if dist.get_rank() == 0:
                dist.send({"step": 3, "x": torch.ones(2, 2)}, dst=1)
            else:
                dist.recv(src=0)
            # rank 0: None
            # rank 1: {'step': 3, 'x': tensor([[1., 1.], [1., 1.]])}
    """
    return _recv(src, group, tag, async_op, "recv")


def _recv(src: int, group: GroupLike, tag: int, async_op: Any, fn: str) -> Any:
    comm = resolve(group, fn)
    tag = _args.tag(tag, fn, comm, _TAGS)
    async_op = _args.flag(async_op, "async_op", fn, comm)
    src = _args.peer(src, "src", fn, comm)  # last: any src fails in a world of one rank
    return _backend(comm, "recv")(comm, src, tag, async_op, _p2p.call_of(fn, comm))


def isend(data: Any, dst: int, group: GroupLike = None, tag: int = 0) -> Handle[None]:
    """:func:`send` with ``async_op=True`` (torch's name): returns a handle at once.

    Point to point: ``dst`` must receive it (see :func:`send`).
    Single process: there is no other rank: ``ValueError``, as with any ``dst``.

    Args:
        data: A tensor, or any picklable object; keep it unchanged until the handle's
            ``wait()`` returned.
        dst: The receiving rank, within ``group``; not this rank.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        tag: See :func:`send`.

    Returns:
        A :class:`~distkit.dist.Handle` whose ``wait()`` returns ``None`` once the message
        went out.

    Raises:
        TypeError: See :func:`send`.
        ValueError: ``dst`` is out of range or this rank, or ``tag`` is out of range.

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> dist.isend(torch.ones(2), dst=1)
        Traceback (most recent call last):
        ...
        ValueError: isend: dst=1 is out of range for a group of size 1 (on rank 0 of 1). ...

        With 2 ranks, each sends first, then receives (no deadlock)::

            peer = 1 - dist.get_rank()
            handle = dist.isend(torch.tensor([dist.get_rank()]), dst=peer)
            got = dist.recv(src=peer)
            handle.wait()
            # rank 0: got == tensor([1])
            # rank 1: got == tensor([0])
    """
    return _send(data, dst, group, tag, True, "isend")


def irecv(src: int, group: GroupLike = None, tag: int = 0) -> Handle[Any]:
    """:func:`recv` with ``async_op=True`` (torch's name): returns a handle at once.

    Point to point: ``src`` must send to this rank (see :func:`recv`).
    Single process: there is no other rank: ``ValueError``, as with any ``src``.

    On a CPU (gloo) group, a helper thread of the channel posts the receives of what
    follows the message's first part once it arrived (a large tensor, an object's
    tensors), so the sender's blocking ``send`` finishes while this rank works or waits
    in a collective with it, as with torch's ``irecv``; the result is built and decoded
    in the thread that calls ``wait()``.

    Args:
        src: The sending rank, within ``group``; not this rank.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        tag: See :func:`send`.

    Returns:
        A :class:`~distkit.dist.Handle` whose ``wait()`` returns what ``src`` sent.

    Raises:
        TypeError: An argument has the wrong type.
        ValueError: ``src`` is out of range or this rank, or ``tag`` is out of range.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.irecv(src=0)
        Traceback (most recent call last):
        ...
        ValueError: irecv: src=0 is this rank: a rank cannot send to or receive from itself ...

        With 2 ranks::

            if dist.get_rank() == 1:
                handle = dist.irecv(src=0)
                ...  # work while the message comes
                handle.wait()
            else:
                dist.send("hello", dst=1)
            # rank 1: handle.wait() == 'hello'
    """
    return _recv(src, group, tag, True, "irecv")


def exchange(
    sends: Mapping[int, Any], recv_from: Sequence[int], group: GroupLike = None, tag: int = 0
) -> dict[int, Any]:
    """Send ``sends[dst]`` to each ``dst`` and receive from each rank of ``recv_from``,
    all posted at once.

    Point to point: each ``dst`` must receive from this rank (its own ``exchange`` with
    this rank in ``recv_from``, or a :func:`recv`), and each rank of ``recv_from`` must
    send to it, on the same ``tag``. Ranks not named take no part.
    Single process: ``exchange({0: x}, [0])`` returns ``{0: x}``.

    Every message goes out before any is waited for, so a ring (send to the next rank,
    receive from the previous one) or any pairing completes whatever order the ranks call
    it in, where blocking ``send``/``recv`` pairs would wait for each other. Like
    :func:`send`, any tensors and objects travel, shapes unknown to the receivers.

    Args:
        sends: ``dst -> data`` (a tensor or any picklable object) for each rank to send
            to; this rank's own entry, if any, is returned as passed (list it in
            ``recv_from`` too).
        recv_from: The ranks to receive from, each once; this rank to get its own entry.
        group: See :data:`~distkit.dist.GroupLike` (``None``: the default group).
        tag: See :func:`send`.

    Returns:
        ``{src: what src sent}`` for each rank of ``recv_from``, in its order (this
        rank's own entry is ``sends[rank]`` itself; received tensors are new).

    Raises:
        TypeError: ``sends`` is not a mapping of ranks, ``recv_from`` not a list of
            ranks, a tensor has no dense block of memory, or an object cannot be
            pickled (its receiver raises too).
        ValueError: A rank is out of range, repeated in ``recv_from`` or named by two
            keys of ``sends``, this rank is in
            one of ``sends`` and ``recv_from`` but not the other, or ``tag`` is out of
            range.
        CollectiveTimeoutError: A peer did not send or receive within the group's
            timeout; the message says where it is.

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> dist.exchange({0: torch.ones(2)}, [0])
        {0: tensor([1., 1.])}

        With 3 ranks, a ring (each sends to the next, receives from the previous)::

            rank, n = dist.get_rank(), dist.get_world_size()
            dist.exchange({(rank + 1) % n: torch.ones(rank + 1)}, [(rank - 1) % n])
            # rank 0: {2: tensor([1., 1., 1.])}
            # rank 1: {0: tensor([1.])}
            # rank 2: {1: tensor([1., 1.])}
    """
    fn = "exchange"
    comm = resolve(group, fn)
    if sends.__class__ is not dict and not isinstance(sends, Mapping):
        _args.fail(
            TypeError,
            fn,
            comm,
            f"sends must be a dict of rank -> data, got {_args.show(sends)}",
            "Pass {dst: data} for each rank to send to",
        )
    if recv_from.__class__ not in (list, tuple) and (
        not isinstance(recv_from, Sequence) or isinstance(recv_from, (str, bytes))
    ):
        _args.fail(
            TypeError,
            fn,
            comm,
            f"recv_from must be a list of ranks, got {_args.show(recv_from)}",
        )
    checked: dict[int, Any] = {}
    for dst, data in sends.items():
        dst = _args.rank(dst, "a key of sends", fn, comm)
        if dst in checked:  # two keys for one rank (say 1 and torch.tensor(1))
            _args.fail(
                ValueError,
                fn,
                comm,
                f"sends has two keys for rank {dst}",
                "Send one message per rank per exchange (put several in a list)",
            )
        _data(data, f"sends[{dst}]", fn, comm)
        checked[dst] = data
    sources: list[int] = []
    for i, src in enumerate(recv_from):
        src = _args.rank(src, f"recv_from[{i}]", fn, comm)
        if src in sources:
            _args.fail(
                ValueError,
                fn,
                comm,
                f"recv_from names rank {src} twice",
                "Receive from each rank once per exchange",
            )
        sources.append(src)
    me = comm.rank
    if (me in checked) != (me in sources):
        what = (
            f"sends has an entry for this rank ({me}), which recv_from does not list"
            if me in checked
            else f"recv_from lists this rank ({me}), for which sends has no entry"
        )
        _args.fail(
            ValueError,
            fn,
            comm,
            what,
            "This rank's own entry comes back as passed: put it in both, or in neither",
        )
    tag = _args.tag(tag, fn, comm, _TAGS)
    return _backend(comm, "exchange")(comm, checked, sources, tag, _p2p.call_of(fn, comm))
