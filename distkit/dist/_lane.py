"""The lean lane: ``all_reduce(t)`` with every default, on a CPU group, in few steps.

``dist.all_reduce(grads)`` with no other argument is the commonest call in a training
step with many ranks. The checked path resolves the group, checks each argument, picks a
backend, stages the tensor and dispatches through torch's own wrapper: about 16 us of
Python when caches are warm, but 70-110 us between gloo calls, when the process has been
blocked and every layer runs cold. This lane does only what that call needs: the
conditions below are each a plain attribute test, and when one fails the checked path
runs instead (the lane never raises an argument error of its own).

It keeps what the watched backend gives every collective: the thread check and call
number of :meth:`Comm.enter` (hang reports; inlined, and when another thread holds the
group the checked path runs and says so), the note of the call the watchdog reads, the
debug-mode check and the default check (by stepping aside when one of them is due), and
the mapping of backend errors to distkit's (timeouts, ranks that went away).

It calls the process group's ``allreduce`` directly, as ``torch.distributed.all_reduce``
does after its own checks, which hold here: the tensor is a plain dense CPU tensor of a
real dtype, the group is the default one (this rank is in it), no torch function mode is
active, and the group is not inside torch's ``_coalescing_manager``.
"""

from __future__ import annotations

import sys
from threading import get_ident
from typing import Any, Optional

import torch
from torch import Tensor

from distkit import _registry, _settings
from distkit._compat import is_compiling
from distkit.dist import _check, _ops, _watch
from distkit.dist._comm import _FACTS, Comm

#: dtypes every CPU backend sums natively (gloo's narrow ones go through distkit's
#: conversions in the checked path)
_DTYPES = frozenset({torch.float32, torch.float64, torch.int32, torch.int64})
if torch.distributed.is_available():
    _SUM: Any = torch.distributed.ReduceOp.SUM  # a RedOpType: the options convert it
    _Options = torch.distributed.AllreduceOptions
    _SYNC = hasattr(_Options(), "asyncOp")
_STRIDED = torch.strided
_DEBUG_DEFAULT = _settings.default("debug")
_CHECK_DEFAULT = _settings.default("check")
_NAME = "all_reduce"
# the call as the backend method would note it for the watchdog: (data, op, async_op)
_PARAMS = ("data", "op", "async_op")
_OP_SUM = _ops.OPS["sum"]
_has_torch_function = torch._C._has_torch_function_unary


def all_reduce_sum(data: Any) -> Optional[Tensor]:
    """Sum ``data`` over the default group in place and return it, or ``None`` when the
    call needs the checked path (which then runs it)."""
    world = _registry.current
    pg: Any = world._default_pg
    if (
        pg is None
        or is_compiling()  # first: while tracing, nothing below may touch the tensor
        or data.__class__ is not Tensor
        or not data.is_cpu
        or data.dtype not in _DTYPES
        or data.layout is not _STRIDED  # sparse, MKL-DNN: the checked path says what to do
        or data.is_nested
        or not data.is_contiguous()
        or data.is_neg()  # a lazily negated view: torch's call would reduce the raw memory
        or data.requires_grad  # the checked path detaches: autograd never sees the call
        or _has_torch_function(data)
        or getattr(_watch._local, "depth", False)
        or _settings.values.get("debug", _DEBUG_DEFAULT)
        or pg in getattr(world, "pg_coalesce_state", ())
    ):
        return None
    facts = _FACTS.get(id(pg))
    if facts is None or facts.ref() is not pg or not facts.cpu_home or facts.broken:
        return None  # a new group (the checked path learns its facts), an accelerator's,
        # or a broken one (the checked path says so)
    group: Any = pg  # (mypy narrows pg to the weakref's Optional type above)
    me = get_ident()
    if facts.thread and facts.thread != me:
        return None  # another thread is in a collective on it: the checked path says so
    seq = facts.seq + 1
    if (
        facts.size > 1
        and _settings.values.get("check", _CHECK_DEFAULT)
        and _check.peek(facts, seq, sys._getframe(1))
    ):
        return None  # the default check is due: the checked path runs it
    # Comm.enter, inlined: this thread holds the group, and the call gets its number
    facts.thread = me
    facts.seq = seq
    facts.call = (_NAME, _NAME, _PARAMS, (data, _OP_SUM, False))
    try:
        opts: Any = _Options()  # Any: torch 2.4's stubs have no asyncOp
        opts.reduceOp = _SUM
        if _SYNC:
            opts.asyncOp = False  # as torch's own blocking call says (torch 2.7 and newer)
        group.allreduce([data], opts).wait()
    except Exception as exc:
        seq = facts.seq
        better = _watch._on_error(Comm(pg, facts.rank, facts.size, facts.impl, facts), _NAME, seq)(
            exc
        )
        if better is not None:
            raise better from exc
        raise
    finally:
        facts.call = None
        facts.thread = 0
    return data
