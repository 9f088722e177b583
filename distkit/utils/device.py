"""Which device a backend communicates on, and moving nested data there and back."""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Union

import torch
from torch import Tensor

from distkit import _registry
from distkit._compat import ProcessGroup, accelerator_current_index, backend_config
from distkit.utils.groups import get_group

#: Device type each communication backend moves tensors on.
BACKEND_DEVICES = {
    "nccl": "cuda",
    "gloo": "cpu",
    "mpi": "cpu",
    "ucc": "cpu",
    "fake": "cpu",
    "hccl": "npu",
    "cncl": "mlu",
    "mccl": "musa",
    "xccl": "xpu",
    "smddp": "cuda",
}


def device_of_type(device_type: str, pg: Any = None) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    bound = getattr(pg, "bound_device_id", None) if pg is not None else None
    if bound is not None and bound.type == device_type:
        return bound
    return torch.device(device_type, accelerator_current_index(device_type))


def backend_device_types(config: str) -> list[str]:
    """Device types a backend config serves, the default one first.

    ``config`` is a backend name (``nccl``) or torch's device map (``cpu:gloo,cuda:nccl``).
    The default is the device of an accelerator backend when the map has one (``cuda``
    for ``cpu:gloo,cuda:nccl``), else the CPU: torch reports a plain gloo group as
    ``cpu:gloo,cuda:gloo``, and gloo's home is the CPU.
    """
    if ":" not in config:
        return [BACKEND_DEVICES.get(config, "cpu")]
    pairs = [part.split(":", 1) for part in config.split(",")]
    native = [
        dev.strip()
        for dev, be in pairs
        if dev.strip() != "cpu" and BACKEND_DEVICES.get(be.strip()) == dev.strip()
    ]
    rest = [dev.strip() for dev, _ in pairs if dev.strip() not in native]
    return native + sorted(rest, key=lambda d: d != "cpu")


def get_comm_device(group: Any = None, data: Any = None) -> torch.device:
    """Return the device that ``group``'s backend communicates on.

    nccl gives the current CUDA device (the group's bound device if it has one), gloo and
    mpi give ``cpu``, hccl ``npu``, cncl ``mlu``, mccl ``musa``, xccl ``xpu``. A mixed group
    such as ``cpu:gloo,cuda:nccl`` serves several device types: it prefers the device of
    ``data`` when it can move it, else its accelerator.

    Single process: returns ``cpu`` (there is no backend to serve).

    Args:
        group: ``None`` (default group), a ``ProcessGroup``, or a list of global ranks.
        data: Optional tensor or nested tensors about to be communicated.

    Returns:
        The device to stage tensors on before communicating.

    Raises:
        ValueError: ``group`` is a list of ranks this rank is not one of (it has no
            device there), or a bad list (as :func:`get_group` says).

    Examples:
        >>> from distkit.utils import get_comm_device
        >>> get_comm_device()
        device(type='cpu')
    """
    world = _registry.current._default_pg
    if group is None:
        pg = world
    elif isinstance(group, ProcessGroup):
        pg = group
    else:
        pg = get_group(group)  # checks the rank list, in a single process too
        if pg is not None and not isinstance(pg, ProcessGroup):  # torch's non-member marker
            raise ValueError(
                f"get_comm_device: this rank (global rank {world.rank()}) is not a member of "
                f"group {sorted(group)}, so it has no device to communicate on there. Ask "
                "on the group's members only (get_group must still be called on every rank)"
            )
    if pg is None:
        return torch.device("cpu")
    types = backend_device_types(backend_config(pg).lower())
    if data is not None and len(types) > 1:
        data_type = _first_device(data)
        if data_type is not None and data_type.type in types:
            return device_of_type(data_type.type, pg)
    return device_of_type(types[0], pg)


def _first_device(data: Any) -> Optional[torch.device]:
    if isinstance(data, Tensor):
        return data.device
    if isinstance(data, Mapping):
        data = data.values()
    elif not isinstance(data, (list, tuple)):
        return None
    for item in data:
        found = _first_device(item)
        if found is not None:
            return found
    return None


# The errors of get_data_device and cast_data_device start with mmengine.dist's own words
# (code and tests written for mmengine match them), then say where and what to do.


def _collect_devices(data: Any, found: set, path: str) -> None:
    """Add the device of every tensor in ``data``; raise on anything but tensors."""
    if isinstance(data, Tensor):
        found.add(data.device)
        return
    if isinstance(data, Mapping):
        items: Iterable[tuple[str, Any]] = ((f"{path}[{k!r}]", v) for k, v in data.items())
    elif isinstance(data, Iterable) and not isinstance(data, (str, bytes)):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(data))
    else:
        raise TypeError(
            f"data should be a Tensor, sequence of tensor or dict, but {path} is "
            f"{type(data).__name__} {data!r:.60} (get_data_device: data may hold only "
            "tensors, in lists, tuples, sets, dicts or other iterables)"
        )
    empty = True
    for where, item in items:
        empty = False
        _collect_devices(item, found, where)
    if empty:
        raise ValueError(
            f"data should not be empty, but {path} is an empty {type(data).__name__} "
            "(get_data_device: every container in data must hold a tensor)"
        )


