"""The backend for a world of one rank: no process group, no communication.

Arguments reach these functions already checked; each returns exactly what the torch
backend returns on a group of one rank, with the same aliasing: an entry that comes from
this rank is the caller's own tensor or object, a reduction result is new.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from torch import Tensor

from distkit.dist import _serial
from distkit.dist._checks import Op
from distkit.dist._handle import Handle


def _done(result: Any, async_op: bool) -> Any:
    return Handle.completed(result) if async_op else result


def all_reduce(comm: Any, data: Tensor, op: Op, async_op: bool) -> Any:
    return _done(data, async_op)


def all_gather(comm: Any, data: Tensor, async_op: bool, same_shape: bool) -> Any:
    return _done([data], async_op)


def gather(comm: Any, data: Tensor, dst: int, async_op: bool, same_shape: bool) -> Any:
    return _done([data], async_op)


def broadcast(comm: Any, data: Tensor, src: int, async_op: bool) -> Any:
    return _done(data, async_op)


def reduce(comm: Any, data: Tensor, dst: int, op: Op, async_op: bool) -> Any:
    return _done(data, async_op)


def reduce_scatter(comm: Any, data: Union[Tensor, list], op: Op, async_op: bool) -> Any:
    chunk = data[0] if isinstance(data, list) else data
    return _done(chunk.clone(), async_op)


def all_to_all(comm: Any, data: list, async_op: bool, same_shape: bool) -> Any:
    return _done(list(data), async_op)


def all_to_all_single(
    comm: Any,
    data: Tensor,
    output_split_sizes: Optional[list],
    input_split_sizes: Optional[list],
    async_op: bool,
) -> Any:
    return _done(data.clone(), async_op)


def scatter(comm: Any, data: Optional[list], src: int, async_op: bool) -> Any:
    return _done(data[0], async_op)  # type: ignore[index]


def barrier(comm: Any) -> None:
    return None


# Object collectives: every object handed in must be picklable in every world, so
# a world of one rank runs the same check the torch backend's encoder runs.


def all_gather_object(comm: Any, data: Any, fn: str, map_location: Any, serializer: str) -> list:
    _serial.check(data, "data", fn, comm)
    return [data]


def gather_object(
    comm: Any, data: Any, dst: int, fn: str, map_location: Any, serializer: str
) -> list:
    _serial.check(data, "data", fn, comm)
    return [data]


def broadcast_object(
    comm: Any, obj: Any, src: int, fn: str, name: str, map_location: Any, serializer: str
) -> Any:
    _serial.check(obj, name, fn, comm)
    return obj


def scatter_object(
    comm: Any, data: Optional[list], src: int, fn: str, map_location: Any, serializer: str
) -> Any:
    _serial.check(data, "data", fn, comm)
    return data[0]  # type: ignore[index]


def all_to_all_object(
    comm: Any, data: list, fn: str, map_location: Any, serializer: str
) -> list:
    _serial.check(data, "data", fn, comm)
    return list(data)
