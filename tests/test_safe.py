"""The safe serializer against payloads crafted by a hostile rank.

Every payload here is a valid distkit wire payload (built with distkit's own encoder, or a
hand-written pickle skeleton in the encoder's framing). The dangerous ones (memory
corruption, memory bombs) are decoded in a subprocess by :mod:`helpers_safe`, so a
segfault or an out-of-memory kill fails a test instead of killing pytest.
"""

from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import pickle
import struct
from typing import Optional

import numpy as np
import pytest
import torch
from conftest import ROOT
from helpers_safe import (
    BUILD,
    CASES,
    EMPTY_DICT,
    MARK,
    NONE,
    PROTO,
    SETITEM,
    STOP,
    TUPLE,
    Reduce,
    _reconstruct,
    call,
    encoded,
    fragment,
    frame,
    numpy_object_pointer,
    probe,
    tensor_ref,
)
from helpers_subprocess import run

import distkit.dist as dist
from distkit.dist.codec import safe as _safe
from distkit.dist.codec import wire as _wire
from distkit.testing import ranks

try:
    from numpy._core import multiarray, numeric
except ImportError:  # NumPy 1.x
    from numpy.core import multiarray, numeric  # type: ignore[no-redef]

#: How much a refused payload may make the decoding process's peak memory grow.
PEAK_MIB = 64


def safe(enc: _wire.Encoded, **kwargs) -> object:
    return _wire.decode(enc, serializer_name="safe", sender=1, fn="test", **kwargs)


def refused(enc: _wire.Encoded, match: Optional[str] = None, **kwargs) -> dist.UnsafeObjectError:
    with pytest.raises(dist.UnsafeObjectError, match=match) as info:
        safe(enc, **kwargs)
    assert info.value.rank == 1
    return info.value


# -- memory corruption and memory bombs, each decoded in a forked child ------------------


@pytest.fixture(scope="module")
def probed():
    return probe("safe", list(CASES))


@pytest.mark.parametrize("case", list(CASES))
def test_crafted_payload_is_refused_within_bounded_memory(probed, case):
    report = probed[case]
    # a tuple nested a million deep is plain data: decoded, on a stack that fits it
    assert report["outcome"] == ("decoded" if case == "deep_tuple_key" else "refused"), report
    proportional = _safe.EXPANSION * report["payload_bytes"] / 2**20
    assert report["peak_growth_mib"] < max(PEAK_MIB, proportional), report
    assert report["counter_intact"], f"{case} changed collections.Counter: {report}"


def test_the_numpy_pointer_payload_is_a_real_attack_under_pickle():
    # the control: plain pickle turns the payload's 8 raw bytes into os.system
    report = probe("pickle", ["numpy_object_pointer"])["numpy_object_pointer"]
    assert report["outcome"] == "decoded" and "system" in report["value"], report


# -- NumPy: only distkit's own constructors, only plain numeric data ---------------------


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(Reduce(_reconstruct, (np.ndarray, (1_000_000,), b"b")), id="_reconstruct"),
        pytest.param(Reduce(np.dtype, ("O", False, True)), id="object-dtype"),
        pytest.param(
            Reduce(np.dtype, ("f8", False, True), (3, "<", None, None, None, -1, -1, 0)),
            id="dtype-state",
        ),
        pytest.param(
            Reduce(numeric._frombuffer, (b"", np.dtype("f8"), (4,), "C")), id="frombuffer"
        ),
        pytest.param(Reduce(multiarray.scalar, (np.dtype("f8"), b"\0" * 8)), id="scalar"),
        pytest.param(np.zeros(3, dtype=[("a", "f4"), ("b", "i4")]), id="structured-array"),
        pytest.param(np.array([None, 1], dtype=object), id="object-array"),
        pytest.param(np.zeros(2, dtype="V4"), id="void-array"),
        pytest.param(np.dtype([("a", "f4")]), id="structured-dtype"),
    ],
)
def test_numpy_globals_and_non_numeric_arrays_are_refused(payload):
    error = refused(encoded(payload), match="numpy")
    assert error.global_name.startswith("numpy")


