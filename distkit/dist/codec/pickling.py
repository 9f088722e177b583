"""Can this object be sent? The picklability check every world runs, and its message.

Object collectives send objects with pickle (tensor data aside), so an object that
cannot be pickled fails on 8 ranks. A single process runs the same check, so the same
code fails the same way in a debugger: :func:`check` raises the ``TypeError`` the
encoder would raise, naming the innermost part that cannot be pickled
(``data['fn'] (function) cannot be pickled``).
"""

from __future__ import annotations

import pickle
import threading
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Union

import torch
from torch import Tensor

from distkit.dist.core.args import fail, is_dtensor

if TYPE_CHECKING:
    from distkit.dist.core.comm import Comm

#: What an error calls the object: a name (``data``, the path below it follows), or a
#: function from the path below the object (``[0]['fn']``) to what the user calls it.
Naming = Union[str, Callable[[str], str]]

#: Types that pickle by construction: the checks skip them.
ATOMS = frozenset([int, float, bool, complex, str, bytes, type(None)])

#: Tensor classes whose data travels as raw bytes, never through pickle.
TENSOR_TYPES = (Tensor, torch.nn.Parameter)


def sendable(t: Tensor) -> bool:
    """Dense tensors travel as raw bytes; others (sparse, quantized, nested, meta) pickle.

    MKL-DNN tensors, which torch cannot pickle, travel as raw bytes too and arrive as
    dense tensors: so every plain ``torch.Tensor`` can be sent.
    """
    if t.layout is _MKLDNN:
        return True
    return (
        t.layout is torch.strided
        and not t.is_quantized
        and not t.is_nested
        and t.device.type != "meta"
    )


_MKLDNN = getattr(torch, "_mkldnn", None)


def _placeholder(*args: Any) -> NoReturn:
    raise pickle.UnpicklingError("a picklability probe is not meant to be loaded")


class _Null:
    """A file that forgets what is written: the dry run pickles into it."""

    def write(self, data: Any) -> int:
        return len(data)


class _Probe(pickle.Pickler):
    """Pickles into nothing, skipping tensor data (it never goes through pickle)."""

    def __init__(self) -> None:
        super().__init__(_Null(), protocol=5, buffer_callback=lambda buf: False)

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in TENSOR_TYPES and sendable(obj):
            attrs = obj.__dict__  # its attributes travel with it (see wire._with_attributes)
            return (_placeholder, (), dict(attrs)) if attrs else (_placeholder, ())
        if isinstance(obj, Tensor) and is_dtensor(obj):  # sent as its local shard
            return self.reducer_override(obj.to_local())  # type: ignore[attr-defined]
        return NotImplemented


def _children(obj: Any) -> list[tuple[str, Any]]:
    try:
        if isinstance(obj, dict):
            out = []
            for k, v in obj.items():
                out.append((f"[{k!r}] (key)", k))
                out.append((f"[{k!r}]", v))
            return out
        if isinstance(obj, (list, tuple)):
            return [(f"[{i}]", v) for i, v in enumerate(obj)]
        if isinstance(obj, (set, frozenset)):
            return [(f" element {v!r}", v) for v in obj]
        attrs = vars(obj) if hasattr(type(obj), "__dict__") else None
        if isinstance(attrs, dict):
            return [(f".{k}", v) for k, v in attrs.items()]
    except Exception:  # a hostile __getattr__ or __repr__: stop descending here
        return []
    return []


def _picklable(obj: Any) -> bool:
    try:
        _Probe().dump(obj)
    except Exception:
        return False
    return True


def _locate(obj: Any, path: str, depth: int = 0) -> tuple[str, Any]:
    """Path to the innermost part of ``obj`` that cannot be pickled."""
    if depth < 50:
        for sub, child in _children(obj):
            if not _picklable(child):
                return _locate(child, path + sub, depth + 1)
    return path, obj


def error(obj: Any, name: Naming, fn: str, comm: Comm, exc: BaseException) -> TypeError:
    """The ``TypeError`` that says which part of ``obj`` could not be pickled, and why."""
    below, culprit = _locate(obj, "")
    path = name(below) if callable(name) else name + below
    try:
        kind = type(culprit).__name__
    except Exception:  # pragma: no cover - a type without a name
        kind = "object"
    try:
        fail(
            TypeError,
            fn,
            comm,
            f"{path} ({kind}) cannot be pickled: {type(exc).__name__}: {exc}",
            "Object collectives send objects with pickle: use module-level functions "
            "and classes, and plain data instead of locks, files or generators",
        )
    except TypeError as made:
        return made


_local = threading.local()
_CONTAINERS = (dict, list, tuple)
_PLAIN_BUDGET = 64  # nodes the quick walk visits before handing over to the pickler


def flat(obj: dict) -> bool:
    """Whether a dict holds only atoms, keys and values: the metrics dict of a step.

    The single-process shortcut of ``all_gather_object`` uses this rather than
    :func:`_trivially_picklable`, which accepts the same dicts but costs about 1.5x as
    much on two items.
    """
    for key, value in obj.items():
        if type(key) not in ATOMS or type(value) not in ATOMS:
            return False
    return True


def _trivially_picklable(obj: Any) -> bool:
    """Whether ``obj`` is small and built only of builtin containers, atoms and tensors."""
    budget = _PLAIN_BUDGET
    pending: list = []
    node = obj
    while True:
        if type(node) is dict:
            for key in node:
                if type(key) not in ATOMS:
                    return False
            values = node.values()
        else:
            values = node
        budget -= len(node)
        if budget < 0:
            return False
        for value in values:
            kind = type(value)
            if kind is Tensor:
                if value.__dict__:  # attributes of its own, which travel too: probed
                    return False
            elif kind not in ATOMS:
                if kind not in _CONTAINERS:
                    return False
                pending.append(value)
        if not pending:
            return True
        node = pending.pop()


def check(obj: Any, name: Naming, fn: str, comm: Comm) -> None:
    """Raise the encoder's ``TypeError`` if ``obj`` could not be sent; send nothing.

    Small objects made of builtin containers, atoms and dense tensors pass a quick walk;
    anything else is pickled into a null sink (tensor data skipped), which finds exactly
    what the encoder would fail on. Any exception raised while pickling counts.
    """
    if type(obj) in ATOMS or (type(obj) in _CONTAINERS and _trivially_picklable(obj)):
        return
    probe = getattr(_local, "probe", None)
    if probe is None:
        probe = _local.probe = _Probe()
    try:
        probe.dump(obj)
    except Exception as exc:
        _local.probe = None  # a failed dump can leave the pickler in any state
        raise error(obj, name, fn, comm, exc) from None
    finally:
        if getattr(_local, "probe", None) is not None:
            probe.clear_memo()
