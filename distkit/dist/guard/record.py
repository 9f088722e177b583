"""What a communication profile records: one entry per collective call, locally.

While a profile is open (:mod:`distkit.dist.profiling`), :data:`active` is its recorder, and
every collective adds an entry when it ends: the group, the call's number on it, the
public name, the user's call site, the bytes of its tensors, and the wall-clock times it
was entered and left (a point-to-point call has no number on its group: its entry names
its messages instead, as its peers' entries do, see :data:`PAIRS`). Nothing is sent while
recording; the ranks merge their entries when
the profile closes. When no profile is open, a collective pays one module-attribute read.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from threading import get_ident
from types import FrameType
from typing import Any, NamedTuple, Optional

from torch import Tensor

from distkit._compat import is_compiling
from distkit.dist.guard.check import site_key


class Entry(NamedTuple):
    """One collective call, as this rank saw it."""

    gid: str  # the group's name ("": a call that sent nothing, or no process group)
    ranks: Any  # its global ranks (a sequence; tuples once merged)
    seq: int  # the call's number on the group (0 when gid is "")
    op: str  # the public name
    file: str  # the user's call site
    line: int
    nbytes: int  # bytes of the tensors this rank passed
    enter: float  # wall-clock seconds (time.time) when it was called ...
    leave: float  # ... and when it returned


class Recorder:
    """The entries of one open profile."""

    def __init__(self, group: Optional[tuple[int, ...]]) -> None:
        #: The profile's group (global ranks); ``None``: the whole world. Calls on groups
        #: that reach outside it are not recorded: their other ranks record nothing.
        self.group = None if group is None else frozenset(group)
        self.entries: list[Entry] = []
        #: By thread, while a collector runs in it (see :func:`collector`): the first
        #: inner call's (group, ranks, number), which names the collector's call.
        self.inner: dict[int, list[Any]] = {}
        self._inside: dict[str, bool] = {}  # by group name: within :attr:`group`?

    def add(
        self,
        gid: str,
        ranks: Any,
        seq: int,
        op: str,
        args: Any,
        frame: Optional[FrameType],
        enter: float,
    ) -> None:
        """Record a call that ended now (``frame``: a frame below the user's call)."""
        if self.inner:
            inner = self.inner.get(get_ident())
            if inner is not None:  # part of a collector's call: recorded as that
                if not inner:
                    inner.append((gid, ranks, seq))
                return
        if self.group is not None and not self.within(gid, ranks):
            return
        file, line = site_key(frame)
        self.entries.append(
            Entry(gid, ranks, seq, op, file, line, nbytes(args), enter, time.time())
        )

    def within(self, gid: str, ranks: Any) -> bool:
        """Whether the group ``gid`` (of global ``ranks``) lies within the profile's."""
        if gid.startswith(PAIRS):  # a key per message: nothing worth keeping
            return self.group is None or set(ranks) <= self.group
        inside = self._inside.get(gid)
        if inside is None:
            inside = self._inside[gid] = self.group is None or set(ranks) <= self.group
        return inside


#: The open profile's recorder, or ``None``
active: Optional[Recorder] = None

#: A point-to-point call's ``gid``: this, then the keys of its messages, joined by ``;``
#: (a message's key is the same at both ends: its channel and number), with ``seq`` 0
PAIRS = "p2p:"


@contextmanager
def collector(op: str, tensors: Any = ()) -> Iterator[None]:
    """Record the collectives inside the block as one call of ``op`` (the evaluation
    collectors and the helpers: their rounds are one call to the user), numbered as its
    first inner call (the same on every rank), with the bytes of ``tensors``. Costs a
    generator while no profile is open."""
    recorder = active
    me = get_ident()
    if recorder is None or me in recorder.inner or is_compiling():
        yield
        return
    frame = sys._getframe(2)  # above contextlib's frame: the collector's caller, or below
    inner: list[Any] = []
    recorder.inner[me] = inner
    entered = time.time()
    try:
        yield
    finally:
        del recorder.inner[me]
        # a call that sent nothing has no group: it is matched across ranks by its site
        gid, ranks, seq = inner[0] if inner else ("", (), 0)
        if recorder.group is None or not inner or recorder.within(gid, ranks):
            file, line = site_key(frame)
            recorder.entries.append(
                Entry(gid, ranks, seq, op, file, line, nbytes(tensors), entered, time.time())
            )


def nbytes(args: Any) -> int:
    """Bytes of the tensors among a call's arguments (tensors in lists counted too)."""
    total = 0
    for value in list(args):
        if isinstance(value, Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, (list, tuple)):
            total += sum(v.numel() * v.element_size() for v in value if isinstance(v, Tensor))
    return total
