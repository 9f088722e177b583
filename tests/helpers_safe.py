"""Crafted payloads for the safe serializer, and a prober that decodes them in a subprocess.

Each payload is a real distkit wire payload (the encoder's own output, or a hand-written
pickle skeleton framed the way the encoder frames one). The dangerous ones (memory
corruption, memory bombs) run through :func:`probe`: a fresh interpreter decodes each in
a forked child, so a segfault or an out-of-memory kill fails one case instead of pytest,
and the child reports how much its peak memory grew.

Run as a script: ``python tests/helpers_safe.py SERIALIZER CASE...`` prints one JSON line
per case.
"""

from __future__ import annotations

import collections
import json
import os
import pickle
import struct
import sys
from typing import Any, Callable, Optional

import numpy as np
import torch

from distkit.dist.codec import wire as _wire

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # NumPy 1.x
    from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]


class Reduce:
    """Pickles as ``fn(*args)``, then ``BUILD state`` and list/dict items if given."""

    def __init__(self, fn: Any, args: tuple, state: Any = None, items: Any = None) -> None:
        self.fn, self.args, self.state, self.items = fn, args, state, items

    def __reduce__(self):
        if self.items is not None:
            return self.fn, self.args, self.state, None, iter(self.items)
        if self.state is not None:
            return self.fn, self.args, self.state
        return self.fn, self.args


def encoded(obj: Any) -> _wire.Encoded:
    """``obj`` encoded by distkit's own encoder (its tensors become blobs)."""
    return _wire.encode(obj, "data", "test", None)


# -- hand-written pickle skeletons --------------------------------------------------------

PROTO, STOP, MARK, NONE = b"\x80\x05", b".", b"(", b"N"
EMPTY_TUPLE, EMPTY_LIST, EMPTY_DICT = b")", b"]", b"}"
TUPLE, TUPLE1, TUPLE2, TUPLE3 = b"t", b"\x85", b"\x86", b"\x87"
REDUCE, BUILD, SETITEM, ADDITEMS, POP, MEMOIZE = b"R", b"b", b"s", b"\x90", b"0", b"\x94"


def text(s: str) -> bytes:
    raw = s.encode()
    if len(raw) < 256:
        return b"\x8c" + bytes([len(raw)]) + raw
    return b"X" + struct.pack("<I", len(raw)) + raw


def glob(module: str, name: str) -> bytes:
    return text(module) + text(name) + b"\x93"


def integer(n: int) -> bytes:
    if -(1 << 31) <= n < 1 << 31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw  # LONG1


def frame(skeleton: bytes, blobs: tuple[bytes, ...] = ()) -> _wire.Encoded:
    """A wire payload holding ``skeleton`` and CPU tensor blobs (the encoder's layout)."""
    table_end = _wire.HEADER_BYTES + 16 * len(blobs)
    offset = _wire._align(table_end + len(skeleton))
    offsets = []
    for blob in blobs:
        offsets.append(offset)
        offset = _wire._align(offset + len(blob))
    raw = bytearray(offset)
    table = [v for blob in blobs for v in (len(blob), _wire.CPU_BLOB)]
    struct.pack_into(
        f"<{4 + len(table)}q", raw, 0, _wire.MAGIC, len(skeleton), len(blobs), 0, *table
    )
    raw[table_end : table_end + len(skeleton)] = skeleton
    for blob, at in zip(blobs, offsets):
        raw[at : at + len(blob)] = blob
    # a receive buffer is torch's own memory (resizable storage), as in the collectives
    cpu = torch.empty(len(raw), dtype=torch.uint8)
    cpu.copy_(torch.frombuffer(raw, dtype=torch.uint8))
    return _wire.Encoded(cpu, None)


def tensor_ref(index: int, dtype: str, shape: tuple[int, ...], device: str = "cpu") -> bytes:
    """A skeleton fragment calling the tensor-reference global (no grad, no Parameter)."""
    dims = b"".join(integer(d) for d in shape)
    return (
        glob("distkit.dist.codec.wire", "_tensor_ref")
        + MARK
        + integer(index)
        + text(dtype)
        + MARK
        + dims
        + TUPLE
        + b"\x89\x89"  # requires_grad=False, parameter=False
        + text(device)
        + TUPLE
        + REDUCE
    )


def fragment(value: Any) -> bytes:
    """``value`` as pickle opcodes to splice into a skeleton (no PROTO, FRAME or STOP)."""
    raw = pickle.dumps(value, protocol=5)[2:-1]
    return raw[9:] if raw[:1] == b"\x95" else raw