def get_data_device(data: Any) -> torch.device:
    """Return the device of the tensors in ``data`` (a tensor or nested containers).

    As in ``mmengine.dist``, ``data`` must be made of tensors only: a tensor, or
    mappings and other iterables (lists, tuples, sets, generators) of them, to any depth.

    Args:
        data: A tensor, or nested containers holding only tensors.

    Returns:
        The one device every tensor in ``data`` is on.

    Raises:
        TypeError: ``data`` holds something other than tensors and containers (a string,
            a number, None), or is one.
        ValueError: ``data`` or a container in it is empty, or tensors are on different
            devices.

    Examples:
        >>> import torch
        >>> from distkit.utils import get_data_device
        >>> get_data_device({"a": torch.zeros(1), "b": [torch.ones(2)]})
        device(type='cpu')
    """
    found: set = set()
    _collect_devices(data, found, "data")
    if len(found) > 1:
        names = ", ".join(sorted(str(d) for d in found))
        raise ValueError(
            f"device type in data should be consistent, but data holds tensors on "
            f"different devices ({names}) (get_data_device: move them to one device first)"
        )
    return found.pop()


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def cast_data_device(data: Any, device: Union[torch.device, str], out: Any = None) -> Any:
    """Return ``data`` with every tensor moved to ``device``, container types preserved.

    Tensors already on ``device`` are returned as they are (not copied). Lists, tuples,
    namedtuples, sets and mappings (``dict``, ``OrderedDict``, ``defaultdict`` with its
    factory, other mapping types) are rebuilt with their own type; non-tensor leaves
    pass through unchanged. ``data`` itself is never modified.

    Args:
        data: A tensor, or a non-empty list, tuple, set or mapping holding tensors,
            nested to any depth (values other than tensors inside it pass through).
        device: Where the tensors should go.
        out: Optional structure like ``data`` whose tensors are overwritten in place with
            the moved values (the way ``mmengine.dist.cast_data_device`` fills ``out``).

    Returns:
        A structure like ``data`` whose tensors live on ``device``.

    Raises:
        TypeError: ``data`` is neither a tensor nor a container (a list, tuple, set or
            mapping), or ``out`` does not have the type of ``data``, or is a set.
        ValueError: ``data`` is an empty container, or ``out`` has other keys or another
            length than ``data``.

    Examples:
        >>> import torch
        >>> from collections import namedtuple
        >>> from distkit.utils import cast_data_device
        >>> Pair = namedtuple("Pair", "x y")
        >>> cast_data_device(Pair(torch.ones(1), "meta"), "cpu")
        Pair(x=tensor([1.]), y='meta')
    """
    device = torch.device(device)
    if not isinstance(data, (Tensor, Mapping, list, tuple, set, frozenset)):
        raise TypeError(
            f"data should be a Tensor, list of tensor or dict, but got {type(data).__name__} "
            f"{data!r:.60} (cast_data_device: pass a tensor or a list, tuple, set or mapping "
            "of them; inside a container, values other than tensors pass through)"
        )
    if not isinstance(data, Tensor) and len(data) == 0:
        raise ValueError(
            f"data should not be empty, but got an empty {type(data).__name__} "
            "(cast_data_device: there is no tensor to move)"
        )
    return _cast(data, device, out)


def _cast(data: Any, device: torch.device, out: Any) -> Any:
    """``data`` with its tensors on ``device``; ``out``, if given, filled in place."""
    if out is not None and type(out) is not type(data):
        raise TypeError(
            f"out should be the same type with data, but got data is {type(data).__name__} "
            f"and out is {type(out).__name__} (cast_data_device: out must have the "
            "structure of data)"
        )
    if isinstance(data, Tensor):
        moved = data if data.device == device else data.to(device)
        if out is not None:
            out.copy_(moved)
        return moved
    if isinstance(data, Mapping):
        if out is not None and set(out.keys()) != set(data.keys()):
            lacks = sorted(map(repr, set(data) - set(out)))
            extra = sorted(map(repr, set(out) - set(data)))
            words = (
                f"length of data and out should be same, but got {len(data)} and {len(out)}"
                if len(out) != len(data)
                else "out should have the keys of data"
            )
            detail = [f"out lacks {', '.join(lacks)}"] if lacks else []
            detail += [f"data has no {', '.join(extra)}"] if extra else []
            raise ValueError(f"{words} (cast_data_device: {'; '.join(detail)})")
        values = {k: _cast(v, device, None if out is None else out[k]) for k, v in data.items()}
        return _rebuild_mapping(data, values)
    if isinstance(data, (list, tuple)):
        if out is not None and len(out) != len(data):
            raise ValueError(
                f"length of data and out should be same, but got {len(data)} and {len(out)} "
                "(cast_data_device: out must have an item for each item of data)"
            )
        items = [_cast(v, device, None if out is None else out[i]) for i, v in enumerate(data)]
        if _is_namedtuple(data):
            return type(data)(*items)
        if type(data) in (list, tuple):
            return type(data)(items)
        return _rebuild_sequence(data, items)
    if isinstance(data, (set, frozenset)):
        if out is not None:  # a set has no places to fill: nothing pairs its items
            raise TypeError(
                "out should not be a set (cast_data_device: a set's items have no order, so "
                "none of them pairs with an item of data; leave out=None)"
            )
        return type(data)(_cast(v, device, None) for v in data)
    return data


def _rebuild_mapping(data: Mapping, items: dict) -> Mapping:
    if type(data) is dict:
        return items
    if isinstance(data, defaultdict):
        return type(data)(data.default_factory, items)
    try:
        rebuilt = copy.copy(data)
        rebuilt.clear()  # type: ignore[attr-defined]
        rebuilt.update(items)  # type: ignore[attr-defined]
        return rebuilt
    except (AttributeError, TypeError):
        return type(data)(items)  # type: ignore[call-arg]


def _rebuild_sequence(data: Any, items: list) -> Any:
    try:
        return type(data)(items)
    except TypeError:
        return items if isinstance(data, list) else tuple(items)
