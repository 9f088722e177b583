"""The point-to-point protocol under :func:`distkit.dist.iter_results`.

``dst`` drives: for each round it sends each rank that holds items of the round a
request (the positions, in that rank's results, of the items it needs, in the order it
needs them), then receives the answers. A rank answers with *packs*: consecutive
requested items encoded together (:mod:`distkit.dist._wire`), each at most about
``pack_bytes`` unless one item alone is larger, each preceded by its size. The other
ranks know nothing of the plan; they wait for the next control message from ``dst``:

    int64[4]  kind, a, b, c
              REQUEST: a = number of positions, followed by int64[a] positions
              DONE:    stop serving; the iterator ends
              FAILED:  a = error code (see _args.REMOTE_ERRORS), b = rank at fault,
                       c = message bytes, followed by uint8[c]: raise it
              GO:      the plan holds (sent once, right after it is shared, so that
                       every rank raises a plan error from the call itself)

An answer pack is ``int64[2]`` (bytes, items) then the bytes. A rank that cannot encode
answers ``int64[2]`` (-1 - error code, message bytes) then the message, and raises.

Messages travel on the group's CPU channel (the group under gloo, its gloo twin under
nccl), with their own tag, so nothing else on the group can take them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, Optional

import torch
import torch.distributed as td
from torch import Tensor

from distkit.dist import _args, _wire
from distkit.dist._torch_objects import _channels
from distkit.dist.serializer import UnsafeObjectError
from distkit.dist.timeouts import CollectiveTimeoutError

if TYPE_CHECKING:
    from distkit.dist._backend import ObjectCall
    from distkit.dist._comm import Comm

REQUEST, DONE, FAILED, GO = 0, 1, 2, 3
TAG = 0x5EA  # a tag of its own: no other point-to-point message of the group matches it
#: Error codes past ``_args.REMOTE_ERRORS``: errors that keep their class on every rank.
UNSAFE, TIMEOUT = 100, 101


# -- errors that reach every rank --------------------------------------------------


class Failure(NamedTuple):
    """An error, as another rank raises it: the class (a code), and what to say."""

    code: int  # an index in _args.REMOTE_ERRORS, UNSAFE or TIMEOUT
    text: str  # the message, without its "fn: " prefix
    culprit: int = -1  # the rank that sent a refused object (UNSAFE) or did not answer
    name: str = ""  # the global the safe serializer refused (UNSAFE)

    @classmethod
    def of(cls, exc: BaseException, fn: str) -> Failure:
        text = str(exc).removeprefix(f"{fn}: ")
        if isinstance(exc, UnsafeObjectError):
            return cls(UNSAFE, text, exc.rank, exc.global_name)
        if isinstance(exc, CollectiveTimeoutError):
            return cls(TIMEOUT, text, exc.missing[0] if exc.missing else -1)
        return cls(_args.error_code(exc), text)

    def encode(self, limit: int = 0) -> bytes:
        """The failure as JSON, its text cut to fit in ``limit`` bytes if given."""
        raw = json.dumps(list(self)).encode()
        text = self.text
        while limit and len(raw) > limit and text:
            text = text[: len(text) // 2]
            raw = json.dumps(list(self._replace(text=text + " ..."))).encode()
        return raw[:limit] if limit else raw

    @classmethod
    def decode(cls, raw: bytes) -> Failure:
        try:
            code, text, culprit, name = json.loads(raw.decode(errors="replace"))
            return cls(int(code), str(text), int(culprit), str(name))
        except (ValueError, TypeError):
            return cls(len(_args.REMOTE_ERRORS) - 1, f"a malformed error report {raw[:200]!r}")

    def raise_as(self, fn: str, comm: Comm, what: str) -> NoReturn:
        """Raise ``what`` here, as an error of this failure's class."""
        message = f"{fn}: {what} (on {_args.where(comm)})"
        if self.code == UNSAFE:
            raise UnsafeObjectError(message, self.culprit, self.name)
        if self.code == TIMEOUT:
            raise CollectiveTimeoutError(message, [self.culprit], {})
        _args.remote_failure(self.code, fn, comm, what)


def read_error(position: int, exc: BaseException) -> Failure:
    """What the other ranks are told when ``results[position]`` could not be read."""
    return Failure(
        _args.error_code(exc), f"could not read results[{position}]: {type(exc).__name__}: {exc}"
    )


class ReadFailed(Exception):
    """``results[position]`` raised ``error`` (never reaches users: the original does)."""

    def __init__(self, position: int, error: BaseException) -> None:
        super().__init__(position, error)
        self.position = position
        self.error = error


def reading(results: Sequence, positions: Any = None) -> Iterator[Any]:
    """``results[p]`` for each position (all by default), read one at a time."""
    for p in range(len(results)) if positions is None else positions:
        try:
            item = results[p]
        except Exception as exc:
            raise ReadFailed(p, exc) from exc
        yield item


