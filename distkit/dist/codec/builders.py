"""What a payload may build under the safe serializer: checked constructors.

Each global the safe serializer allows is a constructor whose arguments are checked
first: plain ints, strings and bytes of bounded size, never a size to allocate. The
checks run on the first of the safe serializer's two unpicklings (see
:mod:`distkit.dist.codec.safe`), where values from other globals are stand-ins
(:class:`Stub`) that know only their kind. NumPy arrays, scalars and dtypes of plain data
travel through this module's own constructors (:func:`numpy_array`, :func:`numpy_scalar`,
:func:`numpy_dtype`), which distkit's encoder names instead of NumPy's ``_reconstruct``.
"""

from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import functools
import re
from typing import Any, Callable, NoReturn

from distkit.dist.codec.policy import Refused

#: Digits of a ``Decimal``/``Fraction`` string (CPython's own limit for ``int(str)``).
MAX_DIGITS = 4300
#: ``Decimal`` exponents stay within decimal128's: ``int(Decimal('1e999999999'))`` does
#: not end.
MAX_EXPONENT = 6144
#: Dimensions of an array or a tensor (NumPy's and torch's own limit).
MAX_DIMS = 64


ANY = "any"  # what an allowed class's instances may do: whatever the class does

_DOES = {
    "BUILD": "sets the state of",
    "SETITEM": "sets an item of",
    "APPEND": "appends to",
    "ADDITEMS": "adds items to",
    "CALL": "calls",
}


class Stub:
    """What the first unpickling builds instead of an object from a global.

    ``kind`` says what the object will be (a class, or ``(module, name)`` of an allowed
    class); ``ops`` which opcodes may touch it: the plain-data ones for its kind (a
    ``deque`` is appended to, an ``OrderedDict`` gets items, a tensor nothing).
    """

    __slots__ = ("kind", "name", "ops")

    def __init__(self, kind: Any, ops: frozenset[str] = frozenset(), name: str = "") -> None:
        self.kind = kind
        self.ops = ops
        self.name = name  # the global it stands for, if it is one

    def _allow(self, op: str) -> None:
        if op not in self.ops and ANY not in self.ops:
            what = self.name or f"a {_describe(self.kind)}"
            raise Refused(f"the pickle {_DOES[op]} {what}, which plain data never does")

    def __setstate__(self, state: Any) -> None:
        self._allow("BUILD")

    def __setitem__(self, key: Any, value: Any) -> None:
        self._allow("SETITEM")

    def append(self, item: Any) -> None:
        self._allow("APPEND")

    def extend(self, items: Any) -> None:
        self._allow("APPEND")

    def add(self, item: Any) -> None:
        self._allow("ADDITEMS")

    def __call__(self, *args: Any, **kwargs: Any) -> Stub:
        self._allow("CALL")
        return Stub(self.kind, frozenset([ANY]))


class Constructor(Stub):
    """A global the safe serializer calls: ``check`` its arguments, then make a stand-in
    of kind ``makes`` that allows the opcodes ``ops``."""

    __slots__ = ("check", "makes", "makes_ops", "real")

    def __init__(
        self, name: str, real: Any, check: Callable[..., Any], makes: Any, ops: str = ""
    ) -> None:
        super().__init__("global", frozenset(), name)
        self.real, self.check, self.makes = real, check, makes
        self.makes_ops = frozenset(ops.split())

    def __call__(self, *args: Any, **kwargs: Any) -> Stub:
        self.check(*args)
        return Stub(self.makes, self.makes_ops)


def _describe(kind: Any) -> str:
    if isinstance(kind, tuple):
        return ".".join(kind)
    if isinstance(kind, str):
        return kind
    return f"{kind.__module__}.{kind.__qualname__}".replace("builtins.", "")


def _kind(value: Any) -> Any:
    return value.kind if type(value) is Stub else type(value)