def call(module: str, name: str, *args: Any) -> bytes:
    """A skeleton fragment calling ``module.name(*args)``."""
    return glob(module, name) + fragment(args) + REDUCE


# -- the catalogue ----------------------------------------------------------------------


def numpy_object_pointer(address: int) -> Any:
    """An array whose dtype state makes 8 raw bytes an object pointer (the brief's attack)."""
    object_field = {"a": (np.dtype("O"), 0)}
    dtype_state = (3, "|", None, ("a",), object_field, 8, 1, 0)  # flags cleared
    crafted_dtype = Reduce(np.dtype, ("V8", False, True), dtype_state)
    array_state = (1, (1,), crafted_dtype, False, struct.pack("<Q", address))
    return Reduce(_reconstruct, (np.ndarray, (0,), b"b"), array_state)


def _range_into(fn: Any, n: int) -> Any:
    return Reduce(fn, (range(n),))


def _slice_range_setitem(n: int) -> _wire.Encoded:
    """``lst[0:0] = range(n)``: a list expands a lazy range through SETITEM."""
    skeleton = (
        PROTO
        + EMPTY_LIST
        + glob("builtins", "slice")
        + integer(0)
        + integer(0)
        + NONE
        + TUPLE3
        + REDUCE
        + glob("builtins", "range")
        + integer(n)
        + TUPLE1
        + REDUCE
        + SETITEM
        + STOP
    )
    return frame(skeleton)


def _tensor_add_broadcast(n: int) -> _wire.Encoded:
    """ADDITEMS on a (n, 1) tensor with a (1, n) one: ``t.add(u)`` makes n * n floats."""
    blob = bytes(4 * n)
    skeleton = (
        PROTO
        + tensor_ref(0, "float32", (n, 1))
        + MARK
        + tensor_ref(1, "float32", (1, n))
        + ADDITEMS
        + STOP
    )
    return frame(skeleton, (blob, blob))


def _tensor_setitem_broadcast(n: int) -> _wire.Encoded:
    """SETITEM on a tensor with broadcasting index tensors: n * n indices computed."""
    index = bytes(8 * n)  # int64 zeros
    skeleton = (
        PROTO
        + tensor_ref(0, "float32", (2, 2))
        + tensor_ref(1, "int64", (n, 1))
        + tensor_ref(2, "int64", (1, n))
        + TUPLE2
        + b"G"
        + struct.pack(">d", 0.0)
        + SETITEM
        + STOP
    )
    return frame(skeleton, (bytes(16), index, index))


def _tensor_set_storage(n: int) -> _wire.Encoded:
    """BUILD with a legacy 4-tuple state: ``t.set_(other, 0, (n,), (1,))`` resizes storage."""
    skeleton = (
        PROTO
        + tensor_ref(0, "float32", (2,))
        + MARK
        + tensor_ref(1, "float32", (2,))
        + integer(0)
        + integer(n)
        + TUPLE1
        + integer(1)
        + TUPLE1
        + TUPLE
        + BUILD
        + STOP
    )
    return frame(skeleton, (bytes(8), bytes(8)))


def _class_mutation(module: str, name: str) -> _wire.Encoded:
    """BUILD on a class object with slot state: ``setattr(cls, 'most_common', None)``."""
    skeleton = (
        PROTO
        + glob(module, name)
        + NONE
        + EMPTY_DICT
        + text("most_common")
        + NONE
        + SETITEM
        + TUPLE2
        + BUILD
        + STOP
    )
    return frame(skeleton)


def _memo_bomb(index: int) -> _wire.Encoded:
    """One LONG_BINPUT: the C unpickler grows its memo to 2 * index entries, zero-filled."""
    return frame(PROTO + NONE + b"r" + struct.pack("<I", index) + STOP)


def _put_bomb(index: int) -> _wire.Encoded:
    """The same with the text PUT opcode."""
    return frame(PROTO + NONE + b"p" + str(index).encode() + b"\n" + STOP)


def _deep_tuple_key(depth: int) -> _wire.Encoded:
    """A dict keyed by a tuple nested ``depth`` deep: hashing it recurses ``depth`` C frames
    (CPython's own stack overflows past about 130k on an 8 MiB stack)."""
    return frame(PROTO + EMPTY_DICT + EMPTY_TUPLE + TUPLE1 * depth + NONE + SETITEM + STOP)