def test_numpy_arrays_scalars_and_dtypes_of_plain_data_still_decode():
    arrays = {
        "f8": np.arange(600, dtype=np.float64),  # out of band, no copy
        "small": np.arange(5, dtype=np.int16),  # in band
        "fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
        "strided": np.arange(20)[::3],
        "big-endian": np.arange(4, dtype=">i4"),
        "bool": np.array([True, False, True]),
        "complex": np.array([1 + 2j], dtype=np.complex64),
        "half": np.ones(3, dtype=np.float16),
        "datetime": np.array(["2026-11-22", "NaT"], dtype="datetime64[D]"),
        "timedelta": np.array([5, -3], dtype="timedelta64[ms]"),
        "unicode": np.array(["ab", "cde"]),
        "bytes": np.array([b"x", b"yz"]),
        "empty": np.zeros((0, 3), dtype=np.uint8),
        "scalar-0d": np.array(7.5),
        "readonly": np.arange(300, dtype=np.int64),
    }
    arrays["readonly"].flags.writeable = False
    scalars = [np.float32(1.5), np.int64(-3), np.bool_(True), np.complex128(1j)]
    scalars += [np.datetime64("2026-01-02"), np.str_("hé"), np.bytes_(b"ab"), np.uint8(255)]
    dtypes = [np.dtype("f4"), np.dtype(">i8"), np.dtype("U3"), np.dtype("M8[ns]")]
    obj = {"arrays": arrays, "scalars": scalars, "dtypes": dtypes}
    for serializer in ("pickle", "safe"):
        got = _wire.decode(encoded(obj), serializer_name=serializer)
        for name, want in arrays.items():
            array = got["arrays"][name]
            assert type(array) is np.ndarray and array.dtype == want.dtype, name
            assert array.shape == want.shape and array.tobytes() == want.tobytes(), name
            assert array.flags.f_contiguous == want.flags.f_contiguous or want.ndim < 2, name
        assert not got["arrays"]["fortran"].flags.c_contiguous
        assert [type(s) for s in got["scalars"]] == [type(s) for s in scalars]
        assert got["scalars"] == scalars and got["dtypes"] == dtypes


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("O", (1,), "C", b"\0" * 8), id="object"),
        pytest.param(("V8", (1,), "C", b"\0" * 8), id="void"),
        pytest.param(("f8,i4", (1,), "C", b"\0" * 12), id="structured"),
        pytest.param(("<f8", (1000,), "C", b"\0" * 8), id="claims-more-than-sent"),
        pytest.param(("<f8", (-1,), "C", b"\0" * 8), id="negative-shape"),
        pytest.param(("<f8", (1,), "K", b"\0" * 8), id="order"),
        pytest.param(("<f8", [1], "C", b"\0" * 8), id="shape-not-a-tuple"),
        pytest.param(("|b1", (2,), "C", b"\x00\x02"), id="bool-not-0-or-1"),
        pytest.param(("<U1000000000", (1,), "C", b"\0" * 8), id="huge-itemsize"),
        pytest.param(("<f8", (1,), "C", "12345678"), id="buffer-is-a-str"),
        pytest.param(("<U1", (1,), "C", b"\xff\xff\xff\xff"), id="unicode-beyond-range"),
    ],
)
def test_numpy_array_constructor_checks_its_arguments(args):
    from distkit.dist.codec import builders

    refused(encoded(Reduce(builders.numpy_array, args)))


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("O", b"\0" * 8), id="object"),
        pytest.param(("<f8", b"\0" * 4), id="too-few-bytes"),
        pytest.param(("<f8", bytearray(8)), id="not-bytes"),
        pytest.param(("|b1", b"\x05"), id="bool-not-0-or-1"),
        pytest.param((">U1", b"\x00\x11\x00\x00"), id="unicode-beyond-range"),
    ],
)
def test_numpy_scalar_constructor_checks_its_arguments(args):
    from distkit.dist.codec import builders

    refused(encoded(Reduce(builders.numpy_scalar, args)))