class ClassMeta(type):
    """The metaclass of an allowed class's stand-in: it cannot be changed."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise Refused(f"the pickle sets the attribute {name!r} of the class {cls.__name__}")


_CLASS_STUBS: dict[tuple[str, str], type] = {}


def class_stub(key: tuple[str, str]) -> type:
    """A stand-in for an allowed class: a type (``NEWOBJ`` needs one) making stand-ins."""
    if key not in _CLASS_STUBS:

        def __new__(cls: type, *args: Any, **kwargs: Any) -> Stub:
            return Stub(key, frozenset([ANY]))

        _CLASS_STUBS[key] = ClassMeta(".".join(key), (), {"__new__": __new__, "__slots__": ()})
    return _CLASS_STUBS[key]


# -- argument checks (on the first unpickling: literals are real, the rest stand-ins) ----


def _fail(what: str) -> NoReturn:
    raise Refused(what)


def _nargs(name: str, args: tuple, low: int, high: int) -> None:
    if not low <= len(args) <= high:
        _fail(f"{name} takes {low} to {high} arguments here, got {len(args)}")


def _int(name: str, value: Any, bits: int = 64) -> int:
    if type(value) is not int or value.bit_length() >= bits:
        _fail(f"{name} takes integers of at most {bits} bits here, got {_describe(_kind(value))}")
    return value


def _check_range(*args: Any) -> None:
    _nargs("range", args, 1, 3)
    for a in args:
        _int("range", a)


def _check_slice(*args: Any) -> None:
    _nargs("slice", args, 1, 3)
    for a in args:
        if a is not None:
            _int("slice", a)


def _check_complex(*args: Any) -> None:
    _nargs("complex", args, 1, 2)
    if any(type(a) not in (int, float) or (type(a) is int and a.bit_length() > 64) for a in args):
        _fail("complex takes two floats here")


def _check_state(name: str, size: int, state: Any, *tz: Any) -> None:
    if type(state) is not bytes or len(state) != size:
        _fail(f"{name} takes its {size}-byte state here")
    if tz and tz[0] is not None and not _is_tzinfo(tz[0]):
        _fail(f"{name} takes a timezone here, got {_describe(_kind(tz[0]))}")


def _is_tzinfo(value: Any) -> bool:
    kind = _kind(value)
    return kind is datetime.timezone or isinstance(kind, tuple)  # or an allowed class


def _check_date(*args: Any) -> None:
    _nargs("date", args, 1, 1)
    _check_state("date", 4, *args)


def _check_time(*args: Any) -> None:
    _nargs("time", args, 1, 2)
    _check_state("time", 6, *args)


def _check_datetime(*args: Any) -> None:
    _nargs("datetime", args, 1, 2)
    _check_state("datetime", 10, *args)


def _check_timedelta(*args: Any) -> None:
    _nargs("timedelta", args, 0, 3)
    for a in args:
        _int("timedelta", a)


def _check_timezone(*args: Any) -> None:
    _nargs("timezone", args, 1, 2)
    if _kind(args[0]) is not datetime.timedelta:
        _fail("timezone takes a timedelta here")
    if len(args) == 2 and (type(args[1]) is not str or len(args[1]) > 256):
        _fail("timezone takes a name of at most 256 characters here")


_DECIMAL = re.compile(
    r"[+-]?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,6})?|inf(?:inity)?|s?nan\d*)", re.I
)


def _check_decimal(*args: Any) -> None:
    _nargs("Decimal", args, 1, 1)
    text = args[0]
    if type(text) is not str or len(text) > MAX_DIGITS + 16 or not _DECIMAL.fullmatch(text):
        _fail(f"Decimal takes a number of at most {MAX_DIGITS} digits here")
    value = decimal.Decimal(text)
    if value.is_finite() and not -MAX_EXPONENT <= value.adjusted() <= MAX_EXPONENT:
        _fail(f"Decimal exponents stay within ±{MAX_EXPONENT} here, got {value.adjusted()}")


_FRACTION = re.compile(r"[+-]?\d+(?:\.\d+)?(?:/\d+)?")


def _check_fraction(*args: Any) -> None:
    _nargs("Fraction", args, 1, 2)
    if len(args) == 1 and type(args[0]) is str:
        if len(args[0]) > 2 * MAX_DIGITS or not _FRACTION.fullmatch(args[0]):
            _fail(f"Fraction takes 'n/d' of at most {MAX_DIGITS} digits each here")
        return
    for a in args:
        _int("Fraction", a, bits=int(MAX_DIGITS * 3.33))


def _check_no_args(name: str) -> Callable[..., None]:
    def check(*args: Any) -> None:
        _nargs(name, args, 0, 0)

    return check


def _check_defaultdict(*args: Any) -> None:
    _nargs("defaultdict", args, 0, 1)
    if args and args[0] is not None and not _is_class(args[0]):
        _fail("defaultdict takes a class as its default factory here")


def _is_class(value: Any) -> bool:
    """A global that is a class (a builtin type, a constructor, an allowed class)."""
    if type(value) is Stub:
        return value.kind is type
    if type(value) is Constructor:
        return isinstance(value.real, type)
    return type(value) is ClassMeta


def _check_counter(*args: Any) -> None:
    _nargs("Counter", args, 0, 1)
    if args and type(args[0]) is not dict:
        _fail("Counter takes a dict here")


def _check_deque(*args: Any) -> None:
    _nargs("deque", args, 0, 2)
    if args and type(args[0]) not in (list, tuple):
        _fail("deque takes a list here")
    if len(args) == 2 and args[1] is not None and _int("deque", args[1]) < 0:
        _fail("deque takes a maxlen of 0 or more")


def _check_size(*args: Any) -> None:
    _nargs("torch.Size", args, 1, 1)
    if type(args[0]) not in (tuple, list):
        _fail("torch.Size takes a tuple of integers here")
    for d in args[0]:
        _int("torch.Size", d)


def _check_device(*args: Any) -> None:
    import torch

    _nargs("torch.device", args, 1, 2)
    if type(args[0]) is not str or not device_type(args[0].partition(":")[0]):
        _fail("torch.device takes the name of a device type here")
    if len(args) == 2 and args[1] is not None:
        _int("torch.device", args[1], bits=31)
    torch.device(*args)  # what the second unpickling will call: refuse what it refuses


_DEVICE_TYPE = re.compile(r"[a-z][a-z0-9_]{0,31}")


def device_type(name: Any) -> bool:
    """Whether ``name`` is a device type torch knows (parsed, nothing looked up)."""
    return type(name) is str and _DEVICE_TYPE.fullmatch(name) is not None and _device(name)


@functools.lru_cache(maxsize=64)
def _device(name: str) -> bool:
    import torch

    try:
        return torch.device(name).type == name
    except (RuntimeError, ValueError):
        return False


# -- NumPy: distkit's own constructors ---------------------------------------------------

#: Fixed-size dtypes of plain data: bool, int, uint, float, complex, datetime64,
#: timedelta64, bytes, unicode. Never object, void or structured ones.
NUMPY_KINDS = "biufcmMSU"
_NUMPY_DTYPE = re.compile(r"[<>|=][biufcmMSU]\d{1,10}(?:\[\d{0,6}[a-zA-Z]{1,2}\])?")


def numpy_dtype(name: str) -> Any:
    """``numpy.dtype(name)`` for the dtypes of :data:`NUMPY_KINDS` only (a wire global)."""
    if type(name) is str:
        dtype = _DTYPES.get(name)
        if dtype is not None:
            return dtype
    if type(name) is not str or not _NUMPY_DTYPE.fullmatch(name):
        _fail(f"NumPy dtypes of plain data only ({NUMPY_KINDS}), got {name!r}")
    dtype = _numpy_dtype(name)
    if len(_DTYPES) < 256:  # a sender cannot grow the cache without bound
        _DTYPES[name] = dtype
    return dtype


#: The dtypes :func:`numpy_dtype` checked, by name.
_DTYPES: dict[str, Any] = {}


def _numpy_dtype(name: str) -> Any:
    import numpy as np

    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError) as exc:
        _fail(f"{name!r} is not a NumPy dtype ({exc})")
    if (
        dtype.kind not in NUMPY_KINDS
        or dtype.fields is not None
        or dtype.subdtype is not None
        or dtype.hasobject
        or dtype.itemsize == 0
    ):
        _fail(f"NumPy dtypes of plain data only ({NUMPY_KINDS}), got {name!r}")
    return dtype


def _plain_bytes(value: Any, nbytes: int, what: str) -> memoryview:
    if type(value) not in (bytes, bytearray, memoryview):
        _fail(f"{what} takes bytes, got {_describe(_kind(value))}")
    view = memoryview(value)
    if view.nbytes != nbytes:
        _fail(f"{what} needs {nbytes} bytes, got {view.nbytes}")
    return view


def _bools(view: memoryview, dtype: Any, what: str) -> None:
    """Refuse bytes that are no value of ``dtype``: bools other than 0 and 1, and
    unicode code points beyond U+10FFFF (NumPy raises ``SystemError`` reading them)."""
    kind = dtype.kind
    if kind == "b" and bytes(view).translate(None, b"\x00\x01"):
        _fail(f"{what} of bools holds a byte that is neither 0 nor 1")
    if kind == "U" and view.nbytes:
        import numpy as np

        units = np.frombuffer(view, dtype=dtype.byteorder.replace("|", "=") + "u4")
        if int(units.max()) > 0x10FFFF:
            _fail(f"{what} of unicode holds a code point beyond U+10FFFF")


def _array_args(dtype: Any, shape: Any, order: Any, buffer: Any) -> tuple[Any, memoryview]:
    dt = numpy_dtype(dtype)
    nbytes = dt.itemsize
    if type(shape) is not tuple or len(shape) > MAX_DIMS:
        _fail(f"a NumPy shape is a tuple of at most {MAX_DIMS} sizes, got {shape!r}")
    for d in shape:
        if type(d) is not int or d < 0:
            _fail(f"a NumPy shape is a tuple of at most {MAX_DIMS} sizes, got {shape!r}")
        nbytes *= d
    if order != "C" and order != "F":  # a literal, or a stand-in (equal to nothing)
        _fail(f"a NumPy array's order is 'C' or 'F', got {order!r}")
    view = _plain_bytes(buffer, nbytes, "a NumPy array")
    _bools(view, dt, "a NumPy array")
    return dt, view


def numpy_array(dtype: str, shape: tuple, order: str, buffer: Any) -> Any:
    """An array of ``buffer``'s bytes, without a copy (a wire global; see the encoder)."""
    _array_args(dtype, shape, order, buffer)
    return _build_array(dtype, shape, order, buffer)


