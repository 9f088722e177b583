"""The safe serializer: decoding what ranks that may be hostile send.

``serializer="safe"`` decodes another rank's object without trusting that rank.

What the safe serializer guarantees, and what it does not, is written down once, in
:mod:`distkit.dist.serializer`; this module keeps those promises.

How
---
1. :func:`~distkit.dist.codec.opcodes.scan` reads the pickle's opcodes before the unpickler
   does (a regular expression over runs of them): only the opcodes CPython's pickler
   writes with protocol 5 pass, byte counts must fit in the payload, and the globals are
   counted.
2. Without a global the payload is plain data: one unpickling, every global refused.
3. Otherwise a first unpickling builds stand-ins (:class:`~distkit.dist.codec.builders.Stub`)
   for everything a global makes. A stand-in checks the arguments of the call that makes
   it and refuses every opcode that is not plain data for its kind (``BUILD`` on a
   tensor, ``SETITEM`` on an array, calling ``bytearray``, setting attributes of a
   class). The pickle machine has no branches: a second unpickling runs the same opcodes
   on the same stack positions, so once the first one passed, the second builds the real
   objects (tensors, made in between, are handed out by blob) with every call's
   arguments and every opcode applied to a built object already checked.
"""

from __future__ import annotations

import builtins
import io
import pickle
from typing import Any, Callable

from distkit.dist.codec import policy
from distkit.dist.codec.builders import (
    CONSTRUCTORS,
    TYPE_VALUES,
    Constructor,
    Stub,
    class_stub,
)
from distkit.dist.codec.opcodes import SHALLOW, depth_bound, on_deep_stack, scan
from distkit.dist.codec.policy import Refused

#: A decoded object may take at most this many bytes of memory per byte received.
EXPANSION = 256
#: The most memory CPython's unpickler takes per byte of pickle: one ``EMPTY_SET`` opcode
#: (a byte) makes a 216-byte set and a stack slot; nothing else comes close.
VM_BYTES_PER_BYTE = 240


class Budget:
    """What one decoded object may still allocate, charged before each allocation."""

    def __init__(self, limit: int, why: str) -> None:
        self.limit = self.left = limit
        self.why = why

    def charge(self, nbytes: int, what: str) -> None:
        if nbytes > self.left:
            raise Refused(
                f"{what} would allocate {nbytes} bytes, beyond the {self.limit} bytes {self.why}"
            )
        self.left -= nbytes


TENSOR_REF = ("distkit.dist.codec.wire", "_tensor_ref")


class _Unpickler(pickle.Unpickler):
    """One unpickling of the safe serializer: stand-ins first, the real objects second."""

    def __init__(self, skeleton: bytes, buffers: list, tensors: Any = None) -> None:
        super().__init__(io.BytesIO(skeleton), buffers=buffers)
        self.tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        if not policy.allowed(module, name):
            raise Refused(f"{module}.{name}", global_name=f"{module}.{name}")
        return self.resolve(module, name)

    def resolve(self, module: str, name: str) -> Any:
        raise Refused(f"{module}.{name}", global_name=f"{module}.{name}")


class _Stubs(_Unpickler):
    """The first unpickling: stand-ins, which check every call and every opcode."""

    def resolve(self, module: str, name: str) -> Any:
        key = (module, name)
        if key == TENSOR_REF:
            return self.tensors
        if key in CONSTRUCTORS:
            real, check, kind, ops = CONSTRUCTORS[key]
            return Constructor(f"{module}.{name}", real, check, kind, ops)
        if module == "builtins" and name in TYPE_VALUES:
            return Stub(type, name=name)  # a value (a defaultdict's factory), never called
        if module == "torch" and name in policy.torch_dtypes():
            return policy.torch_dtypes()[name]  # no method the pickle machine calls
        return class_stub(key)  # an allowed class


class _Objects(_Unpickler):
    """The second unpickling: the real objects, on the paths the first one checked."""

    def resolve(self, module: str, name: str) -> Any:
        key = (module, name)
        if key == TENSOR_REF:
            return self.tensors
        if key in CONSTRUCTORS:
            return CONSTRUCTORS[key][0]
        if module == "builtins" and name in TYPE_VALUES:
            return getattr(builtins, name)
        if module == "torch" and name in policy.torch_dtypes():
            return policy.torch_dtypes()[name]
        return super(_Unpickler, self).find_class(module, name)  # an allowed class


class Tensors:
    """What the safe serializer needs from the wire format's tensor blobs."""

    def check(self, args: tuple) -> Any:
        """Check a tensor reference's arguments (once per blob); a key to :meth:`build`."""
        raise NotImplementedError

    def build(self, key: Any, budget: Budget) -> Any:
        """The tensor of a checked reference."""
        raise NotImplementedError


def load(skeleton: bytes, buffers: list, tensors: Tensors, budget: Budget) -> Any:
    """Decode ``skeleton`` (a pickle) under the safe serializer; see the module docstring.

    Raises:
        Refused: anything outside plain data, found before any of it is built.
    """
    calls = bool(policy.user_classes())  # a namedtuple built by a call is a tuple too
    globals_, _ = scan(skeleton)
    budget.charge(VM_BYTES_PER_BYTE * len(skeleton), "unpickling the object")
    bound = depth_bound(skeleton, calls) if len(skeleton) > SHALLOW else 0

    def run(fn: Callable[[], Any]) -> Any:
        return on_deep_stack(fn, bound) if bound > SHALLOW else fn()

    if not globals_:  # plain data: nothing to call, nothing but containers to change
        return run(lambda: _plain_data(_Unpickler(skeleton, buffers)))
    keys: dict[int, Any] = {}

    def reference(*args: Any) -> None:
        keys[args[0]] = tensors.check(args)

    stand_in = Constructor(".".join(TENSOR_REF), None, reference, "torch.Tensor")
    run(lambda: _plain_data(_Stubs(skeleton, buffers, stand_in)))
    # the tensors are built here, on this thread (its device, its streams), never in `run`
    built = {index: tensors.build(key, budget) for index, key in keys.items()}
    return run(lambda: _Objects(skeleton, buffers, lambda *args: built.pop(args[0])).load())


def _plain_data(unpickler: _Unpickler) -> Any:
    """Unpickle, taking any error for a payload that does what plain data never does."""
    try:
        return unpickler.load()
    except Refused:
        raise
    except Exception as exc:
        raise Refused(f"it is not plain data ({type(exc).__name__}: {exc})") from exc
