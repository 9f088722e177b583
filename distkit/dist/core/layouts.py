"""Every binary layout that travels between ranks, declared once, and the dtype codes.

Ranks read each other's bytes: these layouts are the protocol. They are declared here
(and pinned by ``tests/test_layouts.py``) so that no module invents one of its own, and so
that a change to one shows in one place. Integers are little-endian int64 (``<q``) unless
noted; the uneven frames use the machine's own order, since they never leave the job's
machines (mixed-endian clusters do not run torch.distributed).

The **dtype codes** are an explicit, append-only table: a tensor's dtype travels as its
index in :data:`DTYPE_NAMES`, the same on every torch release, so ranks on two builds of
torch (one knows ``float4_e2m1fn_x2``, the other does not) still read each other's codes
alike. Names this torch lacks keep their code; a dtype this table lacks (one from a
torch newer than this distkit) cannot travel in a header, and says so.
"""

from __future__ import annotations

import struct
import zlib
from typing import Optional

import torch

# -- dtype codes ----------------------------------------------------------------------

#: The code of a dtype is its index here. Append new dtypes at the end; never reorder.
DTYPE_NAMES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "complex32",
    "complex64",
    "complex128",
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "qint8",
    "quint8",
    "qint32",
    "quint4x2",
    "quint2x4",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bits16",
    *(f"uint{n}" for n in range(1, 8)),
    *(f"int{n}" for n in range(1, 8)),
    "bcomplex32",  # torch 2.14
)
#: This torch's dtypes by code, and codes by dtype (names it lacks are left out).
DTYPES: dict[int, torch.dtype] = {
    code: getattr(torch, name)
    for code, name in enumerate(DTYPE_NAMES)
    if isinstance(getattr(torch, name, None), torch.dtype)
}
CODES: dict[torch.dtype, int] = {dtype: code for code, dtype in DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of ``dtype``.

    Raises:
        TypeError: ``dtype`` has no code (a dtype of a torch newer than this distkit).
    """
    code = CODES.get(dtype)
    if code is None:
        raise TypeError(
            f"{dtype} has no wire code in this version of distkit (a dtype of a newer "
            "torch): send it as its bytes (t.view(torch.uint8)), or upgrade distkit"
        )
    return code


def code_dtype(code: int) -> torch.dtype:
    """The dtype of wire code ``code`` (which another rank sent)."""
    found = DTYPES.get(code)
    if found is None:
        raise TypeError(f"another rank sent dtype code {code}, which this torch does not have")
    return found


# -- tensor collectives: shape rows (int64 tensors) ---------------------------------------

#: A shape row: ``dtype code, ndim, long flag, dims[INLINE_DIMS]``. A tensor with more
#: dims sets the flag, and its whole shape follows in a second, exact-size round.
INLINE_DIMS = 25
SHAPE_ROW = 3 + INLINE_DIMS
#: In a shape row's place, ``FAILED_ROW, message length, error type`` says that the
#: sender (``src`` of a scatter) failed; the message follows as bytes.
FAILED_ROW = -1


def shape_row(t: torch.Tensor, long: bool = False) -> list[int]:
    """A shape row for ``t``; ``long`` flags that the sender has some over-long shape."""
    dims = list(t.shape[:INLINE_DIMS]) if t.dim() <= INLINE_DIMS else []
    return [dtype_code(t.dtype), t.dim(), int(long), *dims, *([0] * (INLINE_DIMS - len(dims)))]


def parse_shape_row(
    row: list[int], full: Optional[list[int]] = None
) -> tuple[torch.dtype, tuple[int, ...]]:
    """``(dtype, shape)`` of a shape row; ``full``: the shape sent in the second round."""
    ndim = row[1]
    if ndim > INLINE_DIMS and full is not None:
        return code_dtype(row[0]), tuple(full[:ndim])
    return code_dtype(row[0]), tuple(row[3 : 3 + ndim])


#: An ``all_to_all_single`` row (output sizes inferred): ``rows sent, dtype code, ndim of
#: a row, digest of the row shape, dims[ROW_DIMS]`` (the digest catches a difference
#: beyond the first ROW_DIMS dims).
ROW_DIMS = 4


def row_header(t: torch.Tensor) -> list[int]:
    """The part of an ``all_to_all_single`` row that is the same for every peer."""
    row_shape = tuple(t.shape[1:])
    dims = list(row_shape[:ROW_DIMS])
    # crc32 of the dims' bytes: the same in every process and on every Python
    digest = zlib.crc32(struct.pack(f"<{len(row_shape)}q", *row_shape))
    return [dtype_code(t.dtype), len(row_shape), digest, *dims, *[0] * (ROW_DIMS - len(dims))]


# -- uneven collectives: frames ------------------------------------------------------------

#: Frames (a header row in front of each peer's data) are padded to this many bytes, so
#: the data behind stays aligned for every dtype.
ALIGN = 16


def aligned(row: list[int]) -> list[int]:
    """``row`` padded with zeros to a whole number of :data:`ALIGN` bytes of int64s."""
    return row + [0] * (-len(row) % (ALIGN // 8))


def frame_format(width: int) -> str:
    """The struct format of a frame's header row of ``width`` int64s (``bytes sent,
    overflow flag, the caller's row...``, aligned), in this machine's byte order."""
    return f"={width}q"


# -- object collectives: first-round slots ------------------------------------------------

#: Bytes per rank in an object collective's first round: a header, then the inline CPU
#: part of an object that fits.
SLOT_BYTES = 4096
#: The slot header (int64 status, CPU bytes, device bytes, 2 flags), padded to 64 bytes
SLOT = struct.Struct("<5q")
SLOT_HEAD = 64
INLINE_BYTES = SLOT_BYTES - SLOT_HEAD
#: Slot status: the object fits, it overflows, or the sender failed (FAILED plus the
#: index of its error's type in :data:`distkit.dist.core.args.REMOTE_ERRORS`).
INLINE, OVERFLOW, FAILED = 0, 1, 2

# -- the object codec: one encoded object --------------------------------------------------

#: ``MAGIC, skeleton length, number of blobs, bytes of the device part``, then per blob
#: ``byte length, place`` (:data:`BLOB`), then the skeleton and the CPU blobs.
MAGIC = 0x31544B44  # "DKT1"
WIRE_HEADER = struct.Struct("<4q")
HEADER_BYTES = WIRE_HEADER.size
BLOB = struct.Struct("<2q")

# -- iter_results: plans and verdicts -------------------------------------------------------

#: Bytes per rank of the gather of plans (the rest of a larger plan follows point to point)
PLAN_SLOT_BYTES = 4096
#: A plan's head: ``count, flags, sizes, indices, failure bytes, data bytes``
PLAN_HEAD = struct.Struct("<6q")
PLAN_INDICES, PLAN_INLINE = 1, 2  # flags
#: A verdict: ``failed, stream id, tag, failure bytes``, then per rank
#: :data:`VERDICT_ROW` ``kind, positions, ordered``
VERDICT_HEAD = struct.Struct("<4q")
VERDICT_ROW = struct.Struct("<3q")
#: A length in front of a variable part
LENGTH = struct.Struct("<q")

# -- collect_results: the status of a round ---------------------------------------------------

#: ``rounds, message bytes``, then the message
ROUND_STATUS = struct.Struct("<2q")

# -- debug mode: the exchange of signatures -----------------------------------------------------

#: Bytes per rank of the first round of debug mode's exchange: :data:`LENGTH`, then JSON
EXCHANGE_SLOT = 4096

# -- point to point: frames ---------------------------------------------------------------

#: Every point-to-point message starts with a *frame*: this head (``kind, head bytes, frame
#: bytes, number, apart, code, ndim, 0``), then a tensor's dims (int64 each), zeros up to
#: a multiple of :data:`P2P_ALIGN` bytes, then the inline body (a tensor's bytes, an
#: encoded object's CPU part, a failure's message). ``frame bytes`` counts the head and
#: the inline body; ``number`` counts the messages of its channel (sender, receiver, tag)
#: from 1; ``apart`` is how many messages of exact size follow the frame (a large
#: tensor's bytes; an object's large tensors, then its device part); ``code`` is a
#: tensor's dtype code (:data:`DTYPE_NAMES`), or a failure's error code; ``ndim`` is a
#: tensor's number of dims, or a failure's message bytes.
P2P_HEAD = struct.Struct("<8q")
#: Heads are padded to this many bytes, so the body behind stays aligned for every dtype.
P2P_ALIGN = 64
#: What a frame carries: a tensor, an encoded object, or a failure of the sender.
P2P_TENSOR, P2P_OBJECT, P2P_FAILED = 0, 1, 2
#: The bytes of a frame a receiver takes in its first message when the channel has no
#: history (a longer frame sends the rest in a second message of exact size).
P2P_MIN_CAPACITY = 4096
#: Tags on the wire are the caller's tag plus this: they never meet the tags of the
#: messages distkit's collectives send point to point (0, and iter_results' own).
P2P_TAG_BASE = 1 << 30
#: The caller's tags are below this (gloo's tags are non-negative int32s).
P2P_TAGS = 1 << 30


def p2p_head_bytes(ndim: int) -> int:
    """The bytes of a frame's head with ``ndim`` dims (a multiple of :data:`P2P_ALIGN`)."""
    n = P2P_HEAD.size + 8 * ndim
    return (n + P2P_ALIGN - 1) // P2P_ALIGN * P2P_ALIGN
