"""The bytes ranks send each other: the layouts and the dtype codes are pinned here, so
a change to one is a decision, not an accident."""

from __future__ import annotations

import pytest
import torch

from distkit.dist.core import layouts

#: The wire code of each dtype: an append-only table (never reorder it). Ranks on two
#: builds of torch read each other's codes alike (torch 2.4 has no float4_e2m1fn_x2).
PINNED = {
    "float32": 0,
    "float64": 1,
    "float16": 2,
    "bfloat16": 3,
    "complex32": 4,
    "complex64": 5,
    "complex128": 6,
    "bool": 7,
    "uint8": 8,
    "int8": 9,
    "int16": 10,
    "int32": 11,
    "int64": 12,
    "uint16": 13,
    "uint32": 14,
    "uint64": 15,
    "float8_e4m3fn": 16,
    "float8_e4m3fnuz": 17,
    "float8_e5m2": 18,
    "float8_e5m2fnuz": 19,
    "float8_e8m0fnu": 20,
    "float4_e2m1fn_x2": 21,
    "bcomplex32": 46,
}


def test_dtype_codes_are_pinned():
    for name, code in PINNED.items():
        assert layouts.DTYPE_NAMES[code] == name
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):  # this torch has it
            assert layouts.dtype_code(dtype) == code
            assert layouts.code_dtype(code) is dtype
    assert len(set(layouts.DTYPE_NAMES)) == len(layouts.DTYPE_NAMES)


def test_every_dtype_of_this_torch_has_a_code():
    dtypes = {v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert dtypes <= set(layouts.CODES), dtypes - set(layouts.CODES)


def test_a_dtype_without_a_code_says_so():
    with pytest.raises(TypeError, match="has no wire code in this version of distkit"):
        layouts.dtype_code("not a dtype")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype code 999"):
        layouts.code_dtype(999)


def test_the_layouts_have_their_sizes():
    assert layouts.SHAPE_ROW == 3 + layouts.INLINE_DIMS == 28
    assert (layouts.SLOT_BYTES, layouts.SLOT_HEAD, layouts.SLOT.size) == (4096, 64, 40)
    assert layouts.INLINE_BYTES == 4096 - 64
    assert (layouts.MAGIC, layouts.HEADER_BYTES, layouts.BLOB.size) == (0x31544B44, 32, 16)
    assert (layouts.PLAN_HEAD.size, layouts.VERDICT_HEAD.size, layouts.VERDICT_ROW.size) == (
        48,
        32,
        24,
    )
    assert (layouts.LENGTH.size, layouts.ROUND_STATUS.size, layouts.EXCHANGE_SLOT) == (
        8,
        16,
        4096,
    )
    assert layouts.aligned([1, 2, 3]) == [1, 2, 3, 0] and layouts.ALIGN == 16


def test_shape_rows_and_row_headers_round_trip():
    t = torch.zeros(2, 3, 4, dtype=torch.int16)
    row = layouts.shape_row(t)
    assert len(row) == layouts.SHAPE_ROW
    assert layouts.parse_shape_row(row) == (torch.int16, (2, 3, 4))
    deep = torch.zeros([1] * 30)
    assert layouts.parse_shape_row(layouts.shape_row(deep), [1] * 30) == (torch.float32, (1,) * 30)
    # the row digest is the same in every process and on every Python (crc32, not hash)
    assert layouts.row_header(torch.zeros(5, 2, 3))[:3] == [0, 2, 3851708885]


def test_point_to_point_frames_are_pinned():
    assert layouts.P2P_HEAD.format == "<8q" and layouts.P2P_HEAD.size == 64
    assert (layouts.P2P_TENSOR, layouts.P2P_OBJECT, layouts.P2P_FAILED) == (0, 1, 2)
    assert (layouts.P2P_ALIGN, layouts.P2P_MIN_CAPACITY) == (64, 4096)
    assert layouts.P2P_TAG_BASE == layouts.P2P_TAGS == 1 << 30
    assert [layouts.p2p_head_bytes(n) for n in (0, 1, 8, 9, 16)] == [64, 128, 128, 192, 192]
