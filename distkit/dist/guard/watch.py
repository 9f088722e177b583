"""What runs around every collective of the torch backend: :func:`watched`.

It counts the collectives entered on each group (a rank's call number on that group),
runs the debug-mode check first when debug mode is on (:mod:`distkit.dist.debug`), and
turns a backend timeout into a :class:`~distkit.dist.CollectiveTimeoutError` that names
the missing ranks (:mod:`distkit.dist.guard.diagnose`). Argument names come from the wrapped
method's signature. The single-process backend is not wrapped: none of this costs
anything there.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

from distkit import _settings
from distkit.dist import errors
from distkit.dist.core import args as _args
from distkit.dist.core.spec import SPECS
from distkit.dist.guard import check as _check
from distkit.dist.guard import debugmode, diagnose, pairs
from distkit.dist.guard import record as _record
from distkit.dist.guard import watchdog as _watchdog
from distkit.dist.handle import Handle

if TYPE_CHECKING:
    from distkit.dist.core.comm import Comm

F = TypeVar("F", bound=Callable[..., Any])
_local = threading.local()
_DEBUG_DEFAULT = _settings.default("debug")
_CHECK_DEFAULT = _settings.default("check")


def _on_error(
    comm: Comm, public: str, seq: int
) -> Callable[[BaseException], Optional[BaseException]]:
    """What to raise instead of a collective's error (``None``: the error itself); a
    group that timed out or lost a rank is marked unusable (see :meth:`Comm.enter`)."""

    def replace(exc: BaseException) -> Optional[BaseException]:
        better = _better(comm, public, seq, exc)
        final = exc if better is None else better
        facts = comm._facts
        if facts is not None and isinstance(
            final, (errors.CollectiveTimeoutError, errors.RankGoneError)
        ):
            facts.broken = f"its call #{seq} ({public}) {_what(final)}"
        return better

    return replace


def _what(exc: BaseException) -> str:
    if isinstance(exc, errors.CollectiveTimeoutError):
        return "timed out"
    gone = ", ".join(f"rank {r}" for r in sorted(getattr(exc, "gone", {})))
    return f"lost {gone or 'a rank'}"


def _better(comm: Comm, public: str, seq: int, exc: BaseException) -> Optional[BaseException]:
    facts = comm._facts
    if isinstance(exc, (errors.CollectiveTimeoutError, errors.RankGoneError)):
        return None
    if isinstance(exc, errors.CollectiveMismatchError):
        return None
    if facts is not None and facts.failed is not None and facts.failed[0] == seq:
        found = facts.failed[1]  # the watchdog's default check of this very call
        facts.failed = None
        return found
    if diagnose.is_timeout(exc):
        return diagnose.diagnose(comm, public, seq, exc)
    if diagnose.is_peer_lost(exc):
        if facts is not None:  # the peer may have left over a check of this very call
            checked = _watchdog.verdict(facts, seq)
            if checked is not None:
                return checked
        return diagnose.peer_gone(comm, public, seq, exc)
    return None


def _note_pending(facts: Any, seq: int, call: tuple, handle: Handle) -> None:
    """Keep ``call`` for the watchdog while its handle is in flight (entries of handles
    that completed or were dropped go at the next async call)."""
    for old, (_, ref) in list(facts.pending.items()):
        found = ref()
        if found is None or found.is_completed():
            del facts.pending[old]
    facts.pending[seq] = (call, weakref.ref(handle))


#: A rare call that every rank must reach at once, checked every time: a profile's own
#: merge (a rank that left its block with an exception meets it in its next collective)
_ALWAYS_CHECKED = "profile"


def watched(method: F) -> F:
    """Wrap a backend method ``method(self, comm, *args)`` with the checks above.

    A point-to-point method (its spec says so) takes the group like a collective (one
    thread at a time) but no call number; its messages are numbered per channel, and
    checked and diagnosed per message, by the backend through
    :mod:`distkit.dist.guard.pairs`.
    """
    name = method.__name__
    if SPECS[name].point_to_point:
        return _watched_pair(method)
    params = list(inspect.signature(method).parameters)[2:]  # after self and comm
    call_at = params.index("call") if "call" in params else -1  # object calls: public name
    settings = _settings.values  # read directly: this runs on every collective

    @functools.wraps(method)
    def run(self: Any, comm: Comm, *args: Any) -> Any:
        if getattr(_local, "depth", 0):  # inside another collective: checked there
            return method(self, comm, *args)
        public = args[call_at].fn if call_at >= 0 else name
        recorder = _record.active  # a profile is open (see distkit.dist.profiling)
        entered = time.time() if recorder is not None else 0.0
        seq = comm.enter(public)
        facts = comm._facts
        call = (public, name, params, args)
        if facts is not None:
            facts.call = call  # for the watchdog
        _local.depth = 1
        started = False
        try:
            if settings.get("debug", _DEBUG_DEFAULT):
                _, fields, must = debugmode.signature(name, dict(zip(params, args)))
                with pairs.in_collective(comm, public, fields, seq):
                    debugmode.check(comm, public, fields, must, seq)
            elif (
                facts is not None
                and facts.size > 1
                and not facts.traced
                and settings.get("check", _CHECK_DEFAULT)
                and (_check.due(facts, seq, sys._getframe(1)) or public == _ALWAYS_CHECKED)
            ):
                _, fields, must = debugmode.signature(name, dict(zip(params, args)))
                _check.run(comm, public, fields, must, seq)
            started = True
            result = method(self, comm, *args)
            if isinstance(result, Handle):  # async: a timeout surfaces in wait()
                result.on_error(_on_error(comm, public, seq))
                if facts is not None:  # the watchdog answers checks of it while in flight
                    _note_pending(facts, seq, call, result)
        except errors.CollectiveMismatchError:
            if not started and facts is not None:
                # refused before the backend ran: the call takes no number, so ranks that
                # go on (catching the error) stay in step with one that runs its call
                facts.seq -= 1
            raise
        except Exception as exc:
            if not started and not isinstance(exc, RuntimeError):
                # raised while the check waited, not by the store or the backend (whose
                # errors are RuntimeErrors): the caller's own (a signal handler's), as is
                raise
            better = _on_error(comm, public, seq)(exc)
            if better is not None:
                raise better from exc
            raise
        finally:
            _local.depth = 0
            if facts is not None:
                facts.call = None
                if facts.failed is not None and facts.failed[0] == seq:
                    facts.failed = None  # the call ended after all: nothing to raise
            comm.leave()
        if recorder is not None and facts is not None:
            ranks = comm.global_ranks()
            recorder.add(facts.gid, ranks, seq, public, args, sys._getframe(1), entered)
        return result

    return run  # type: ignore[return-value]


def _watched_pair(method: F) -> F:
    name = method.__name__

    @functools.wraps(method)
    def run(self: Any, comm: Comm, *args: Any) -> Any:
        if getattr(_local, "depth", 0):  # inside another call: watched there
            return method(self, comm, *args)
        recorder = _record.active  # a profile is open (see distkit.dist.profiling)
        entered = time.time() if recorder is not None else 0.0
        comm.enter(args[-1].fn, count=False)  # the public name (its ObjectCall): isend
        _local.depth = 1
        try:
            result = method(self, comm, *args)
        finally:
            _local.depth = 0
            comm.leave()
        if recorder is not None and comm._facts is not None:
            gid, ranks, counted = pairs.recorded(comm, name, args, result)
            public = args[-1].fn  # the ObjectCall: send or isend, recv or irecv, exchange
            recorder.add(gid, ranks, 0, public, counted, sys._getframe(1), entered)
        return result

    return run  # type: ignore[return-value]


def refused(comm: Comm, public: str, error: BaseException, frame: Optional[Any]) -> None:
    """Tell the other ranks of ``comm``'s group that this rank refused its arguments to
    ``public`` (``error``, raised by its checks before any communication), where they
    check the call: in debug mode (every call), and at the calls the default check
    makes (the first at each call site, and a sample).

    Raised on this rank alone, the error left the others waiting in the call, to pair it
    with this rank's next one if the caller caught the error and went on: another call's
    data, no error. This rank takes its part in the check, with a part that agrees with
    no other call's, so every rank that made a valid call raises
    :class:`~distkit.dist.CollectiveMismatchError` naming this rank and its error; the
    call takes no number anywhere, so the ranks stay in step. Ranks that all refused the
    same arguments agree, and each raises its own error. Calls the default check skips
    (a call site past its first calls) still raise on this rank alone.
    """
    facts = comm._facts
    if facts is None or facts.size < 2 or facts.traced:
        return
    if getattr(_local, "depth", 0):  # inside another collective: it says what failed
        return
    settings = _settings.values
    debug = settings.get("debug", _DEBUG_DEFAULT)
    if not debug and not settings.get("check", _CHECK_DEFAULT):
        return
    tb = error.__traceback__
    while tb is not None:  # raised under a backend method (watched): past the checks
        if tb.tb_frame.f_globals.get("__name__") == __name__:
            return
        tb = tb.tb_next
    try:
        seq = comm.enter(public)
    except Exception:  # a broken group, or another thread in a collective on it
        return
    try:
        if not debug and not _check.due(facts, seq, frame):
            return
        said = f"{type(error).__name__}: {_args.bare(error, public, comm)}"
        fields = must = {"refused": said}
        try:
            if debug:
                with pairs.in_collective(comm, public, fields, seq):
                    debugmode.check(comm, public, fields, must, seq)
            else:
                _check.run(comm, public, fields, must, seq)
        except Exception:  # the others' mismatch, or a check that failed: raise the error
            pass
    finally:
        facts.seq -= 1  # a refused call takes no number, as on the ranks it refuses
        comm.leave()
