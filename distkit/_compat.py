"""The few places where distkit reaches past torch's public API.

Each one is here, with the reason, so a torch upgrade has one file to check, and each
has a public fallback: on a torch where a private name is gone or has changed, distkit
takes the public path (slower, or less precise in a message) instead of breaking.
``tests/test_compat.py`` runs the core collectives with every private name removed, and
``tests/test_layout.py`` checks that no other module names torch's private API.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import importlib.abc
import importlib.util
import os
import sys
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import torch
import torch.distributed as td
from torch import Tensor

AVAILABLE = td.is_available()
F = TypeVar("F", bound=Callable[..., Any])

if TYPE_CHECKING or AVAILABLE:
    from torch.distributed import ProcessGroup, ReduceOp
    from torch.distributed import distributed_c10d as c10d
else:  # builds without distributed support (some macOS wheels): single process only

    class ProcessGroup:
        """Placeholder: this torch build has no torch.distributed."""

    class ReduceOp:
        SUM = PRODUCT = MIN = MAX = BAND = BOR = BXOR = AVG = None

    c10d = None


class _NoRegistry:
    """Stands in for torch's registry when this build has none."""

    __slots__ = ()

    @property
    def _default_pg(self) -> None:
        return None


class _PublicRegistry:
    """Reads the default group through the public API, for builds without ``_world``."""

    __slots__ = ()

    @property
    def _default_pg(self) -> Any:
        return c10d.GroupMember.WORLD if td.is_initialized() else None


def torch_registry() -> Any:
    """An object whose ``_default_pg`` is the default process group, or None.

    The single-process fast path reads ``_world._default_pg`` directly: it costs 18 ns,
    against 146 ns for ``torch.distributed.is_initialized()`` (a property chain through a
    metaclass), and that check runs inside every training step of every user.
    ``_World._default_pg`` has existed since torch 1.13.
    """
    if not AVAILABLE:
        return _NoRegistry()
    registry = getattr(c10d, "_world", None)
    if registry is not None and hasattr(registry, "_default_pg"):
        return registry
    return _PublicRegistry()


if AVAILABLE:
    # torch 2.13 renamed the single-tensor collectives and deprecated the old names.
    all_gather_single = getattr(td, "all_gather_single", None) or td.all_gather_into_tensor
    reduce_scatter_single = getattr(td, "reduce_scatter_single", None) or td.reduce_scatter_tensor


# -- torch.compile ------------------------------------------------------------------------

#: Whether torch.compile is tracing the caller (torch >= 2.3 has it public).
is_compiling: Callable[[], bool] = torch.compiler.is_compiling

#: torch.compile's frame hook, when one is set (torch >= 2.5 can say; else ``None``)
_frame_hook: Optional[Callable[[], Any]] = getattr(
    getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None), "get_eval_frame_callback", None
)


def in_compiled_eager() -> bool:
    """Whether this code runs eagerly inside a ``torch.compile``'d function (after a graph
    break, or in a frame torch.compile gave up on) while its frame hook is set: then it
    may try to compile any function this code calls, as a frame of its own, and fails
    hard on one that touches a process group's methods. Calls that must run eagerly go
    through :func:`disable` then. (Always ``False`` on a torch that cannot tell.)"""
    if _frame_hook is None or is_compiling():
        return False
    return _frame_hook() not in (None, False)


def under_compile() -> bool:
    """Whether torch.compile is tracing the caller, or its frame hook is set around it
    (:func:`in_compiled_eager`): either way, a call that cannot trace must run through
    :func:`disable` to keep the tracer out of its functions."""
    return is_compiling() or in_compiled_eager()


def after_import(name: str, callback: Callable[[], None]) -> None:
    """Run ``callback`` once module ``name`` is imported: now if it is, else right after
    its import finishes (a one-shot import hook; ``name``'s parent must be imported)."""
    if name in sys.modules:
        callback()
        return

    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            loader, run = spec.loader, spec.loader.exec_module

            def exec_module(module: Any) -> None:
                run(module)
                callback()

            loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _Hook())


def disable(fn: F, reason: str) -> F:
    """``fn`` excluded from torch.compile's graphs: calling it while tracing is a clean
    graph break, whose reason (torch >= 2.8 shows it in ``torch._dynamo.explain``) says
    why."""
    try:
        return torch._dynamo.disable(fn, reason=reason)  # type: ignore[call-arg, unused-ignore]
    except TypeError:  # torch < 2.8: no reason
        return torch._dynamo.disable(fn)


# -- the hot path -----------------------------------------------------------------------

#: Whether a tensor overrides torch functions (``__torch_function__``, a mode is active):
#: torch's own fast test, or ``None`` when this torch lacks it (then the lean lane of
#: ``all_reduce`` steps aside for the checked path).
has_torch_function_unary: Optional[Callable[[Any], bool]] = getattr(
    torch._C, "_has_torch_function_unary", None
)


