"""Debug mode's machinery: the signature of a call, and the exchange that compares them.

With debug mode on (``DISTKIT_DEBUG=1`` or :func:`set_debug`), every collective on a
process group first exchanges a small signature of the call among the group's ranks:
its name, the op, dtypes, shapes where they must match, ``src``/``dst``, the serializer,
and the call site. When they disagree, every rank raises
:class:`CollectiveMismatchError`, naming each rank's call and call site, instead of
hanging or computing garbage. The exchange is JSON over one small all-gather, so no
rank ever unpickles another's signature.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from distkit import _registry
from distkit._compat import all_gather_single
from distkit.dist.codec.wire import bytes_view
from distkit.dist.core import layouts, spec
from distkit.dist.errors import CollectiveMismatchError
from distkit.utils.groups import get_cpu_group

if TYPE_CHECKING:
    from distkit.dist.core.comm import Comm

# the distkit package (distkit.utils.get_group's frames are not the user's either)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__ or ""))
# frames that are never the user's call site: distkit, torch, and the standard library
# modules that run a script or a thread
_LIBRARY = (
    _PACKAGE_DIR + os.sep,
    _TORCH_DIR + os.sep,
    os.path.abspath(runpy.__file__),
    os.path.abspath(threading.__file__),
)


def call_site(frame: Optional[FrameType] = None) -> str:
    """``file:line in function`` of the innermost frame outside distkit, torch and the
    standard library's plumbing (runpy, threading), from ``frame`` (another thread's,
    e.g. from ``sys._current_frames()``) or the caller's."""
    if frame is None:
        frame = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        inside = filename.startswith(_LIBRARY) or "<distkit" in filename
        if not inside and "<frozen" not in filename:
            shown = os.path.relpath(filename)
            if shown.startswith(".."):  # outside the working directory: say where exactly
                shown = filename
            return f"{shown}:{frame.f_lineno} in {frame.f_code.co_name}"
        if frame.f_back is None:
            break
        frame = frame.f_back
    return "<unknown>"


def _describe(value: Any) -> Any:
    """A small, comparable, JSON-able description of a collective argument."""
    if isinstance(value, Tensor):
        return {"dtype": str(value.dtype).replace("torch.", ""), "shape": list(value.shape)}
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Tensor) for v in value):
        return {
            "dtype": str(value[0].dtype).replace("torch.", ""),
            "shapes": [list(v.shape) for v in value],
        }
    if hasattr(value, "name") and hasattr(value, "torch_op"):  # a reduce Op
        return value.name
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return list(value)
    return type(value).__name__


#: Per collective: the fields every rank must agree on (see distkit.dist.core.spec)
MUST_MATCH = spec.MUST_MATCH
# arguments that are not compared or shown: objects (only their collective is), and
# what only concerns this rank
_SKIPPED = {"obj", "name", "async_op", "call", "error"}


def _pick(fields: dict, path: str) -> Any:
    name, _, part = path.partition(".")
    value = fields.get(name)
    if part and isinstance(value, dict):
        value = value.get(part)
    return value


def signature(name: str, args: dict[str, Any]) -> tuple[str, dict, dict]:
    """(public name, described fields, the fields that must match) of a backend call."""
    public = args["call"].fn if "call" in args else name
    serializer = args["call"].serializer if "call" in args else None
    objects = name.endswith("_object")
    fields: dict[str, Any] = {}
    for arg, value in args.items():
        if arg in _SKIPPED or (objects and arg == "data"):
            continue
        fields[arg] = _describe(value)
    if serializer is not None:
        fields["serializer"] = serializer
    must = MUST_MATCH[name]
    if name == "all_to_all_single" and isinstance(fields.get("data"), dict):
        must = (*must, "data.rows", "sizes")  # rows of one shape; sizes sent alike
        fields["data"]["rows"] = fields["data"]["shape"][1:]
        given = args.get("output_split_sizes") is not None
        inferred = not given and args.get("input_split_sizes") is not None
        fields["sizes"] = "inferred" if inferred else "given" if given else "even"
    if name in ("all_gather", "gather") and fields.get("same_shape"):
        must = (*must, "data.shape")  # the promise: gloo aborts dst's process if broken
    if name in ("reduce_scatter", "all_to_all") and isinstance(fields.get("data"), dict):
        if "shape" in fields["data"]:  # reduce_scatter of one tensor: same shape everywhere
            must = (*must, "data.shape")
        elif name == "reduce_scatter" or fields.get("same_shape"):
            must = (*must, "data.shapes")
    return public, fields, {path: _pick(fields, path) for path in must}


def format_call(call: dict) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in call["fields"].items())
    return f"{call['call']}({shown}) at {call['site']}"


def refusing(names: list[str], calls: list[Optional[dict]]) -> Optional[str]:
    """The line a mismatch error adds when some of the ranks (their ``names``) refused
    their arguments to the call (:func:`distkit.dist.guard.watch.refused`), or None."""
    who = [n for n, c in zip(names, calls) if c is not None and "refused" in c["must"]]
    if not who:
        return None
    return (
        f"{', '.join(who).capitalize()} refused {'its' if len(who) == 1 else 'their'} "
        "arguments to this call (the error above) and raised it there; the other ranks "
        "raise this, and the group stays in step (the call took no number)."
    )