def numpy_scalar(dtype: str, data: bytes) -> Any:
    """A NumPy scalar of ``data``'s bytes (a wire global; see the encoder)."""
    _check_numpy_scalar(dtype, data)
    return _build_scalar(dtype, data)


def _build_array(dtype: str, shape: tuple, order: str, buffer: Any) -> Any:
    """:func:`numpy_array` for arguments already checked (the second unpickling)."""
    import numpy as np

    dt = _DTYPES.get(dtype) or numpy_dtype(dtype)
    return np.ndarray(shape, dt, buffer, order=order)  # type: ignore[arg-type]


_SCALAR: list = []


def _build_scalar(dtype: str, data: bytes) -> Any:
    """:func:`numpy_scalar` for arguments already checked (the second unpickling):
    NumPy's own scalar constructor, given a plain dtype and exactly its bytes."""
    if not _SCALAR:
        try:
            from numpy._core.multiarray import scalar  # type: ignore[attr-defined, unused-ignore]
        except ImportError:  # NumPy 1.x
            from numpy.core.multiarray import scalar  # type: ignore[no-redef]
        _SCALAR.append(scalar)
    return _SCALAR[0](_DTYPES.get(dtype) or numpy_dtype(dtype), data)


def tensor_attributes(tensor: Any, attrs: dict) -> None:
    """Give a received tensor its own attributes (a wire global, the state setter of a
    tensor that had attributes: see the encoder)."""
    tensor.__dict__.update(attrs)