_use_count: Optional[Callable[[int], int]] = getattr(torch._C, "_storage_Use_Count", None)


def storage_use_count(storage: Any) -> Optional[int]:
    """How many references hold ``storage`` (an ``UntypedStorage``) in C++: the tensors
    made on it, and its Python object as this torch counts it; ``None`` when this torch
    cannot tell (then a buffer is never taken for unused, and a new one is made)."""
    return None if _use_count is None else _use_count(storage._cdata)


def coalescing(world: Any, pg: Any) -> bool:
    """Whether ``pg`` is inside torch's ``_coalescing_manager`` (collectives are queued,
    not run). Unknown on a torch without the registry's record: then say yes, so that the
    lean lane steps aside."""
    state = getattr(world, "pg_coalesce_state", None)
    return True if state is None else pg in state


def flatten_dense(tensors: list[Tensor]) -> Tensor:
    """``tensors`` concatenated flat (torch's bucketing helper, or its public equivalent)."""
    fn = getattr(getattr(torch, "_utils", None), "_flatten_dense_tensors", None)
    if fn is not None:
        return fn(tensors)
    return torch.cat([t.contiguous().view(-1) for t in tensors])


def unflatten_dense(flat: Tensor, tensors: list[Tensor]) -> list[Tensor]:
    """Views of ``flat`` shaped as ``tensors`` (the inverse of :func:`flatten_dense`)."""
    fn = getattr(getattr(torch, "_utils", None), "_unflatten_dense_tensors", None)
    if fn is not None:
        return list(fn(flat, tensors))
    out, at = [], 0
    for t in tensors:
        out.append(flat[at : at + t.numel()].view_as(t))
        at += t.numel()
    return out


def functional_collectives() -> Any:
    """torch's functional collectives (what ``torch.compile`` traces), or ``None`` when this
    torch lacks them (then every collective runs eagerly between graphs)."""
    try:
        import torch.distributed._functional_collectives as fc
    except ImportError:
        return None
    return fc


def run_at_trace_time(fn: F) -> F:
    """``fn`` run by torch.compile's tracer when it meets the call (once per trace), its
    result a constant of the graph: side effects of tracing, without a graph break or a
    guard on them."""
    marker = getattr(torch.compiler, "assume_constant_result", None)
    return fn if marker is None else marker(fn)


def real_object(obj: Any) -> Any:
    """The object behind the stand-in torch.compile's tracer hands a function run at trace
    time (a ``FakeScriptObject`` wraps a process group; torch 2.13 keeps the group itself
    in it), or ``obj`` itself."""
    return getattr(obj, "real_obj", obj)


def get_process_group_ranks(pg: Any) -> list[int]:
    """Global ranks of ``pg``'s members (a constant to torch.compile's tracer)."""
    return td.get_process_group_ranks(pg)


def default_store() -> Any:
    """The store the default process group rendezvoused on (the side channel of
    distkit's diagnostics). Raises when this torch does not say (then the diagnostics
    that need it do without: see :mod:`distkit.dist.guard.board`)."""
    getter = getattr(c10d, "_get_default_store", None)
    if getter is None:
        raise RuntimeError("this torch does not expose the default group's store")
    return getter()


def root_store(store: Any) -> Any:
    """``store`` without the ``PrefixStore`` layers torch wraps around it: the store a
    launcher hosts, where it and the ranks can meet under the same key names."""
    while isinstance(store, td.PrefixStore):
        inner = getattr(store, "underlying_store", None)
        if inner is None:  # torch without the accessor: stay in the prefixed space
            break
        store = inner
    return store


def group_name(pg: Any) -> str:
    """The name torch gave ``pg``: the same on every rank ("0" for the default group)."""
    name = getattr(pg, "group_name", None)
    if isinstance(name, str) and name:
        return name
    return str(c10d._world.pg_names.get(pg, ""))


def backend_name(pg: Any) -> str:
    """Lower-case backend name of ``pg``: ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``."""
    return str(td.get_backend(pg)).lower()


def backend_config(pg: Any) -> str:
    """Device-to-backend map of ``pg``, e.g. ``"cpu:gloo,cuda:gloo"`` for a gloo group."""
    try:
        return str(td.get_backend_config(pg)).lower()
    except (AttributeError, RuntimeError, ValueError):
        return backend_name(pg)


def group_timeout(pg: Any) -> Optional[timedelta]:
    """The collective timeout ``pg`` was created with, or ``None`` if torch hides it.

    torch keeps it only in each device backend's options (``ProcessGroupGloo.options``),
    and ``new_group(timeout=None)`` takes torch's default (30 minutes) rather than the
    world's: distkit reads the world's here to give its sub-groups the same.
    """
    for device in ("cpu", "cuda"):
        try:
            timeout = pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # no such backend on this group, or no options on this torch
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return None