# -- allocation: no constructor takes a size from the sender ----------------------------


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(Reduce(int, ("9" * 100_000,)), id="int-from-digits"),
        pytest.param(Reduce(decimal.Decimal, ("1e999999999",)), id="decimal-exponent"),
        pytest.param(Reduce(fractions.Fraction, ("1e1000000",)), id="fraction-exponent"),
        pytest.param(Reduce(fractions.Fraction, (1 << 100_000, 3)), id="fraction-huge-int"),
        pytest.param(Reduce(collections.Counter, ("a" * 1000,)), id="counter-of-a-string"),
        pytest.param(Reduce(collections.deque, ([], -1)), id="deque-negative-maxlen"),
        pytest.param(Reduce(str, (b"x", "utf-8")), id="str-call"),
        pytest.param(Reduce(dict, ([("a", 1)],)), id="dict-call"),
        pytest.param(Reduce(torch.Size, ([1.5],)), id="size-of-floats"),
        pytest.param(Reduce(torch.device, ("_dynamo",)), id="device-type"),
        pytest.param(Reduce(slice, ([1] * 10,)), id="slice-of-a-list"),
    ],
)
def test_constructors_take_only_plain_bounded_arguments(payload):
    refused(encoded(payload))


def test_claimed_lengths_beyond_the_payload_are_refused_before_reading():
    for opcode in (b"\x8e", b"\x96", b"\x8d"):  # BINBYTES8, BYTEARRAY8, BINUNICODE8
        refused(frame(PROTO + opcode + struct.pack("<Q", 2_000_000_000) + STOP))
    refused(frame(PROTO + b"B" + struct.pack("<I", 4_000_000_000) + STOP))  # BINBYTES


def test_max_bytes_bounds_what_a_payload_may_allocate():
    payload = encoded([{"a": i} for i in range(1000)])
    assert len(safe(payload)) == 1000
    refused(payload, match="max_bytes|allocate", max_bytes=payload.cpu.numel())


# -- BUILD and friends on what the safe serializer builds -------------------------------


def test_state_cannot_be_set_on_built_objects():
    mutated_fraction = Reduce(fractions.Fraction, (1, 2), (None, {"_numerator": [1, 2]}))
    refused(encoded(mutated_fraction))
    with_attribute = Reduce(collections.OrderedDict, (), {"keys": None})
    refused(encoded(with_attribute))
    tensor_state = PROTO + tensor_ref(0, "float32", (2,)) + fragment((True,)) + BUILD + STOP
    refused(frame(tensor_state, (bytes(8),)))


# -- tensor references ------------------------------------------------------------------


def refs(*metas: tuple, blobs: tuple[bytes, ...] = (bytes(8), bytes(8))) -> _wire.Encoded:
    """A payload of tensor references with the given arguments (two 8-byte CPU blobs)."""
    body = b"".join(call("distkit.dist.codec.wire", "_tensor_ref", *meta) for meta in metas[:1])
    if len(metas) > 1:  # one fragment per skeleton: pickle's memo indices start at 0
        body = MARK + b"".join(tensor_ref(*meta) for meta in metas) + TUPLE
    return frame(PROTO + body + STOP, blobs)


GOOD_REF = (0, "float32", (2,), False, False, "cpu")