#: The builders of the wire globals above, for payloads that were checked or are trusted.
BUILDERS = {
    "numpy_array": _build_array,
    "numpy_scalar": _build_scalar,
    "tensor_attributes": tensor_attributes,
}


def _check_tensor_attributes(*args: Any) -> None:
    """New names only: an attribute that hides one of the class's (``t.inner = 5``
    hides ``torch.Tensor.inner``) would change what the tensor does."""
    import torch

    _nargs("tensor_attributes", args, 2, 2)
    if _kind(args[0]) != "torch.Tensor":
        _fail(f"tensor_attributes gives a tensor attributes, got {_describe(_kind(args[0]))}")
    if type(args[1]) is not dict:
        _fail(f"a tensor's attributes are a dict, got {_describe(_kind(args[1]))}")
    for name in args[1]:
        if type(name) is not str or not name.isidentifier():
            _fail(f"a tensor attribute is named by an identifier, got {name!r}")
        for cls in (torch.Tensor, torch.nn.Parameter):
            if hasattr(cls, name):
                _fail(
                    f"a tensor attribute named {name!r}, which would hide {_describe(cls)}.{name}"
                )


def _check_numpy_array(*args: Any) -> None:
    _nargs("numpy_array", args, 4, 4)
    _array_args(*args)


