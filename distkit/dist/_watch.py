"""Hang diagnostics for the torch backend: a debug mode, and timeouts that name names.

Every collective of :mod:`distkit.dist._torch` and :mod:`distkit.dist._torch_objects` runs
through :func:`watched`, which

- counts the collectives entered on each group (a rank's call number on that group);
- in debug mode (``DISTKIT_DEBUG=1`` or :func:`set_debug`), first exchanges a small
  signature of the call with every rank of the group (name, op, dtype, shapes where they
  must match, src/dst, call site) and, when they differ, raises
  :class:`CollectiveMismatchError` on every rank, naming each rank's call and call site;
- when a collective times out, posts where this rank is waiting to the world's store,
  waits a few seconds for the other ranks' posts, and raises
  :class:`CollectiveTimeoutError` naming the ranks that never arrived (and, if they
  posted, where they are waiting instead) rather than the backend's bare timeout.

The single-process backend is not wrapped: none of this costs anything there.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

from torch import Tensor

from distkit import _settings
from distkit.dist._handle import Handle


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(os.path.abspath(sys.modules["torch"].__file__ or ""))
_local = threading.local()


class CollectiveMismatchError(RuntimeError):
    """Debug mode: the ranks of a group are not in the same collective, or disagree on it.

    Attributes:
        calls: Each rank's call, as ``{"call": ..., "fields": ..., "site": ...}``.
    """

    def __init__(self, message: str, calls: list[dict]) -> None:
        super().__init__(message)
        self.calls = calls


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than its timeout.

    Attributes:
        missing: Group ranks that never arrived at this call.
        reports: What the other ranks posted about where they were waiting.
    """

    def __init__(self, message: str, missing: list[int], reports: dict[int, dict]) -> None:
        super().__init__(message)
        self.missing = missing
        self.reports = reports


def set_debug(enabled: bool = True) -> None:
    """Turn the collective debug mode on or off for this process.

    In debug mode every collective on a process group first checks, with one small
    exchange among the group's ranks, that every rank is in the same collective with
    compatible arguments: the op, dtypes, shapes where they must match, ``src``/``dst``
    and the object serializer. On a mismatch every rank raises
    :class:`CollectiveMismatchError` listing each rank's call and call site (file:line),
    instead of hanging or computing garbage. It costs one extra small all_gather per
    collective (see the README for the measured figure). The environment variable
    ``DISTKIT_DEBUG=1`` turns it on at start-up. Turn it on (or off) on every rank.

    Args:
        enabled: Whether to check.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.set_debug(True)
        >>> dist.get_debug()
        True
        >>> dist.set_debug(False)
    """
    _settings.set("debug", bool(enabled))


def get_debug() -> bool:
    """Whether the collective debug mode is on (see :func:`set_debug`).

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_debug()
        False
    """
    return bool(_settings.get("debug"))