@pytest.mark.parametrize(
    "meta",
    [
        pytest.param((5, "float32", (2,), False, False, "cpu"), id="index-out-of-range"),
        pytest.param((-1, "float32", (2,), False, False, "cpu"), id="negative-index"),
        pytest.param(("0", "float32", (2,), False, False, "cpu"), id="index-is-a-str"),
        pytest.param((True, "float32", (2,), False, False, "cpu"), id="index-is-a-bool"),
        pytest.param((0, "Tensor", (2,), False, False, "cpu"), id="dtype-Tensor"),
        pytest.param((0, "__class__", (2,), False, False, "cpu"), id="dtype-__class__"),
        pytest.param((0, "qint8", (8,), False, False, "cpu"), id="dtype-quantized"),
        pytest.param((0, 7, (2,), False, False, "cpu"), id="dtype-not-a-str"),
        pytest.param((0, "float32", (3,), False, False, "cpu"), id="shape-too-big"),
        pytest.param((0, "float32", (1,), False, False, "cpu"), id="shape-too-small"),
        pytest.param((0, "float32", (-1,), False, False, "cpu"), id="shape-inferred"),
        pytest.param((0, "float32", (-2, -1), False, False, "cpu"), id="negative-shape"),
        pytest.param((0, "float32", (1 << 62, 0), False, False, "cpu"), id="huge-zero-shape"),
        pytest.param((0, "float32", [2], False, False, "cpu"), id="shape-not-a-tuple"),
        pytest.param((0, "float32", (2.0,), False, False, "cpu"), id="shape-of-floats"),
        pytest.param((0, "int64", (1,), True, False, "cpu"), id="grad-on-integers"),
        pytest.param((0, "float32", (2,), 1, False, "cpu"), id="grad-not-a-bool"),
        pytest.param((0, "float32", (2,), False, False, "_dynamo"), id="device-type"),
        pytest.param((0, "float32", (2,), False, False, 3), id="device-not-a-str"),
        pytest.param((0, "float32", (2,), False, False), id="too-few-arguments"),
    ],
)
def test_crafted_tensor_references_are_refused(meta):
    assert safe(refs(GOOD_REF)).tolist() == [0.0, 0.0]  # the frame itself is fine
    refused(refs(meta))


def test_a_blob_is_handed_out_once():
    once = (0, "float32", (2,))
    refused(refs(once, once), match="twice|once")


def test_a_tensor_reference_never_hands_out_uninitialised_memory():
    refused(frame(PROTO + tensor_ref(0, "float32", (1000,)) + STOP, (b"",)))


def test_pickle_serializer_names_a_bad_tensor_reference():
    with pytest.raises(pickle.UnpicklingError, match="tensor"):
        _wire.decode(refs((5, "float32", (2,), False, False, "cpu")))


# -- refusing a global imports nothing ---------------------------------------------------

IMPORTS = """
import sys
import torch
from helpers_safe import PROTO, STOP, frame, glob, tensor_ref
from distkit.dist import UnsafeObjectError
from distkit.dist.codec import wire as _wire

payloads = [
    frame(PROTO + glob("torch", "_dynamo") + STOP),
    frame(PROTO + glob("torch._dynamo", "config") + STOP),
    frame(PROTO + tensor_ref(0, "_dynamo", (2,)) + STOP, (bytes(8),)),
    frame(PROTO + tensor_ref(0, "float32", (2,), "onnx") + STOP, (bytes(8),)),
]
warm_up = frame(PROTO + tensor_ref(0, "float32", (2,)) + STOP, (bytes(8),))
_wire.decode(warm_up, serializer_name="safe")
before = set(sys.modules)
for enc in payloads:
    try:
        _wire.decode(enc, serializer_name="safe")
        print("decoded")
    except UnsafeObjectError:
        print("refused")
print("new modules:", sorted(set(sys.modules) - before)[:5], len(set(sys.modules) - before))
"""


def test_refusing_a_global_imports_nothing():
    out = run(["-c", IMPORTS], PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}").stdout
    assert out.splitlines()[:4] == ["refused"] * 4, out
    assert out.splitlines()[4].endswith(" 0"), out


# -- malformed payloads: clear errors with either serializer ------------------------------


def _header(*fields: int) -> bytes:
    return struct.pack(f"<{len(fields)}q", *fields)


def _framed(raw: bytes) -> _wire.Encoded:
    cpu = torch.tensor(list(raw), dtype=torch.uint8)
    return _wire.Encoded(cpu, None)


