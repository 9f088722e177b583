"""The opcode scan of the safe serializer: only pickles distkit could have written.

CPython's unpickler trusts a few opcodes' arguments with memory before it has read them:
``LONG_BINPUT 2**31`` (5 bytes) makes it allocate and zero a 32 GiB memo, a byte count
beyond the end of the payload is allocated before the read fails, and a tuple nested a
million deep crashes it when the tuple is hashed (a dict key). :func:`scan` rules these
out before the unpickler sees a byte, at the speed of a regular expression; see
:mod:`distkit.dist.codec.safe` for the rest of the safe serializer.
"""

from __future__ import annotations

import re
import sys
import threading
from typing import Callable, NoReturn, TypeVar

from distkit.dist.codec.policy import Refused

T = TypeVar("T")

# The opcodes CPython's pickler writes with protocol 5, by the size of their argument.
_NO_ARG = b"N\x88\x89)\x85\x86\x87(t]ae}su\x8f\x90\x9101\x94Rb\x81\x92"
_ARG = {1: b"Kh", 2: b"M", 4: b"Jj", 8: b"G\x95"}
_LEN1 = b"C\x8c\x8a"  # SHORT_BINBYTES, SHORT_BINUNICODE, LONG1: a 1-byte length
_LEN4 = b"BX\x8b"  # BINBYTES, BINUNICODE, LONG4: a 4-byte length
_LEN8 = b"\x8e\x8d\x96"  # BINBYTES8, BINUNICODE8, BYTEARRAY8: an 8-byte length
_GLOBAL, _NEXT_BUFFER, _READONLY_BUFFER, _STOP = 0x93, 0x97, 0x98, 0x2E


def _charset(ops: bytes) -> bytes:
    return b"[" + b"".join(re.escape(bytes([op])) for op in ops) + b"]"


# A run of the opcodes above, up to the next one Python reads itself (a global, a buffer,
# a 4- or 8-byte count, STOP, or one distkit never writes): opcodes with an argument, each
# followed by any number without one. At most 4096 per match, so that the engine's own
# memory stays small; possessive where Python has it (3.11+), which is about 25% faster.
_LENGTHS = b"|".join(re.escape(bytes([n])) + rb"[\s\S]{%d}" % n for n in range(256))
_WITH_ARG = b"|".join(
    [_charset(ops) + rb"[\s\S]{%d}" % size for size, ops in _ARG.items()]
    + [_charset(_LEN1) + b"(?:" + _LENGTHS + b")"]
)
_PLUS = b"+" if sys.version_info >= (3, 11) else b""
_NO_ARGS = _charset(_NO_ARG) + b"*" + _PLUS
_RUN = re.compile(_NO_ARGS + b"(?:(?:" + _WITH_ARG + b")" + _NO_ARGS + b"){0,4096}" + _PLUS)


def _bad_opcode(skeleton: bytes, at: int) -> NoReturn:
    import pickletools

    op = skeleton[at]
    names = {info.code: info.name for info in pickletools.opcodes}
    name = names.get(chr(op), f"0x{op:02x}")
    if op in _NO_ARG + b"".join(_ARG.values()) + _LEN1 + _LEN4 + _LEN8:
        raise Refused(f"the pickle ends inside its {name} opcode at byte {at}")
    raise Refused(f"the pickle has a {name} opcode (byte {at}), which distkit never writes")


def _counted(skeleton: bytes, at: int, width: int) -> int:
    """Where the opcode at ``at`` with a ``width``-byte length ends; never past the end."""
    if at + 1 + width > len(skeleton):
        _bad_opcode(skeleton, at)
    end = at + 1 + width + int.from_bytes(skeleton[at + 1 : at + 1 + width], "little")
    if end > len(skeleton):
        raise Refused(
            f"an opcode at byte {at} claims {end - at - 1 - width} bytes; the pickle holds "
            f"{len(skeleton) - at - 1 - width} more (refused before the unpickler allocates)"
        )
    return end


def scan(skeleton: bytes) -> tuple[int, int]:
    """Check that ``skeleton`` is a pickle distkit could have written.

    Returns:
        The number of globals and of out-of-band buffers it names.

    Raises:
        Refused: an opcode distkit's encoder never writes (``LONG_BINPUT``, whose memo
            index makes CPython's unpickler allocate and zero ``16 * index`` bytes, text
            opcodes, persistent ids, ...), a length beyond the end, or bytes after STOP.
    """
    if skeleton[:2] != b"\x80\x05":
        raise Refused("the object is not a protocol-5 pickle")
    end, at, globals_, buffers = len(skeleton), 2, 0, 0
    run = _RUN.match
    while at < end:
        stop = run(skeleton, at).end()  # type: ignore[union-attr]  # it matches "" at worst
        if stop > at:
            at = stop
            continue
        op = skeleton[at]
        if op == _GLOBAL:
            globals_ += 1
            at += 1
        elif op == _NEXT_BUFFER or op == _READONLY_BUFFER:
            buffers += op == _NEXT_BUFFER
            at += 1
        elif op == _STOP:
            if at != end - 1:
                raise Refused(f"{end - at - 1} bytes follow the pickle's STOP")
            return globals_, buffers
        elif op in _LEN4:
            at = _counted(skeleton, at, 4)
        elif op in _LEN8:
            at = _counted(skeleton, at, 8)
        else:
            _bad_opcode(skeleton, at)
    raise Refused("the pickle ends without its STOP opcode")


def depth_bound(skeleton: bytes, calls: bool) -> int:
    """An upper bound of how deep tuples nest in ``skeleton``, counted from its bytes.

    Each level of nesting takes an opcode that makes a tuple (TUPLE1-3, or MARK and
    TUPLE); with allowed classes (a namedtuple is a tuple) also REDUCE or NEWOBJ.
    """
    ops = b"\x85\x86\x87" + (b"R\x81\x92" if calls else b"")
    bound = len(skeleton) - len(skeleton.translate(None, ops))
    return bound + min(skeleton.count(b"t"), skeleton.count(b"("))


#: Beyond this many tuple-making opcodes, hashing a tuple could recurse deeper than a
#: thread's stack allows (CPython needs about 60 bytes of C stack per level; a default
#: thread stack holds 1 to 8 MiB): the safe serializer unpickles on a thread whose stack
#: fits the bound (:func:`on_deep_stack`).
SHALLOW = 10_000
#: Stack reserved per possible level of tuple nesting (twice what CPython needs here).
STACK_PER_LEVEL = 128
#: The deepest stack the safe serializer asks for; beyond it, the object is refused.
MAX_STACK = 2 << 30

_STACK_SIZE = threading.Lock()


def on_deep_stack(fn: Callable[[], T], bound: int) -> T:
    """``fn()`` on a new thread with a stack for tuples nested ``bound`` deep.

    Raises:
        Refused: such a stack is more than :data:`MAX_STACK`, or cannot be had.
    """
    size = -(-((8 << 20) + STACK_PER_LEVEL * bound) // 65536) * 65536  # whole 64 KiB
    if size > MAX_STACK:
        raise Refused(f"it may nest tuples {bound} deep, more than distkit checks")
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # handed to the calling thread
            outcome.append((False, exc))

    with _STACK_SIZE:
        previous = threading.stack_size(size)
        try:
            thread = threading.Thread(target=run, name="distkit-safe-decode", daemon=True)
            thread.start()
        except (RuntimeError, ValueError, MemoryError) as exc:
            raise Refused(f"it may nest tuples {bound} deep: no stack for that ({exc})") from exc
        finally:
            threading.stack_size(previous)
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