def destroy(groups: Optional[list[Any]] = None) -> None:
    """``destroy_process_group`` for each of ``groups`` (``None``: the world, and with it
    every group), without the deadlock torch before 2.8 can fall into.

    There, ``~ProcessGroup`` runs with the GIL held and joins gloo's worker threads, one of
    which may be freeing a tensor with a Python object, which needs the GIL: both wait
    forever (pytorch#75097; fixed by pytorch#154976). distkit holds each group's gloo
    backend while the groups go, and lets go of a backend only once its group is gone: a
    backend's own destructor releases the GIL, so the join then happens without it. A
    group something else still holds (a ``DistributedDataParallel`` model that outlives
    ``destroy_dist``, very common) keeps its backends held until it goes too; one still
    alive when the interpreter exits keeps them for good (the process ends without
    joining their threads). The caller must hold no other reference to the groups
    (``groups`` itself is emptied).
    """
    world: Any = getattr(c10d, "_world", None)
    if groups is None and not hasattr(world, "pg_map"):  # a torch without the registry
        td.destroy_process_group()
        return
    targets = list(world.pg_map) if groups is None else groups
    for pg in targets:
        held = []
        for device in ("cpu", "cuda"):
            try:
                held.append(pg._get_backend(torch.device(device)))
            except Exception:  # no backend for that device
                pass
        ref: Callable[[], Any]
        try:
            ref = weakref.ref(pg)
        except TypeError:  # a group type without weak references: held until exit
            ref = functools.partial(lambda held_pg: held_pg, pg)
        _lingering.append((ref, held))
    # the loop variable would otherwise hold the last group until this frame goes, after
    # the backends: its destructor would then join gloo's threads with the GIL held
    pg = None
    if groups is None:
        targets.clear()
        td.destroy_process_group()
    else:
        while groups:
            td.destroy_process_group(groups.pop())
    _let_go()


#: (a reference to a destroyed group, its backends), until the group is gone
_lingering: list[tuple[Callable[[], Any], list[Any]]] = []


def _let_go() -> None:
    """Drop the backends of destroyed groups that are gone (each dies without the GIL)."""
    _lingering[:] = [(ref, held) for ref, held in _lingering if ref() is not None]


#: how long the exit waits, without the GIL, for the threads of groups still alive
SETTLE_SECONDS = 0.02


def _at_exit() -> None:
    _keep_inherited()
    _let_go()
    world: Any = getattr(c10d, "_world", None)
    if _lingering or getattr(world, "pg_map", None):
        # a group still alive keeps its backend's worker threads to the end; one that
        # just finished a collective may still hold its tensors, and freeing one whose
        # Python object torch kept takes the GIL: once the interpreter is finalizing,
        # that thread is stopped inside a destructor and the process aborts ("terminate
        # called without an active exception") after a run that succeeded. Sleeping
        # releases the GIL: such threads finish now, while Python is whole.
        time.sleep(SETTLE_SECONDS)
    # groups still alive now go during the interpreter's teardown, in no order distkit
    # controls: their backends must not die with them (with the GIL held), so they stay
    for _, held in _lingering:
        for backend in held:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(backend))
    _lingering.clear()


#: In a forked child: the groups and backends it got from its parent (see _keep_inherited)
_inherited: list[Any] = []


def _after_fork_in_child() -> None:
    # Python objects only: a C++ call in a fork's child could wait for a lock that a
    # thread of the parent held (the groups, as distkit._registry reads them for its own
    # fork hook, which must run where this module was not imported yet)
    world: Any = getattr(c10d, "_world", None)
    _inherited[:] = [backend for _, backends in _lingering for backend in backends]
    _inherited.extend(getattr(world, "pg_map", None) or ())
    _lingering.clear()


def _keep_inherited() -> None:
    """A forked child that ends with ``sys.exit`` (one that ends with ``os._exit``, as
    ``multiprocessing``'s do, runs none of this) has none of its parent's threads, and
    freeing a gloo backend joins its threads, for which it would wait for ever: every
    backend inherited from the parent is kept."""
    held = []
    for item in _inherited:
        if not isinstance(item, td.ProcessGroup):
            held.append(item)
            continue
        for device in ("cpu", "cuda"):
            try:
                held.append(item._get_backend(torch.device(device)))
            except Exception:  # no backend for that device
                pass
    for backend in held:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(backend))


atexit.register(_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def is_registered(pg: Any) -> bool:
    """Whether ``pg`` belongs to the current world (False once it was destroyed)."""
    world: Any = getattr(c10d, "_world", None)
    return pg in world.pg_map if hasattr(world, "pg_map") else True


def accelerator_current_index(device_type: str) -> int:
    """The current device index of ``device_type`` (``cuda``, ``npu``, ``xpu``, ...)."""
    module = getattr(torch, device_type, None)
    if module is None or not hasattr(module, "current_device"):
        raise RuntimeError(
            f"torch has no '{device_type}' module: install the extension that provides "
            f"the '{device_type}' device (e.g. torch_npu for npu) and import it first"
        )
    return int(module.current_device())