SKELETON = PROTO + NONE + STOP
MAGIC = _wire.MAGIC
MALFORMED = {
    "empty": b"",
    "truncated-header": _header(MAGIC, 4)[:12],
    "wrong-magic": _header(0x12345678, 4, 0, 0) + SKELETON,
    "skeleton-too-long": _header(MAGIC, 1 << 40, 0, 0) + SKELETON,
    "negative-skeleton": _header(MAGIC, -5, 0, 0) + SKELETON,
    "too-many-blobs": _header(MAGIC, 4, 1 << 40, 0) + SKELETON,
    "negative-blobs": _header(MAGIC, 4, -2, 0) + SKELETON,
    "blob-beyond-end": _header(MAGIC, 4, 1, 0, 1 << 30, 0) + SKELETON + bytes(100),
    "negative-blob": _header(MAGIC, 4, 1, 0, -64, 0) + SKELETON + bytes(100),
    "unknown-place": _header(MAGIC, 4, 1, 0, 8, 9) + SKELETON + bytes(100),
    "device-blob-without-device-part": _header(MAGIC, 4, 1, 8, 8, 1) + SKELETON,
    "truncated-skeleton": _header(MAGIC, 4, 0, 0) + SKELETON[:2],
    "not-a-pickle": _header(MAGIC, 3, 0, 0) + b"abc",
    "no-stop": _header(MAGIC, 3, 0, 0) + SKELETON[:3],
}


@pytest.mark.parametrize("serializer", ["pickle", "safe"])
@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_payloads_raise_a_clear_error(serializer, case):
    with pytest.raises(pickle.UnpicklingError) as info:
        _wire.decode(_framed(MALFORMED[case]), serializer_name=serializer, sender=2, fn="f")
    if serializer == "safe":
        assert isinstance(info.value, dist.UnsafeObjectError)
    assert "rank 2" in str(info.value), str(info.value)


# -- what must keep working ---------------------------------------------------------------

Pair = collections.namedtuple("Pair", "left right")


def test_plain_values_round_trip():
    value = {
        "factory": collections.defaultdict(list, {"a": [1]}),
        "types": [int, float, str, bytes, list, dict, tuple, set, frozenset, bool, complex],
        "ordered": collections.OrderedDict(b=2, a=(1, 2)),
        "counter": collections.Counter("hello"),
        "deque": collections.deque([1, 2, 3], maxlen=5),
        "when": datetime.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=datetime.timezone.utc),
        "dates": (datetime.date(2020, 2, 29), datetime.time(23, 59), datetime.timedelta(-1, 5)),
        "zone": datetime.timezone(datetime.timedelta(hours=-3), "X"),
        "money": [decimal.Decimal("-1.25e-7"), decimal.Decimal("1E+6144"), decimal.Decimal("-Inf")],
        "ratio": fractions.Fraction(-355, 113),
        "numbers": (complex(1, -2), range(3, 10, 2), slice(1, None, -1), 1 << 200, -(1 << 70)),
        "torch": (torch.Size([2, 3]), torch.device("cpu"), torch.device("cuda", 1), torch.int8),
        "bytes": (b"x" * 5000, bytearray(b"y" * 10), "z" * 300, "é"),
        "nested": [[[(1,)]], {"k": {1, 2}, "f": frozenset({3})}],
        "empty": ((), [], {}, set(), frozenset(), "", b""),
    }
    for serializer in ("pickle", "safe"):
        got = _wire.decode(encoded(value), serializer_name=serializer)
        assert got == value
        assert got["factory"].default_factory is list and got["types"] == value["types"]
        assert got["deque"].maxlen == 5 and type(got["counter"]) is collections.Counter


def test_allowed_classes_are_built_from_checked_plain_data(settings):
    dist.set_serializer("safe", allow=[Pair])
    value = [Pair(torch.ones(2), Pair(1, [2])), {Pair(1, 2): "key"}]
    got = _wire.decode(encoded(value), serializer_name="safe")
    assert type(got[0]) is Pair and torch.equal(got[0].left, torch.ones(2))
    assert got[0].right == Pair(1, [2]) and got[1] == {Pair(1, 2): "key"}