class Link:
    """Point-to-point messages between the ranks of one group on its CPU channel."""

    def __init__(self, comm: Comm, fn: str) -> None:
        self.comm = comm
        self.fn = fn
        self.ch = _channels(comm)[0]

    def send(self, peer: int, t: Tensor) -> None:
        td.send(t.to(self.ch.device), self.ch.src(peer), group=self.ch.pg, tag=TAG)

    def recv(self, peer: int, n: int, dtype: torch.dtype = torch.int64) -> Tensor:
        buf = torch.empty(n, dtype=dtype, device=self.ch.device)
        if n:
            td.recv(buf, self.ch.src(peer), group=self.ch.pg, tag=TAG)
        return buf.cpu()

    def ints(self, peer: int, n: int) -> list[int]:
        return self.recv(peer, n).tolist()

    def text(self, peer: int, n: int) -> str:
        return bytes(self.recv(peer, n, torch.uint8).tolist()).decode(errors="replace")

    # -- dst ------------------------------------------------------------------------

    def request(self, peer: int, positions: list[int]) -> None:
        self.send(peer, torch.tensor([REQUEST, len(positions), 0, 0]))
        self.send(peer, torch.tensor(positions, dtype=torch.int64))

    def go(self, peer: int) -> None:
        self.send(peer, torch.tensor([GO, 0, 0, 0]))

    def done(self, peer: int) -> None:
        self.send(peer, torch.tensor([DONE, 0, 0, 0]))

    def failed(self, peer: int, code: int, culprit: int, message: str) -> None:
        raw = message.encode()
        self.send(peer, torch.tensor([FAILED, code, culprit, len(raw)]))
        if raw:
            self.send(peer, torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    def answer(self, peer: int, count: int, fn: str) -> list[tuple[Tensor, int]]:
        """Receive ``peer``'s packs for ``count`` requested items: (bytes, items) each."""
        packs = []
        got = 0
        while got < count:
            nbytes, items = self.ints(peer, 2)
            if nbytes < 0:
                message = self.text(peer, items)
                _args.remote_failure(
                    -1 - nbytes, fn, self.comm, f"rank {peer} could not send results: {message}"
                )
            packs.append((self.recv(peer, nbytes, torch.uint8), items))
            got += items
        return packs

    # -- the other ranks ------------------------------------------------------------

    def control(self, dst: int) -> tuple[int, int]:
        """The next control message from ``dst``: raise a FAILED one; else (kind, a)."""
        kind, a, _culprit, c = self.ints(dst, 4)
        if kind == FAILED:
            # dst's own message names the call already
            text = self.text(dst, c).removeprefix(f"{self.fn}: ")
            _args.remote_failure(a, self.fn, self.comm, f"rank {dst} stopped the call: {text}")
        return kind, a

    def serve(
        self, dst: int, results: Sequence, sizes: list[int], pack_bytes: int, fn: str
    ) -> None:
        """Answer ``dst``'s requests until it says DONE (or FAILED: raise its error)."""
        while True:
            kind, a = self.control(dst)
            if kind == DONE:
                return
            positions = self.ints(dst, a)
            start = 0
            while start < len(positions):
                end, total = start + 1, sizes[positions[start]]
                while end < len(positions) and total + sizes[positions[end]] <= pack_bytes:
                    total += sizes[positions[end]]
                    end += 1
                items = [results[p] for p in positions[start:end]]
                try:
                    enc = _wire.encode(items, "results", fn, self.comm)
                except Exception as exc:
                    raw = str(exc).encode()
                    self.send(dst, torch.tensor([-1 - _args.error_code(exc), len(raw)]))
                    if raw:
                        self.send(dst, torch.frombuffer(bytearray(raw), dtype=torch.uint8))
                    raise
                self.send(dst, torch.tensor([enc.cpu.numel(), end - start]))
                self.send(dst, enc.cpu)
                del enc, items
                start = end


def unpack(packs: list[tuple[Tensor, int]], sender: int, call: ObjectCall, comm: Comm) -> Any:
    """The items of ``packs`` in order; each pack is decoded when its first item is due,
    and its bytes dropped once decoded."""
    packs.reverse()
    while packs:
        buf, _ = packs.pop()
        items = _wire.decode(
            _wire.Encoded(buf, None), call.map_location, call.serializer, sender, call.fn, comm
        )
        del buf
        items.reverse()
        while items:
            yield items.pop()


def fail_everywhere(
    link: Optional[Link], peers: Sequence[int], exc: BaseException, culprit: int
) -> NoReturn:
    """Tell ``peers`` (waiting for a control message) that ``exc`` stops the call; raise it."""
    if link is not None:
        for peer in peers:
            link.failed(peer, _args.error_code(exc), culprit, str(exc))
    raise exc