def _check_numpy_scalar(*args: Any) -> None:
    _nargs("numpy_scalar", args, 2, 2)
    dt = numpy_dtype(args[0])
    if type(args[1]) is not bytes:
        _fail(f"a NumPy scalar takes bytes, got {_describe(_kind(args[1]))}")
    _bools(_plain_bytes(args[1], dt.itemsize, "a NumPy scalar"), dt, "a NumPy scalar")


def _check_numpy_dtype(*args: Any) -> None:
    _nargs("numpy_dtype", args, 1, 1)
    numpy_dtype(args[0])


# -- the globals, by name -----------------------------------------------------------------

TYPE_VALUES = frozenset(
    "bool bytearray bytes dict float frozenset int list set str tuple".split()
)  # builtins a payload may name (a defaultdict's factory), never call

#: What each allowed global is on each unpickling: a check and a kind, and the real object.
CONSTRUCTORS: dict[tuple[str, str], tuple[Any, Callable[..., None], Any, str]] = {
    ("builtins", "range"): (range, _check_range, range, ""),
    ("builtins", "slice"): (slice, _check_slice, slice, ""),
    ("builtins", "complex"): (complex, _check_complex, complex, ""),
    ("datetime", "date"): (datetime.date, _check_date, datetime.date, ""),
    ("datetime", "time"): (datetime.time, _check_time, datetime.time, ""),
    ("datetime", "datetime"): (datetime.datetime, _check_datetime, datetime.datetime, ""),
    ("datetime", "timedelta"): (datetime.timedelta, _check_timedelta, datetime.timedelta, ""),
    ("datetime", "timezone"): (datetime.timezone, _check_timezone, datetime.timezone, ""),
    ("decimal", "Decimal"): (decimal.Decimal, _check_decimal, decimal.Decimal, ""),
    ("fractions", "Fraction"): (fractions.Fraction, _check_fraction, fractions.Fraction, ""),
    ("collections", "OrderedDict"): (
        collections.OrderedDict,
        _check_no_args("OrderedDict"),
        collections.OrderedDict,
        "SETITEM",
    ),
    ("collections", "defaultdict"): (
        collections.defaultdict,
        _check_defaultdict,
        collections.defaultdict,
        "SETITEM",
    ),
    ("collections", "Counter"): (
        collections.Counter,
        _check_counter,
        collections.Counter,
        "SETITEM",
    ),
    ("collections", "deque"): (collections.deque, _check_deque, collections.deque, "APPEND"),
    # checked on the first unpickling: the second builds without checking again
    ("distkit.dist.codec.builders", "numpy_array"): (
        _build_array,
        _check_numpy_array,
        "ndarray",
        "",
    ),
    ("distkit.dist.codec.builders", "numpy_scalar"): (
        _build_scalar,
        _check_numpy_scalar,
        "scalar",
        "",
    ),
    ("distkit.dist.codec.builders", "numpy_dtype"): (numpy_dtype, _check_numpy_dtype, "dtype", ""),
    ("distkit.dist.codec.builders", "tensor_attributes"): (
        tensor_attributes,
        _check_tensor_attributes,
        "None",
        "",
    ),
}


def _torch_constructors() -> None:
    import torch

    CONSTRUCTORS[("torch", "Size")] = (torch.Size, _check_size, torch.Size, "")
    CONSTRUCTORS[("torch", "device")] = (torch.device, _check_device, torch.device, "")


_torch_constructors()