def test_tensors_of_every_plain_dtype_round_trip():
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64]
    dtypes += [torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64]
    dtypes += [torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
    value = [torch.zeros(3, 2, dtype=dt) for dt in dtypes]
    value += [torch.empty(0, 5), torch.tensor(2.5), torch.nn.Parameter(torch.ones(2))]
    value += [torch.ones(2, requires_grad=True), torch.arange(6).view(2, 3).t()]
    got = _wire.decode(encoded(value), serializer_name="safe")
    for want, have in zip(value, got):
        assert type(have) is type(want) and have.dtype == want.dtype
        assert have.shape == want.shape and have.requires_grad == want.requires_grad
        assert bytes(have.detach().contiguous().view(-1).view(torch.uint8).tolist()) == bytes(
            want.detach().contiguous().view(-1).view(torch.uint8).tolist()
        )


def test_a_bool_tensor_holds_only_zero_or_one():
    refused(frame(PROTO + tensor_ref(0, "bool", (2,)) + STOP, (b"\x00\x07",)))


@pytest.mark.parametrize("serializer", ["pickle", "safe"])
def test_a_device_part_of_only_empty_tensors_decodes(serializer):
    # with no byte in the device part, the encoder sends no device tensor at all
    enc = _wire.encode({"e": torch.empty(0, 3)}, "data", "f", None, torch.device("cpu"))
    assert enc.dev is None
    got = _wire.decode(enc, serializer_name=serializer)
    assert got["e"].shape == (0, 3)


def test_deep_but_legitimate_nesting_decodes():
    nested: object = 0
    for _ in range(100):
        nested = {"k": [(nested,)]}
    assert _wire.decode(encoded(nested), serializer_name="safe") == nested


def test_many_tuples_decode():
    value = [(i, i / 7, (i,)) for i in range(30_000)]
    assert _wire.decode(encoded(value), serializer_name="safe") == value


def test_tuples_nested_beyond_the_stack_cap_are_refused(monkeypatch):
    from distkit.dist.codec import opcodes as _opcodes

    monkeypatch.setattr(_opcodes, "MAX_STACK", 16 << 20)  # room for about 60k levels
    skeleton = PROTO + EMPTY_DICT + b")" + b"\x85" * 100_000 + NONE + SETITEM + STOP
    refused(frame(skeleton), match="nest tuples")


# -- through the collectives: max_bytes, and hostile payloads from another rank ----------


def test_max_bytes_setting_is_read_by_the_decoder_and_checked(settings):
    payload = encoded([{"a": i} for i in range(1000)])
    dist.set_serializer("safe", max_bytes=payload.cpu.numel())
    refused(payload, match="max_bytes")
    dist.set_serializer("safe", max_bytes=1 << 30)
    assert len(safe(payload)) == 1000
    for bad in (0, -1, 1.5, "1"):
        with pytest.raises(ValueError, match="max_bytes"):
            dist.set_serializer("safe", max_bytes=bad)


@ranks(2, timeout=120)
def test_hostile_payloads_from_another_rank_are_refused_on_the_receiver():
    rank = dist.get_rank()
    hostile = [
        Reduce(bytearray, (2_000_000_000,)),
        Reduce(bytes, (2_000_000_000,)),
        Reduce(list, (range(200_000_000),)),
        numpy_object_pointer(id(print)),
    ]
    dist.set_serializer("safe")
    for payload in hostile:
        if rank == 0:
            with pytest.raises(dist.UnsafeObjectError, match="rank 1") as info:
                dist.broadcast_object(None, src=1)
            assert info.value.rank == 1
        else:
            assert dist.broadcast_object(payload, src=1) is payload  # the sender's own
    # plain data still travels, and max_bytes bounds what a receiver takes
    rows = [{"loss": i * 0.5, "step": i} for i in range(2000)]
    assert dist.broadcast_object(rows if rank == 1 else None, src=1) == rows
    dist.set_serializer("safe", max_bytes=10_000)
    if rank == 0:
        with pytest.raises(dist.UnsafeObjectError, match="max_bytes"):
            dist.broadcast_object(None, src=1)
    else:
        assert dist.broadcast_object(rows, src=1) is rows