#: Builders of the payloads the prober can run, by name (each is called in the child).
CASES: dict[str, Callable[[], _wire.Encoded]] = {
    "numpy_object_pointer": lambda: encoded(numpy_object_pointer(id(os.system))),
    "bytearray_bomb": lambda: encoded(Reduce(bytearray, (300_000_000,))),
    "bytes_bomb": lambda: encoded(Reduce(bytes, (300_000_000,))),
    "list_range": lambda: encoded(_range_into(list, 4_000_000)),
    "frozenset_range": lambda: encoded(_range_into(frozenset, 4_000_000)),
    "deque_range": lambda: encoded(_range_into(collections.deque, 4_000_000)),
    "size_range": lambda: encoded(_range_into(torch.Size, 4_000_000)),
    "slice_range_setitem": lambda: _slice_range_setitem(20_000_000),
    "memo_long_binput": lambda: _memo_bomb(1 << 24),
    "memo_put": lambda: _put_bomb(1 << 24),
    "deep_tuple_key": lambda: _deep_tuple_key(1_000_000),
    "tensor_add_broadcast": lambda: _tensor_add_broadcast(8_000),
    "tensor_setitem_broadcast": lambda: _tensor_setitem_broadcast(6_000),
    "tensor_set_storage": lambda: _tensor_set_storage(50_000_000),
    "tensor_empty_huge": lambda: frame(PROTO + tensor_ref(0, "float32", (1 << 40,)) + STOP, (b"",)),
    "counter_class_mutation": lambda: _class_mutation("collections", "Counter"),
}


def _warm_up() -> _wire.Encoded:
    """Plain data of every kind the decoder builds: containers, tensors, NumPy."""
    return encoded({"a": [1, 2.5, "x", b"y"], "t": torch.ones(3), "n": np.arange(3)})


def _peak_mib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) // 1024
    return -1


def _run_case(name: str, serializer: str) -> dict:
    enc = CASES[name]()
    # decode plain data first, so that what the decoder imports on first use (tens of MB
    # with some torch builds) is not counted as the payload's allocation
    _wire.decode(_warm_up(), serializer_name=serializer)
    before = _peak_mib()
    report: dict[str, Any] = {"case": name, "payload_bytes": enc.cpu.numel()}
    try:
        out = _wire.decode(enc, serializer_name=serializer)
        report["outcome"] = "decoded"
        report["value"] = repr(_describe(out))[:200]
    except Exception as exc:
        from distkit.dist import UnsafeObjectError

        report["outcome"] = "refused" if isinstance(exc, UnsafeObjectError) else "error"
        report["type"] = type(exc).__name__
        report["message"] = str(exc)[:400]
    report["peak_growth_mib"] = _peak_mib() - before
    report["counter_intact"] = callable(getattr(collections.Counter, "most_common", None))
    return report


def _describe(out: Any) -> Any:
    if isinstance(out, np.ndarray) and out.dtype.names:
        return out[out.dtype.names[0]][0]
    if isinstance(out, (list, tuple, dict, collections.deque, frozenset, bytes, bytearray)):
        return f"{type(out).__name__} of {len(out)}"
    return out


def main(serializer: str, names: list[str]) -> None:
    for name in names:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child decodes and reports; a crash shows as a signal below
            os.close(read)
            try:
                line = json.dumps(_run_case(name, serializer))
            except BaseException as exc:  # the builder itself failed
                line = json.dumps({"case": name, "outcome": "error", "message": repr(exc)})
            os.write(write, line.encode())
            os._exit(0)
        os.close(write)
        chunks = []
        while chunk := os.read(read, 65536):
            chunks.append(chunk)
        os.close(read)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            line = json.dumps({"case": name, "outcome": f"crashed (signal {os.WTERMSIG(status)})"})
        else:
            line = b"".join(chunks).decode()
        print(line, flush=True)


def probe(serializer: str, names: list[str], timeout: float = 300) -> dict[str, dict]:
    """Decode the named payloads in a fresh interpreter; each case's report by name."""
    from helpers_subprocess import run

    proc = run([__file__, serializer, *names], timeout=timeout)
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in reports}


def crafted(obj: Any, serializer: Optional[str] = "safe") -> Any:
    """Encode ``obj`` and decode it with ``serializer``."""
    return _wire.decode(encoded(obj), serializer_name=serializer or "pickle")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
