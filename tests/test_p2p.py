"""Point to point: send, recv, isend, irecv and exchange of tensors of any shape and dtype
and of any objects, in order, on tags, in rings; and every error on both ranks."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
from conftest import WORLDS, debug_mode, in_fresh_world, world
from test_objects import check_payload, make

import distkit.dist as dist
from distkit import _settings
from distkit.dist.backends import p2p as _p2p
from distkit.testing import ranks
from distkit.utils import get_group

F8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


def tensors(rank: int) -> list[torch.Tensor]:
    """A tensor of every dtype distkit moves, and of every awkward layout, by rank."""
    base = torch.arange(24, dtype=torch.float32).view(2, 3, 4) + rank
    out = [
        torch.tensor([True, rank % 2 == 0, False]),
        torch.arange(5, dtype=torch.uint8) + rank,
        torch.arange(-3, 3, dtype=torch.int8) * (rank + 1),
        torch.tensor([-(2**15), 2**15 - 1, rank], dtype=torch.int16),
        torch.tensor([2**31 - 1, -(2**31), rank], dtype=torch.int32),
        torch.tensor([2**62, -(2**62), rank], dtype=torch.int64),
        torch.tensor([2**16 - 1, rank], dtype=torch.uint16),
        torch.tensor([2**32 - 1, rank], dtype=torch.uint32),
        torch.tensor([2**63 + 5, rank], dtype=torch.uint64),
        torch.tensor([0.5, -1.25, rank], dtype=torch.float16),
        torch.tensor([0.5, 1e30, rank], dtype=torch.bfloat16),
        torch.tensor([1.5, rank], dtype=torch.float64),
        torch.tensor([complex(rank, -1), 2j], dtype=torch.complex64),
        torch.tensor([complex(1, rank)], dtype=torch.complex128),
        torch.tensor([complex(1, rank)], dtype=torch.complex64).conj(),  # a lazy conjugate
        -torch.tensor([1.0, rank]),
        torch.tensor(rank * 2.5),  # 0-d
        torch.empty(0, 7),  # empty
        torch.empty(3, 0, dtype=torch.int64),
        base.transpose(0, 2),  # non-contiguous
        base[:, ::2, 1:],  # a strided view
        torch.ones(2, 1).expand(2, 5),  # expanded: one element shared by a row
        torch.zeros([1] * 30),  # more dims than the smallest capacity's head holds inline
        *[torch.tensor([0.5, -2.0, rank]).to(dtype) for dtype in F8],
    ]
    return out


def same(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert isinstance(got, torch.Tensor), what
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got, want)
    assert got.is_contiguous() and got.device.type == "cpu", what
    assert not got.is_conj() and not got.is_neg(), what
    assert not got.requires_grad, what
    left = got.resolve_conj().resolve_neg()
    right = want.resolve_conj().resolve_neg()
    if want.dtype in F8:
        left, right = left.view(torch.uint8), right.contiguous().view(torch.uint8)
    assert torch.equal(left, right), (what, got, want)


# -- a world of one rank -------------------------------------------------------------------


@ranks(0, 1)
def test_a_world_of_one_exchanges_with_itself_and_refuses_send_and_recv():
    x, obj = torch.ones(2), {"a": [1]}
    out = dist.exchange({0: x}, [0])
    assert list(out) == [0] and out[0] is x
    assert dist.exchange({0: obj}, [0])[0] is obj
    assert dist.exchange({}, []) == {}
    for call in (
        lambda: dist.send(x, 0),
        lambda: dist.recv(0),
        lambda: dist.isend(x, 0),
        lambda: dist.irecv(0),
    ):
        with pytest.raises(ValueError, match="is this rank: a rank cannot send to or receive"):
            call()
    with pytest.raises(ValueError, match="dst=1 is out of range for a group of size 1"):
        dist.send(x, 1)


# -- every dtype, every layout ----------------------------------------------------------------


@ranks(*WORLDS)
def test_a_ring_exchange_moves_every_dtype_and_layout():
    rank, size = world()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    mine, theirs = tensors(rank), tensors(prv)
    for i, t in enumerate(mine):
        got = dist.exchange({nxt: t}, [prv])
        assert list(got) == [prv]
        if prv == rank:
            assert got[prv] is t  # this rank's own entry, as passed
        else:
            same(got[prv], theirs[i], f"tensor {i}")


@ranks(*WORLDS)
def test_send_and_recv_every_dtype_from_rank_0():
    rank, size = world()
    if size == 1:
        with pytest.raises(ValueError):
            dist.send(torch.ones(1), 0)
        return
    if rank == 0:
        for dst in range(1, size):
            for t in tensors(dst):
                assert dist.send(t, dst) is None
    else:
        for i, want in enumerate(tensors(rank)):
            same(dist.recv(0), want, f"tensor {i}")


@ranks(2, 3)
def test_tensors_that_require_grad_arrive_without_history_and_large_ones_own_their_memory():
    rank = dist.get_rank()
    big = torch.arange((_p2p.TENSOR_INLINE // 4) + 100, dtype=torch.float32)  # sent apart
    medium = torch.arange(500_000, dtype=torch.float32)  # 2 MB, in its frame
    if rank == 0:
        dist.send(torch.ones(3, requires_grad=True) * 2, 1)
        dist.send(big, 1)
        dist.send(medium, 1)
        dist.send(medium[:10].clone(), 1)  # small after medium: copied out of its buffer
    elif rank == 1:
        got = dist.recv(0)
        assert not got.requires_grad and got.tolist() == [2.0] * 3
        large = dist.recv(0)
        assert torch.equal(large, big)
        assert large.untyped_storage().nbytes() == large.numel() * 4
        assert torch.equal(dist.recv(0), medium)
        small = dist.recv(0)
        assert small.untyped_storage().nbytes() == 40 and small.tolist() == medium[:10].tolist()


# -- objects ----------------------------------------------------------------------------------


@ranks(*WORLDS)
def test_objects_with_tensors_inside_travel_in_a_ring():
    rank, size = world()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    mine = make(rank)
    got = dist.exchange({nxt: mine}, [prv])[prv]
    if prv == rank:
        assert got is mine
    else:
        check_payload(got, prv)


@ranks(2, 3)
def test_large_tensors_in_objects_arrive_apart_in_memory_of_their_own():
    rank = dist.get_rank()
    feats = [torch.full((300_000,), float(i)) for i in range(8)]  # 9.6 MB in all
    if rank == 0:
        dist.send({"feats": feats, "small": torch.arange(3), "name": "x"}, 1)
        dist.send([feats[0], feats[0]], 1)  # one tensor twice: one object on arrival
    elif rank == 1:
        got = dist.recv(0)
        assert got["name"] == "x" and got["small"].tolist() == [0, 1, 2]
        for i, t in enumerate(got["feats"]):
            assert torch.equal(t, feats[i])
            assert t.untyped_storage().nbytes() == t.numel() * 4  # its own memory
        twice = dist.recv(0)
        assert twice[0] is twice[1] and torch.equal(twice[0], feats[0])


@ranks(2, 3)
def test_an_object_that_cannot_be_pickled_raises_on_both_ranks():
    rank, _ = world()
    if rank == 0:
        with pytest.raises(TypeError, match="cannot be pickled"):
            dist.send({"lock": threading.Lock()}, 1)
        dist.send("after", 1)  # the pair is still in step
    elif rank == 1:
        with pytest.raises(TypeError, match="rank 0 could not send its object"):
            dist.recv(0)
        assert dist.recv(0) == "after"


# -- order, tags, handles -------------------------------------------------------------------


def _shapes(k: int) -> torch.Tensor:
    """Message k of a sequence whose sizes grow, shrink and jump past the capacities."""
    n = [3, 3, 3, 5000, 10, 0, 200_000, 200_000, 7, 1_200_000][k % 10] + k
    return torch.arange(n, dtype=torch.int32)


def _mixed(k: int):
    """Message k of a sequence that crosses every size rule of the wire (in the frame's
    first message, a rest beyond the channel's capacity, a tensor sent apart), with
    objects and a sender's failure between."""
    kind = [1, 1, 2, 1, 0, 1, 3, 1][k % 8]
    if kind == 0:
        return {"k": k, "t": torch.full((70_000,), float(k))}  # an object, a tensor inside
    if kind == 3:
        return {"unpicklable": threading.Lock()}
    n = [3, 300_000, 300_001, 1_100_000, 40, 120_000, 0][(k * 5) % 7]  # 1.1M: apart
    return torch.arange(n // (3 if kind == 2 else 1), dtype=torch.int32) + k


def _send_by(how: int, data, pending: list) -> None:
    """Send ``data`` to rank 1 by ``send`` (0), ``isend`` (1, its handle kept in
    ``pending``) or ``exchange`` (2)."""
    if how == 0:
        dist.send(data, 1)
    elif how == 1:
        pending.append(dist.isend(data, 1))
    else:
        dist.exchange({1: data}, [])


def _recv_by(how: int):
    """Receive from rank 0 by ``recv`` (0), ``irecv`` (1) or ``exchange`` (2)."""
    if how == 0:
        return dist.recv(0)
    if how == 1:
        return dist.irecv(0).wait()
    return dist.exchange({}, [0])[0]


@ranks(2)
def test_every_pairing_of_send_and_receive_paths_agrees_on_the_wire():
    """The sender's path (send, isend, exchange) and the receiver's (recv, irecv,
    exchange) are chosen apart, message by message: whatever each end takes, both size
    the frames alike and every message arrives whole."""
    import random

    rank = dist.get_rank()
    rng = random.Random(7)
    plan = [(rng.randrange(3), rng.randrange(3)) for _ in range(32)]
    pending = []
    for k, (how_send, how_recv) in enumerate(plan):
        want = _mixed(k)
        failing = isinstance(want, dict) and "unpicklable" in want
        if rank == 0:
            if failing:
                with pytest.raises(TypeError, match="cannot be pickled"):
                    if how_send == 1:
                        dist.isend(want, 1).wait()
                    else:
                        dist.send(want, 1)
            else:
                _send_by(how_send, want, pending)
            continue
        if failing:
            with pytest.raises(TypeError, match="rank 0 could not send its object"):
                dist.recv(0)
            continue
        got = _recv_by(how_recv)
        if isinstance(want, dict):
            assert got["k"] == k and torch.equal(got["t"], want["t"]), k
        else:
            assert torch.equal(got, want), (k, got.shape, want.shape)
    for h in pending:
        h.wait()


def _runs() -> list:
    """Messages in runs of one dtype and shape (the third of a run on goes bare: its bytes
    alone), broken by every message that must not be taken for one more of the run: an
    object and a sender's failure (frames shorter than the run's tensors), the same bytes
    in another shape or dtype, a smaller and a larger tensor, an empty one, a 0-d one; and
    a run of tensors sent apart. ``(message, whether it goes bare)``."""
    a = torch.arange(256 * 256, dtype=torch.float32).view(256, 256)
    b = torch.arange(512 * 128).to(torch.bfloat16).view(512, 128)
    big = torch.arange(1_200_000, dtype=torch.float32)  # past the frame: sent apart
    breaks = [
        {"k": "an object", "t": torch.ones(3)},
        a.flatten(),
        a.to(torch.int32),
        torch.ones(1000),
        torch.ones(300, 300),
        "unpicklable",
        torch.empty(0, 256),
        torch.tensor(2.5),
        b,  # another dtype, half the bytes
    ]
    # first, small ones: the channel's capacity and last tensors are theirs, whatever the
    # tests before this one in the same world sent
    out: list = [(torch.ones(3) + k, False) for k in range(4)]
    for k, brk in enumerate(breaks):
        t = a + k
        out += [(t, False), (t * 2, False), (t * 3, True), (t * 4, True), (brk, False)]
    b2 = torch.arange(512 * 256).to(torch.bfloat16).view(512, 256)  # a's bytes
    out += [(b2 + k, k >= 2) for k in range(4)]
    out += [(big + k, k >= 2) for k in range(4)] + [(torch.ones(5), False), (a, False)]
    return out


@ranks(2)
@pytest.mark.parametrize("seed", [0, 1])
def test_runs_of_one_shape_go_bare_on_every_path_and_nothing_else_is_taken_for_one(seed):
    """A tensor that follows two of its dtype and shape travels as its bytes alone; the
    receiver knows it by the mark behind them. Whatever path each end takes (send, isend,
    exchange; recv, irecv, exchange), every message arrives whole and as what it was, and
    the bare ones are the receiver's buffer itself (no head in front of them)."""
    import random

    rank = dist.get_rank()
    rng = random.Random(seed)
    messages = _runs()
    plan = [(rng.randrange(3), rng.randrange(3)) for _ in messages]
    pending = []
    for k, ((want, bare), (how_send, how_recv)) in enumerate(zip(messages, plan)):
        failing = isinstance(want, str)
        if rank == 0:
            data = {"unpicklable": threading.Lock()} if failing else want
            if failing:
                with pytest.raises(TypeError, match="cannot be pickled"):
                    dist.send(data, 1)
            else:
                _send_by(how_send, data, pending)
            continue
        if failing:
            with pytest.raises(TypeError, match="rank 0 could not send its object"):
                dist.recv(0)
            continue
        got = _recv_by(how_recv)
        if isinstance(want, dict):
            assert got["k"] == want["k"] and torch.equal(got["t"], want["t"]), k
            continue
        same(got, want, f"message {k}")
        if want.numel() * want.element_size() <= _p2p.TENSOR_INLINE:
            # a bare message is received at the start of its buffer, the mark behind it;
            # a framed one behind its head
            at_start = got.storage_offset() == 0
            room = got.untyped_storage().nbytes() - got.nbytes
            assert (at_start and room >= _p2p.MARK) == bare, (k, at_start, room)
    for h in pending:
        h.wait()


@ranks(2)
def test_a_small_send_after_a_run_of_large_ones_keeps_no_large_buffer():
    """The message that breaks a bare run of tensors over 4 MiB is padded past them in a
    buffer of its own: the channel's reused frame buffer stays at most its usual size."""
    from distkit.dist._route import resolve

    rank, tag = dist.get_rank(), 12
    big = torch.arange(5 << 18, dtype=torch.float32)  # 5 MiB: the third goes bare
    for k in range(3):
        if rank == 0:
            dist.send(big + k, 1, tag=tag)
        else:
            same(dist.recv(0, tag=tag), big + k)
    small = torch.arange(10.0)
    if rank == 0:
        dist.send(small, 1, tag=tag)
        stage = _p2p.channel(resolve(None, "send"), "send", 1, tag).stage
        assert stage is None or stage.size <= _p2p.STAGE_BYTES, stage.size
    else:
        same(dist.recv(0, tag=tag), small)


@ranks(2, 3, 4)
def test_messages_arrive_in_order_and_tags_are_streams_of_their_own():
    rank = dist.get_rank()
    if rank == 0:  # sends that wait for their receive would wait here for tag 0's
        handles = [dist.isend(_shapes(k), 1, tag=k % 2) for k in range(20)]
        for h in handles:
            h.wait()
    elif rank == 1:
        odd = [dist.recv(0, tag=1) for _ in range(10)]  # gloo: tag 1 first, tag 0 waits
        even = [dist.recv(0, tag=0) for _ in range(10)]
        for j in range(10):
            assert torch.equal(even[j], _shapes(2 * j)), j
            assert torch.equal(odd[j], _shapes(2 * j + 1)), j


@ranks(2, 3, 4)
def test_async_handles_return_what_was_sent_whatever_order_they_are_waited_in():
    rank = dist.get_rank()
    if rank == 0:
        handles = [dist.isend(_shapes(k), 1) for k in range(12)]
        handles.append(dist.isend({"k": "last"}, 1))
        for h in reversed(handles):
            assert h.wait() is None
        assert all(h.is_completed() for h in handles)
    elif rank == 1:
        handles = [dist.irecv(0) for _ in range(13)]
        for k in reversed(range(12)):
            assert torch.equal(handles[k].wait(), _shapes(k)), k
        assert handles[12].wait() == {"k": "last"}
        assert dist.recv(0, async_op=True).wait() == "sync"
    if rank == 0:
        assert dist.send("sync", 1, async_op=True).wait() is None


@ranks(2, 3)
def test_waiting_for_a_receive_does_not_wait_for_the_ones_queued_after_it():
    """The second message comes only once the first is answered: waiting for the first
    ``irecv`` must not wait for the second's message (it once did, until the timeout)."""
    rank = dist.get_rank()
    if rank == 0:
        first, second = dist.irecv(1), dist.irecv(1)
        assert torch.equal(first.wait(), torch.full((10,), 1.0))
        dist.send("answer", 1)
        assert torch.equal(second.wait(), torch.arange(3000.0))  # over the first's frame
    elif rank == 1:
        dist.send(torch.full((10,), 1.0), 0)
        assert dist.recv(0) == "answer"
        dist.send(torch.arange(3000.0), 0)


@ranks(2, 3, timeout=60)
def test_an_irecv_lets_its_senders_blocking_send_finish_before_it_is_waited_for():
    """What follows an ``irecv``'s frame (the rest of a frame over the channel's
    capacity, a tensor's bytes over 4 MiB, an object's tensors, the next queued
    ``irecv``'s frame) is posted without this rank's next call: the sender's blocking
    ``send`` returns while this rank waits in a collective with it, at any call (the
    default check, which would also post them, is off here)."""
    _settings.set("check", False)
    rank, _ = world()
    small, big = torch.arange(3000.0), torch.arange(1_100_000.0)  # 12 KB; 4.4 MB apart
    if rank == 0:
        for data in (small, big, {"t": big, "n": 7}):
            dist.send(data, 1)
    elif rank == 1:
        handles = [dist.irecv(0) for _ in range(3)]
    dist.all_reduce(torch.ones(1))  # rank 0 comes only once its sends returned
    if rank == 1:
        deadline = time.monotonic() + 10
        while not handles[0].is_completed():  # in one frame and its rest: arrived
            assert time.monotonic() < deadline, "is_completed() never turned True"
            time.sleep(0.01)
        assert torch.equal(handles[0].wait(), small)
        assert torch.equal(handles[1].wait(), big)
        got = handles[2].wait()
        assert got["n"] == 7 and torch.equal(got["t"], big)


@ranks(2, timeout=60)
def test_an_irecv_polled_while_its_helper_posts_the_parts_apart_waits_for_them():
    """A tensor over 4 MiB, or an object's large tensors, follow the frame in messages of
    their own, which the channel's helper thread posts: ``is_completed()`` and ``wait()``
    called meanwhile must not take the receive as posted before those exist (they once
    did: ``wait()`` returned a tensor still being written, or raised ``IndexError``)."""
    rank, _ = world()
    n = (6 << 20) // 4
    for i in range(10):
        sent = torch.arange(i, i + n, dtype=torch.float32) if i % 2 else {"t": torch.full((n,), i)}
        if rank == 0:
            dist.send(sent, 1)
            continue
        handle = dist.irecv(0)
        until = time.monotonic() + 0.05
        while time.monotonic() < until:  # polled while the frame comes and parts are posted
            assert not handle.is_completed(), "its parts apart were never waited for"
        got = handle.wait()
        if i % 2:
            assert torch.equal(got, sent), i
        else:
            assert torch.equal(got["t"], sent["t"]), i


@ranks(2, 3, 4)
def test_each_rank_sends_first_then_receives_with_isend():
    rank, size = world()
    peer = rank ^ 1
    if peer >= size:
        return
    handle = dist.isend(torch.full((rank + 1,), rank), peer)
    got = dist.recv(peer)
    handle.wait()
    assert got.tolist() == [peer] * (peer + 1)


# -- the lanes ---------------------------------------------------------------------------------


@contextlib.contextmanager
def checked_calls():
    """Record which point-to-point calls take the checked path inside the block (the plain
    blocking ``send``/``recv`` on gloo take the torch backend's lanes instead)."""
    import distkit.dist.p2p as public

    seen: list[str] = []

    def counted(name, fn):
        def call(*args):
            seen.append(name)
            return fn(*args)

        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(public, "_send", counted("send", public._send))
        mp.setattr(public, "_recv", counted("recv", public._recv))
        yield seen


@ranks(2, 3)
def test_plain_blocking_calls_take_the_lane_and_the_others_the_checked_path():
    """Whichever path each end takes, the message arrives whole: the lanes send the
    checked path's bytes."""
    rank, _ = world()
    if rank > 1:
        return
    dist.send(torch.ones(1), 1) if rank == 0 else dist.recv(0)  # the group's facts, once
    x = torch.arange(12.0).view(3, 4)
    cases = [  # (what rank 0 sends, send kwargs, recv kwargs, which path each end takes)
        (x, {}, {}, [], []),
        (x, {"tag": 1}, {"tag": 1}, ["send"], ["recv"]),
        (x.t(), {}, {}, ["send"], []),  # not contiguous: the sender's checked path
        ({"step": 3, "x": x}, {}, {}, ["send"], []),  # an object: the receiver's lane
        (torch.arange(_p2p.TENSOR_INLINE // 4 + 1, dtype=torch.float32), {}, {}, ["send"], []),
        (x.to(torch.bfloat16), {}, {}, [], []),
    ]
    for want, send_kw, recv_kw, sender_path, receiver_path in cases:
        with checked_calls() as seen:
            got = dist.send(want, 1, **send_kw) if rank == 0 else dist.recv(0, **recv_kw)
        assert seen == (sender_path if rank == 0 else receiver_path), (rank, seen)
        if rank == 1 and isinstance(want, dict):
            assert got["step"] == 3 and torch.equal(got["x"], x)
        elif rank == 1:
            same(got, want)
        else:
            assert got is None
    with debug_mode(), checked_calls() as seen:  # debug mode pairs each call: checked
        got = dist.send(x, 1) if rank == 0 else dist.recv(0)
    assert seen == (["send"] if rank == 0 else ["recv"])
    if rank == 1:
        same(got, x)


@ranks(2, 3)
def test_the_lanes_raise_what_the_checked_path_raises():
    rank, size = world()
    dist.barrier()  # the group's facts, once
    for bad in (rank, size, -1):
        with checked_calls() as seen, pytest.raises(ValueError) as caught:
            dist.send(torch.ones(1), bad)
        assert seen == ["send"] and f"(on rank {rank} of {size})" in str(caught.value)
        with checked_calls() as seen, pytest.raises(ValueError) as caught:
            dist.recv(bad)
        assert seen == ["recv"] and f"(on rank {rank} of {size})" in str(caught.value)
    with pytest.raises(TypeError, match="sparse_coo tensor"):
        dist.send(torch.eye(2).to_sparse(), (rank + 1) % size)
    dist.barrier()  # nothing was sent: the ranks are in step


@ranks(2)
def test_a_second_thread_on_a_busy_group_cannot_send_through_the_lane():
    rank, _ = world()
    if rank == 1:
        time.sleep(2)  # keeps rank 0's first thread inside its recv
        dist.send(torch.ones(2), 0)
        return
    got = []
    waiting = threading.Thread(target=lambda: got.append(dist.recv(1)), name="loader")
    waiting.start()
    time.sleep(0.5)
    with pytest.raises(RuntimeError) as caught:
        dist.send(torch.ones(1), 1)
    assert "thread 'loader' is in a collective on this group already" in str(caught.value)
    waiting.join(10)
    assert not waiting.is_alive() and torch.equal(got[0], torch.ones(2))


def _keepers():
    """Ways to keep a received tensor's memory while dropping the tensor itself."""
    import torch.utils.dlpack

    class Sub(torch.Tensor):
        pass

    return {
        "a view": lambda r: r[1:],
        "a reshaped view": lambda r: r.view(-1),
        "its storage": lambda r: r.untyped_storage(),
        "an array": lambda r: r.numpy(),
        "a memoryview of an array": lambda r: memoryview(r.numpy()),
        "its base": lambda r: r._base,
        "a dlpack capsule": lambda r: torch.utils.dlpack.to_dlpack(r),
        "a subclass view": lambda r: r.as_subclass(Sub),
        "a dtype view": lambda r: r.view(torch.int32),
    }


def _read(kept) -> torch.Tensor:
    """The bytes ``kept`` (see :func:`_keepers`) sees, as a flat float32 tensor (a copy).
    Compared bit for bit: a storage also shows what lies behind the message in its
    buffer (the mark a receive writes, uninitialized bytes), which may read as NaN."""
    import torch.utils.dlpack

    if isinstance(kept, memoryview):
        kept = torch.frombuffer(kept, dtype=torch.float32)
    elif isinstance(kept, torch.UntypedStorage):
        kept = torch.tensor([], dtype=torch.uint8).set_(kept)
    elif type(kept).__name__ == "PyCapsule":
        kept = torch.utils.dlpack.from_dlpack(kept)
    t = torch.as_tensor(kept)
    if t.dtype is not torch.float32:
        t = t.contiguous().view(torch.uint8).view(torch.float32)
    return t.flatten().clone()


@ranks(2)
def test_a_receive_buffer_is_reused_only_once_nothing_holds_its_memory():
    """recv returns views of its channel's buffer, and receives the next message into it
    again once the result is dropped: never while anything still reaches that memory."""
    rank = dist.get_rank()
    keepers = _keepers()
    n = 64 * 1024  # 256 KiB: past the sizes that are copied out of their buffer
    tag = 11  # a channel of its own, whatever the tests before it in this world sent
    if rank == 0:
        for k in range(4 + 3 * len(keepers) + 2):
            dist.send(torch.full((4, n // 4), float(k)), 1, tag=tag)
        return
    # dropped results: the next message lands in the same buffer (the very tensor the
    # channel keeps, followed by a weak reference, which holds nothing)
    import weakref

    from distkit.dist._route import resolve

    spare = _p2p.channel(resolve(None, "recv"), "recv", 0, tag).spare
    for _ in range(2):  # the first, larger than the channel's capacity yet, comes in two
        dist.recv(0, tag=tag)
    kept = weakref.ref(spare.buf)
    ptrs = [dist.recv(0, tag=tag).data_ptr() for _ in range(2)]
    if torch._C.__dict__.get("_storage_Use_Count") is not None:  # torch can count
        assert spare.buf is kept() and ptrs[0] == ptrs[1], ptrs
    k = 4
    for name, keep in keepers.items():
        got = dist.recv(0, tag=tag)
        kept = keep(got)
        capsule = name == "a dlpack capsule"  # read once only: at the end
        expected = got.flatten().clone() if capsule else _read(kept)
        del got
        for _ in range(2):  # two more messages: neither may land in the kept memory
            k += 1
            assert dist.recv(0, tag=tag).flatten()[0].item() == k
        now = _read(kept)
        assert torch.equal(now.view(torch.int32), expected.view(torch.int32)), name
        # what is kept shows the message (its storage and base: the whole buffer)
        shown = int((expected == float(k - 2)).sum())
        assert shown >= n - (n // 4 if "view" in name else 0), name
        k += 1
    # moved to shared memory (as a torch.multiprocessing queue does when it is put in one):
    # another process may map it, and no count in this one sees that
    got = dist.recv(0, tag=tag)
    got.share_memory_()
    shared = got.data_ptr()
    del got
    assert dist.recv(0, tag=tag).data_ptr() != shared


# -- rings and pairings ------------------------------------------------------------------------


@ranks(*WORLDS)
def test_ring_exchanges_of_changing_shapes_never_deadlock():
    rank, size = world()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    for step in range(8):
        n = [10, 10, 100_000, 3, 2_000_000, 2_000_000, 0, 50][step]
        mine = torch.full((n + rank,), float(rank * 100 + step))
        got = dist.exchange({nxt: mine}, [prv])[prv]
        if prv == rank:
            assert got is mine
        else:
            assert got.tolist() == [float(prv * 100 + step)] * (n + prv)


@ranks(*WORLDS)
def test_an_exchange_with_every_rank():
    rank, size = world()
    sends = {d: {"from": rank, "to": d, "t": torch.arange(rank + d)} for d in range(size)}
    got = dist.exchange(sends, list(reversed(range(size))))
    assert list(got) == list(reversed(range(size)))
    assert got[rank] is sends[rank]
    for s, obj in got.items():
        assert obj["from"] == s and obj["to"] == rank and obj["t"].tolist() == list(range(s + rank))


@ranks(3, 4)
def test_exchange_pairs_with_plain_send_and_recv_on_a_sub_group():
    rank = dist.get_rank()
    group = get_group([1, 2])  # creating a group is collective: every rank
    if rank == 1:  # group rank 0 of [1, 2]
        assert dist.exchange({1: torch.ones(2)}, [1], group=group)[1].tolist() == [2.0]
    elif rank == 2:  # group rank 1
        handle = dist.irecv(0, group=group)
        dist.send(torch.full((1,), 2.0), 0, group=group)
        assert handle.wait().tolist() == [1.0, 1.0]


@ranks(2, timeout=60)
@pytest.mark.parametrize("order", ["send first", "recv first"])
def test_debug_mode_lets_an_exchange_meet_plain_sends_and_recvs(order):
    """An exchange posts all its messages at once: a peer may serve them one blocking
    call at a time. Debug mode once waited for every end before sending (a deadlock),
    and a check racing the peer's cleanup read a deleted post (a false mismatch)."""
    rank = dist.get_rank()
    with debug_mode():
        for _ in range(5):  # the races were one run in two
            if rank == 0:
                got = dist.exchange({1: torch.ones(2)}, [1])
                assert got[1].tolist() == [0.0, 0.0, 0.0]
                assert dist.exchange({}, [1])[1].tolist() == [7.0]
            elif order == "send first":
                dist.send(torch.zeros(3), 0)
                assert dist.recv(0).tolist() == [1.0, 1.0]
                dist.send(torch.full((1,), 7.0), 0)
            else:
                assert dist.recv(0).tolist() == [1.0, 1.0]
                dist.send(torch.zeros(3), 0)
                dist.send(torch.full((1,), 7.0), 0)


def _a_handle_outliving_its_group() -> bool:
    rank = dist.get_rank()
    sub = torch.distributed.new_group([0, 1], backend="gloo")
    handle = dist.irecv(1 - rank, group=sub, tag=3)  # neither rank sends
    dist.barrier()
    torch.distributed.destroy_process_group(sub)
    said = (
        "irecv: this handle's process group was destroyed .* before its messages were "
        f"waited for \\(on rank {rank} of 2\\)"
    )
    for call in (handle.is_completed, handle.wait):
        with pytest.raises(RuntimeError, match=said):
            call()
    return True


def test_a_handle_whose_group_was_destroyed_says_so_on_every_rank():
    """Its messages can no longer come: a clear error at once, not a ``KeyError`` from
    torch's tables or a timeout that blames the peer."""
    assert in_fresh_world(_a_handle_outliving_its_group, 2, timeout=60) == [True, True]


@ranks(2, timeout=60)
def test_a_handle_that_timed_out_raises_again_and_reads_nothing():
    rank = dist.get_rank()
    group = get_group([0, 1], timeout=30)
    if rank == 1:
        handle = dist.irecv(0, group=group)
        with pytest.raises(dist.CollectiveTimeoutError):
            handle.wait(timeout=timedelta(seconds=0.5))
        for again in (handle.is_completed, handle.wait):  # its buffer was never filled
            with pytest.raises(dist.CollectiveTimeoutError):
                again()
    dist.barrier()


# -- errors: timeouts, debug mode ------------------------------------------------------------


@ranks(2, timeout=60)
def test_a_recv_whose_peer_never_sends_names_the_peer_and_where_it_is():
    rank, _ = world()
    _settings.set("hang_grace", 4.0)  # room for rank 1's answer on a loaded machine
    group = get_group([0, 1], timeout=2)
    # the pool's ranks joined with torch's init_process_group: a rank answers roll calls
    # from its first distkit collective on (or from init_dist), not before
    dist.barrier()
    if rank == 0:
        with pytest.raises(dist.CollectiveTimeoutError) as info:
            dist.recv(1, group=group)
        text = str(info.value)
        assert "recv timed out on rank 0, waiting to recv message #1 from rank 1" in text, text
        assert "Rank 1 is at tests/test_p2p.py:" in text and "not in a distkit call" in text, text
        assert info.value.missing == [1]
        assert "\nThe group cannot be used any more: the message may still arrive" in text, text
        with pytest.raises(RuntimeError, match="cannot be used any more"):
            dist.recv(1, group=group)
    else:
        time.sleep(7)  # busy elsewhere, in no distkit call, past the timeout and the grace
    dist.barrier()  # the default group was never involved


@ranks(2, timeout=60)
def test_two_ranks_that_both_receive_are_named_at_the_timeout():
    rank, _ = world()
    _settings.set("hang_grace", 2.0)
    group = get_group([0, 1], timeout=2)
    if rank == 0:
        with pytest.raises(dist.CollectiveTimeoutError) as info:
            dist.recv(1, group=group)
        text = str(info.value)
        assert "Rank 1 is waiting in irecv with this rank (rank 0), tag 0, at" in text, text
    else:  # waits longer than the group's timeout: rank 0 times out first
        handle = dist.irecv(0, group=group)
        with pytest.raises(dist.CollectiveTimeoutError) as info:
            handle.wait(timeout=8)
        text = str(info.value)  # gloo closed the pair when rank 0's wait timed out
        assert "rank 0 closed the connection while this rank was waiting to recv" in text, text
    dist.barrier()


def _both_ways(call_0, call_1) -> str:
    """In debug mode, rank 0 and 1 make their calls: both must raise the mismatch, listing
    both calls and call sites, within seconds; returns this rank's message."""
    rank, size = world()
    start = time.monotonic()
    with debug_mode(), pytest.raises(dist.CollectiveMismatchError) as info:
        (call_0 if rank == 0 else call_1)()
    assert time.monotonic() - start < 15, "raised only after a timeout"
    text = str(info.value)
    assert f"(debug mode; on rank {rank} of {size})" in text, text
    assert "  rank 0: " in text and "  rank 1: " in text, text
    assert text.count("tests/test_p2p.py:") >= 2, "both call sites are named"
    return text


@ranks(2, 3)
def test_debug_mode_two_ranks_that_send_to_each_other():
    rank = dist.get_rank()
    if rank > 1:
        return
    x = torch.ones(3)
    text = _both_ways(lambda: dist.send(x, 1), lambda: dist.send(x, 0))
    assert "rank 0 and rank 1 both send to each other" in text or (
        "rank 1 and rank 0 both send to each other" in text
    ), text
    assert "send(dst=1, tag=0, data={'dtype': 'float32', 'shape': [3]})" in text
    # nothing was sent: the pair goes on in step
    got = dist.exchange({1 - rank: torch.tensor([rank])}, [1 - rank])
    assert got[1 - rank].tolist() == [1 - rank]


@ranks(2, 3)
def test_debug_mode_two_ranks_that_receive_from_each_other():
    rank = dist.get_rank()
    if rank > 1:
        return
    text = _both_ways(lambda: dist.recv(1), lambda: dist.recv(0))
    assert "both wait to receive from each other, and neither sends" in text, text
    if rank == 0:
        dist.send("fine", 1)
    else:
        assert dist.recv(0) == "fine"


@ranks(2, 3)
def test_debug_mode_different_tags():
    rank, _ = world()
    if rank > 1:
        return
    text = _both_ways(lambda: dist.send(torch.ones(1), 1, tag=1), lambda: dist.recv(0, tag=2))
    assert "the tags differ" in text, text


@ranks(2, 3)
def test_debug_mode_a_collective_met_by_a_send():
    rank, size = world()

    def collective():
        dist.all_reduce(torch.ones(2))

    def sending():
        dist.send(torch.ones(2), 0)

    text = _both_ways(collective, sending) if rank <= 1 else None
    if rank == 2:  # in the collective too: it sees rank 1's send in the check
        with debug_mode(), pytest.raises(dist.CollectiveMismatchError) as info:
            collective()
        text = str(info.value)
    assert text is not None
    assert "send(dst=0, tag=0" in text and "all_reduce(data=" in text, text
    assert dist.all_reduce(torch.ones(1)).item() == size  # nothing ran: still in step


@ranks(2, 3)
def test_debug_mode_accepts_what_pairs_up():
    rank, size = world()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    with debug_mode():
        got = dist.exchange({nxt: torch.tensor([rank])}, [prv])
        assert got[prv].tolist() == [prv]
        if rank <= 1:
            peer = 1 - rank
            handle = dist.isend({"r": rank}, peer)
            assert dist.recv(peer) == {"r": peer}
            handle.wait()
            if rank == 0:
                dist.send(torch.ones(2), 1, tag=3)
                dist.send(torch.ones(3), 1, tag=3)
            else:
                assert dist.recv(0, tag=3).shape == (2,)
                assert dist.irecv(0, tag=3).wait().shape == (3,)
        dist.barrier()


# -- memory --------------------------------------------------------------------------------


def _peak_rss_of_a_64_mib_object() -> int:
    """Rank 0 sends 64 MiB of tensors in an object; rank 1 returns how much its peak
    resident memory grew while it received it (the received object still held)."""
    rank = dist.get_rank()
    if rank == 0:
        payload = [{"i": i, "x": torch.full((1 << 18,), float(i))} for i in range(64)]
        dist.barrier()
        dist.send(payload, 1)
        dist.barrier()
        return 0
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the present
    before = _status("VmRSS")
    dist.barrier()
    got = dist.recv(0)
    peak = _status("VmHWM") - before
    assert [d["i"] for d in got] == list(range(64))
    assert all(d["x"][0].item() == float(d["i"]) for d in got)
    dist.barrier()
    return peak


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")
def test_the_receivers_peak_memory_is_at_most_a_fifth_above_the_payload():
    peak = in_fresh_world(_peak_rss_of_a_64_mib_object, 2)[1]
    payload = 64 << 20
    assert peak <= 1.2 * payload, f"peak grew by {peak / payload:.2f}x the payload"


# -- profile ---------------------------------------------------------------------------------


def _line() -> int:
    return sys._getframe(1).f_lineno


@ranks(0, 2, 3)
def test_a_profile_shows_each_side_at_its_site_and_blames_a_late_sender():
    rank, size = world()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    with dist.profile() as prof:
        dist.exchange({nxt: torch.ones(4)}, [prv])
        ring_at = _line() - 1
        if rank == 0 and size > 1:
            time.sleep(0.3)  # rank 1 waits in its recv for this send
            dist.send(torch.ones(8), 1)
            send_at = _line() - 1
            dist.isend("an object", 1).wait()
        elif rank == 1:
            dist.recv(0)
            recv_at = _line() - 1
            dist.irecv(0).wait()
    every = dist.all_gather_object(prof.rows)
    assert all(rows == every[0] for rows in every), every
    rows = {(r.op, int(r.site.rsplit(":", 1)[1])): r for r in prof.rows}
    assert all(r.site.startswith("tests/test_p2p.py:") for r in prof.rows), prof.rows
    ring = rows["exchange", ring_at]
    assert ring.calls == size and set(ring.late) == set(range(size))
    assert ring.bytes == (0 if size == 1 else 16 * size)
    if size == 1:
        assert len(rows) == 1 and ring.late == {0: 0.0}
        return
    assert sorted(op for op, _ in rows) == ["exchange", "irecv", "isend", "recv", "send"]
    sent = next(r for (op, _), r in rows.items() if op == "send")
    got = next(r for (op, _), r in rows.items() if op == "recv")
    assert (sent.calls, sent.bytes, got.calls, got.bytes) == (1, 32, 1, 32)
    assert set(sent.late) == {0} and set(got.late) == {1}
    assert sent.late[0] >= 0.25, sent  # the late sender is blamed at its send ...
    assert got.late[1] < 0.1 and got.seconds >= 0.25, got  # ... the receiver waited
    if rank == 0:
        assert sent.site.endswith(f":{send_at}")
    elif rank == 1:
        assert got.site.endswith(f":{recv_at}")


@ranks(2, 3)
def test_the_exact_size_path_of_nccl_on_gloo():
    """NCCL needs receive buffers of exactly the message's size: frames padded to steady
    capacities, or sent whole in two messages, and each exchange round batched. Gloo takes
    those messages too, so the path NCCL takes is checked here without a GPU."""
    rank, size = world()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    exact = _p2p.exact
    _p2p.exact = lambda comm: True
    try:
        for step in range(12):
            n = [3, 3, 3, 3, 5000, 5001, 5002, 100_000, 0, 2_000_000, 7, 7][step]
            mine = torch.full((n + rank,), float(rank * 100 + step))
            got = dist.exchange({nxt: mine}, [prv])[prv]
            assert got.tolist() == [float(prv * 100 + step)] * (n + prv), step
        got = dist.exchange({nxt: make(rank)}, [prv])[prv]
        check_payload(got, prv)
        if rank == 0:
            for k in range(10):
                dist.send(_shapes(k), 1)
            dist.isend({"k": "last"}, 1).wait()
        elif rank == 1:
            for k in range(10):
                assert torch.equal(dist.recv(0), _shapes(k)), k
            assert dist.irecv(0).wait() == {"k": "last"}
    finally:
        _p2p.exact = exact


@ranks(2, timeout=60)
def test_a_stuck_recv_is_reported_with_where_its_peer_is():
    """The stuck report (DISTKIT_STUCK_AFTER) covers point-to-point waits: the rank left
    waiting says so, and where its peer is, while it keeps waiting."""
    import contextlib
    import io

    rank, _ = world()
    _settings.set("stuck_after", 1.0)
    dist.barrier()  # a rank answers roll calls from its first distkit call on
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        if rank == 0:
            got = dist.recv(1, tag=3)
        else:
            time.sleep(4)  # busy, in no distkit call
            dist.send(torch.arange(3), 0, tag=3)
    if rank == 0:
        assert got.tolist() == [0, 1, 2]  # the report stopped nothing
        text = err.getvalue()
        assert "distkit: rank 0 has waited 1 s in recv with rank 1 (tag 3) at " in text, text
        assert "tests/test_p2p.py:" in text and "and keeps waiting:" in text, text
        assert "rank 1 is at tests/test_p2p.py:" in text and "not in a distkit call" in text, text
    else:
        assert err.getvalue() == ""  # the sender never waited
    dist.barrier()


@ranks(2)
def test_an_isend_handle_dropped_before_its_wait_is_said_at_once():
    """gloo frees a send whose work is freed: its message never arrived and the receiver
    waited for the group's timeout, silently (so does torch's own isend). Holding the
    sends instead kept every one of them for ever (gloo's sends complete only in their
    wait). The drop is said at the line, when it happens; a handle waited for says
    nothing."""
    import warnings

    rank, _ = world()
    group = get_group([0, 1], timeout=20)  # a pair of its own: the dropped send stays in it
    if rank == 0:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist.isend(torch.ones(2), 1, group=group).wait()  # waited: nothing to say
            dist.isend(torch.ones(3), 1, group=group)  # the handle is dropped at once
            dropped_at = _line() - 1
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(said) == 1, said
        assert said[0].startswith(f"isend at tests/test_p2p.py:{dropped_at} in "), said
        assert "its handle was dropped before wait()" in said[0], said
        assert "may never arrive" in said[0] and "Keep the handle" in said[0], said
    else:
        assert dist.recv(0, group=group).tolist() == [1.0, 1.0]
    dist.barrier()


@ranks(2)
def test_an_exchange_names_the_send_that_cannot_be_pickled():
    """It named every message's object `data`, the name of send's argument."""
    rank, _ = world()
    peer = 1 - rank
    sends = {peer: {"f": lambda: 1} if rank == 0 else torch.ones(2)}
    with pytest.raises(TypeError) as info:
        dist.exchange(sends, [peer])
    said = str(info.value)
    culprit = "sends[1]['f'] (function) cannot be pickled"
    if rank == 0:
        assert said.startswith(f"exchange: {culprit}"), said
    else:
        assert said.startswith(f"exchange: rank 0 could not send its object: {culprit}"), said
    assert (
        dist.exchange({peer: torch.full((2,), float(rank))}, [peer])[peer].tolist()
        == [float(peer)] * 2
    )  # still in step