def call_site() -> str:
    """``file:line in function`` of the innermost frame outside distkit and torch."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith((_PACKAGE_DIR, _TORCH_DIR)) and "<frozen" not in filename:
            shown = os.path.relpath(filename)
            if shown.startswith(".."):  # outside the working directory: say where exactly
                shown = filename
            return f"{shown}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown>"


def describe(value: Any) -> Any:
    """A small, comparable description of a collective argument."""
    if isinstance(value, Tensor):
        return {"dtype": str(value.dtype).replace("torch.", ""), "shape": list(value.shape)}
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Tensor) for v in value):
        return {"dtype": str(value[0].dtype).replace("torch.", ""),
                "shapes": [list(v.shape) for v in value]}
    if hasattr(value, "name") and hasattr(value, "torch_op"):  # a reduce Op
        return value.name
    return value


#: Per collective: (argument names after ``comm``, which must match across ranks).
#: ``data.shape`` etc. pick one field of a described tensor.
SIGNATURES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "all_reduce": (("data", "op", "async_op"), ("op", "data.dtype", "data.shape")),
    "all_gather": (("data", "async_op", "same_shape"), ("data.dtype", "same_shape")),
    "gather": (("data", "dst", "async_op", "same_shape"), ("dst", "data.dtype", "same_shape")),
    "broadcast": (("data", "src", "async_op"), ("src", "data.dtype", "data.shape")),
    "reduce": (("data", "dst", "op", "async_op"), ("dst", "op", "data.dtype", "data.shape")),
    "reduce_scatter": (("data", "op", "async_op"), ("op", "data.dtype")),
    "all_to_all": (("data", "async_op", "same_shape"), ("data.dtype", "same_shape")),
    "all_to_all_single": (
        ("data", "output_split_sizes", "input_split_sizes", "async_op"),
        ("data.dtype",),
    ),
    "scatter": (("data", "src", "async_op"), ("src",)),
    "barrier": ((), ()),
    "all_gather_object": (("data", "fn", "map_location", "serializer"), ("serializer",)),
    "gather_object": (("data", "dst", "fn", "map_location", "serializer"), ("dst", "serializer")),
    "broadcast_object": (
        ("obj", "src", "fn", "name", "map_location", "serializer"),
        ("src", "serializer"),
    ),
    "scatter_object": (("data", "src", "fn", "map_location", "serializer"), ("src", "serializer")),
    "all_to_all_object": (("data", "fn", "map_location", "serializer"), ("serializer",)),
}
_OBJECT_ARGS = {"data", "obj"}  # objects are not described (only their collective is)


def _pick(fields: dict, path: str) -> Any:
    name, _, part = path.partition(".")
    value = fields.get(name)
    if part and isinstance(value, dict):
        value = value.get(part)
    return value


def _signature(name: str, args: tuple) -> tuple[str, dict, dict]:
    """(public name, all described fields, the fields that must match)."""
    names, must = SIGNATURES[name]
    fields = {}
    for arg_name, value in zip(names, args):
        if arg_name in _OBJECT_ARGS and name.endswith("_object"):
            continue
        if arg_name in ("fn", "name", "map_location", "async_op"):
            continue
        fields[arg_name] = describe(value)
    if name == "all_gather" and fields.get("same_shape"):
        must = (*must, "data.shape")
    public = args[names.index("fn")] if "fn" in names else name
    if name in ("reduce_scatter", "all_to_all") and isinstance(fields.get("data"), dict):
        if "shape" in fields["data"]:  # reduce_scatter of one tensor: same shape everywhere
            must = (*must, "data.shape")
        elif name == "reduce_scatter" or fields.get("same_shape"):
            must = (*must, "data.shapes")
    return public, fields, {path: _pick(fields, path) for path in must}


def _format_call(call: dict) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in call["fields"].items())
    return f"{call['call']}({shown}) at {call['site']}"


def _group_label(comm: Any) -> str:
    ranks = comm.global_ranks()
    from distkit._world import WORLD

    return "the default group" if comm.pg is WORLD._default_pg else f"group {ranks}"


def _check(comm: Any, public: str, fields: dict, must: dict, seq: int) -> None:
    from distkit.dist import _torch_objects

    mine = {"call": public, "fields": fields, "must": must, "site": call_site(), "seq": seq}
    calls = _torch_objects.all_gather_object(comm, mine, "debug check", None, "safe")
    first = calls[0]
    if all(c["call"] == first["call"] and c["must"] == first["must"] for c in calls):
        return
    lines = [f"{public}: the ranks of {_group_label(comm)} disagree on this collective "
             f"(debug mode; on rank {comm.rank} of {comm.size}):"]
    for r, c in enumerate(calls):
        lines.append(f"  rank {r}: {_format_call(c)}")
    if len({c["call"] for c in calls}) > 1:
        lines.append("Every rank must call the same collectives in the same order; a rank "
                     "that skips one (a branch on the rank, an early return) shows up here "
                     "in its next collective.")
    else:
        diff = sorted(k for k in first["must"] if len({json.dumps(c["must"][k]) for c in calls}) > 1)
        lines.append(f"They must agree on: {', '.join(diff)}.")
    raise CollectiveMismatchError("\n".join(lines), calls)


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _diagnose(comm: Any, public: str, seq: int, exc: BaseException) -> CollectiveTimeoutError:
    """Ask the store where every rank of the group is; build the error to raise."""
    from distkit._compat import default_store

    site = call_site()
    ranks = comm.global_ranks()
    me = ranks[comm.rank]
    where = {"group": ranks, "call": public, "seq": seq, "site": site, "time": time.time()}
    reports: dict[int, dict] = {}
    note = ""
    try:
        store = default_store()
        store.set(f"distkit/where/{me}", json.dumps(where))
        deadline = time.monotonic() + float(_settings.get("hang_grace"))
        others = [r for r in ranks if r != me]
        while others and time.monotonic() < deadline:
            for r in list(others):
                key = f"distkit/where/{r}"
                if store.check([key]):
                    report = json.loads(store.get(key))
                    if report["time"] > where["time"] - 3600:  # ignore an earlier hang's post
                        reports[r] = report
                        others.remove(r)
            if others:
                time.sleep(0.1)
    except Exception as store_error:  # the store may be gone too
        note = f" (could not ask the other ranks through the store: {store_error})"
    same, missing, elsewhere = [], [], []
    for group_rank, r in enumerate(ranks):
        if r == me:
            continue
        report = reports.get(r)
        if report and report["group"] == ranks and report["call"] == public and report["seq"] == seq:
            same.append(group_rank)
        else:
            missing.append(group_rank)
            if report:
                group = "this group" if report["group"] == ranks else f"group {report['group']}"
                elsewhere.append(f"rank {group_rank} is waiting in {report['call']} (its call "
                                 f"#{report['seq']} on {group}) at {report['site']}")
            else:
                elsewhere.append(f"rank {group_rank} posted nothing within "
                                 f"{_settings.get('hang_grace'):g} s: it is not waiting in a "
                                 "distkit collective (busy, blocked elsewhere, or dead)")
    lines = [f"{public} timed out on rank {comm.rank} of {comm.size} of {_group_label(comm)} "
             f"(its call #{seq} on this group, at {site}){note}."]
    if missing:
        lines.append(f"Rank(s) {', '.join(map(str, missing))} never arrived at this call:")
        lines += [f"  {line}" for line in elsewhere]
    if same:
        lines.append(f"Rank(s) {', '.join(map(str, same))} are waiting in this call too.")
    lines.append(f"The backend said: {exc}")
    return CollectiveTimeoutError("\n".join(lines), missing, {ranks.index(r): v for r, v in reports.items()})


def watched(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a torch-backend collective ``impl(comm, *args)`` with the checks above."""

    def wrap(impl: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(impl)
        def run(comm: Any, *args: Any) -> Any:
            if getattr(_local, "depth", 0):  # inside another collective: checked there
                return impl(comm, *args)
            facts = comm._facts
            facts.seq += 1
            seq = facts.seq
            _local.depth = 1
            try:
                if _settings.get("debug"):
                    public, fields, must = _signature(name, args)
                    _check(comm, public, fields, must, seq)
                result = impl(comm, *args)
                if isinstance(result, Handle):  # async: a timeout surfaces in wait()
                    public = _signature(name, args)[0]
                    result._on_timeout = lambda exc: _diagnose(comm, public, seq, exc)
            except Exception as exc:
                if _is_timeout(exc) and not isinstance(exc, CollectiveTimeoutError):
                    public = _signature(name, args)[0] if name.endswith("_object") else name
                    raise _diagnose(comm, public, seq, exc) from exc
                raise
            finally:
                _local.depth = 0
            return result

        return run

    return wrap