def group_label(comm: Comm) -> str:
    if comm.pg is _registry.current._default_pg:
        return "the default group"
    return f"group {comm.global_ranks()}"


_SLOT = layouts.EXCHANGE_SLOT  # bytes per rank in the first round of the exchange


def exchange(comm: Comm, payload: Any) -> list[Any]:
    """All-gather a small JSON-able value among the ranks of ``comm``'s group.

    One padded round of ``_SLOT`` bytes per rank; a second, padded to the longest, only
    when some rank's value does not fit.
    """
    pg = get_cpu_group(comm.pg) or comm.pg
    raw = json.dumps(payload).encode()
    n = len(raw)
    slot = torch.zeros(_SLOT, dtype=torch.uint8, device="cpu")
    layouts.LENGTH.pack_into(bytes_view(slot), 0, n)
    if n <= _SLOT - 8:
        bytes_view(slot)[8 : 8 + n] = raw
    out = torch.empty(comm.size * _SLOT, dtype=torch.uint8, device="cpu")
    all_gather_single(out, slot, group=pg)
    rows = out.view(comm.size, _SLOT)
    sizes = [layouts.LENGTH.unpack(bytes(rows[r, :8].tolist()))[0] for r in range(comm.size)]
    longest = max(sizes)
    if longest > _SLOT - 8:
        big = torch.zeros(longest, dtype=torch.uint8, device="cpu")
        bytes_view(big)[:n] = raw
        out = torch.empty(comm.size * longest, dtype=torch.uint8, device="cpu")
        all_gather_single(out, big, group=pg)
        rows = out.view(comm.size, longest)
        texts = [bytes(rows[r, : sizes[r]].tolist()) for r in range(comm.size)]
    else:
        texts = [bytes(rows[r, 8 : 8 + sizes[r]].tolist()) for r in range(comm.size)]
    return [json.loads(t) for t in texts]


def splits(fields: dict, size: int) -> tuple[list[int], Optional[list[int]]]:
    """Rows an all_to_all_single call sends to each rank, and expects from each (if said)."""
    rows = fields["data"]["shape"][0] if fields["data"]["shape"] else 0
    sent = fields.get("input_split_sizes") or [rows // size] * size
    expected = fields.get("output_split_sizes")
    if expected is None and fields.get("input_split_sizes") is None:
        expected = [rows // size] * size  # even split: as many rows from each rank
    return list(sent), None if expected is None else list(expected)


def inconsistent(name: str, calls: list[dict]) -> list[str]:
    """What the ranks' calls promise each other but do not hold (beyond equal fields)."""
    problems: list[str] = []
    if name == "all_to_all_single" and all(
        isinstance(c["fields"].get("data"), dict) for c in calls
    ):
        size = len(calls)
        plans = [splits(c["fields"], size) for c in calls]
        for r, (_, expected) in enumerate(plans):
            for s, (sent, _) in enumerate(plans):
                if expected is not None and expected[s] != sent[r]:
                    problems.append(
                        f"rank {r} expects {expected[s]} rows from rank {s}, "
                        f"which sends it {sent[r]}"
                    )
        trailing = {tuple(c["fields"]["data"]["shape"][1:]) for c in calls}
        if len(trailing) > 1:
            problems.append(f"rows must have one shape on every rank, got {sorted(trailing)}")
    return problems


def check(comm: Comm, public: str, fields: dict, must: dict, seq: int) -> None:
    """Compare this call with every rank's; raise :class:`CollectiveMismatchError`."""
    mine = {"call": public, "fields": fields, "must": must, "site": call_site(), "seq": seq}
    calls = exchange(comm, mine)
    first = calls[0]
    same = all(c["call"] == first["call"] and c["must"] == first["must"] for c in calls)
    problems = inconsistent(public, calls) if same else []
    if same and not problems:
        return
    lines = [
        f"{public}: the ranks of {group_label(comm)} disagree on this collective "
        f"(debug mode; on rank {comm.rank} of {comm.size}):"
    ]
    for r, c in enumerate(calls):
        lines.append(f"  rank {r}: {format_call(c)}")
    pairs = [r for r, c in enumerate(calls) if c.get("must") == {"point_to_point": True}]
    refused = refusing([f"rank {r}" for r in range(len(calls))], calls)
    if refused is not None:
        lines.append(refused)
    elif pairs:
        lines.append(
            f"Rank(s) {', '.join(map(str, pairs))} wait in a point-to-point call for a rank "
            "that waits here: a collective cannot start until that call is served (send "
            "and receive before the collective, in the same order on both ranks)."
        )
    elif len({c["call"] for c in calls}) > 1:
        lines.append(
            "Every rank must call the same collectives in the same order; a rank "
            "that skips one (a branch on the rank, an early return) shows up here "
            "in its next collective."
        )
    elif problems:
        lines += [f"  {p}" for p in problems]
    else:
        diff = sorted(
            k for k in first["must"] if len({json.dumps(c["must"][k]) for c in calls}) > 1
        )
        lines.append(f"They must agree on: {', '.join(diff)}.")
    raise CollectiveMismatchError("\n".join(lines), calls)
