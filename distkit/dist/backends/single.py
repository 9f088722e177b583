"""The backend for a world of one rank: no process group, no communication.

Each method returns exactly what :mod:`distkit.dist.backends.tensors` returns on a group of one
rank, with the same aliasing: an entry that comes from this rank is the caller's own
tensor or object; a reduction that makes a new tensor makes a copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, TypeVar, Union

from torch import Tensor

from distkit.dist.backends.base import Backend, ObjectCall, Result
from distkit.dist.codec import pickling as _pickling
from distkit.dist.core.args import fail
from distkit.dist.handle import Handle

if TYPE_CHECKING:
    from distkit.dist.core.args import Op
    from distkit.dist.core.comm import Comm

T = TypeVar("T")


def _done(result: T, async_op: bool) -> Result[T]:
    return Handle.completed(result) if async_op else result


class SingleBackend(Backend):
    def all_reduce(self, comm: Comm, data: Tensor, op: Op, async_op: bool) -> Result[Tensor]:
        return _done(data, async_op)

    def all_gather(
        self, comm: Comm, data: Tensor, async_op: bool, same_shape: bool
    ) -> Result[list[Tensor]]:
        return _done([data], async_op)

    def gather(
        self, comm: Comm, data: Tensor, dst: int, async_op: bool, same_shape: bool
    ) -> Result[list[Tensor]]:
        return _done([data], async_op)

    def broadcast(self, comm: Comm, data: Tensor, src: int, async_op: bool) -> Result[Tensor]:
        return _done(data, async_op)

    def reduce(self, comm: Comm, data: Tensor, dst: int, op: Op, async_op: bool) -> Result[Tensor]:
        return _done(data, async_op)

    def reduce_scatter(
        self, comm: Comm, data: Union[Tensor, list[Tensor]], op: Op, async_op: bool
    ) -> Result[Tensor]:
        chunk = data[0] if isinstance(data, list) else data
        return _done(chunk.detach().clone(), async_op)

    def all_to_all(
        self, comm: Comm, data: list[Tensor], async_op: bool, same_shape: bool
    ) -> Result[list[Tensor]]:
        return _done(list(data), async_op)

    def all_to_all_single(
        self,
        comm: Comm,
        data: Tensor,
        output_split_sizes: Optional[list[int]],
        input_split_sizes: Optional[list[int]],
        async_op: bool,
    ) -> Result[Tensor]:
        return _done(data.detach().clone(), async_op)

    def scatter(
        self,
        comm: Comm,
        data: Optional[list[Tensor]],
        src: int,
        async_op: bool,
        error: Optional[Exception] = None,
    ) -> Result[Tensor]:
        if error is not None:
            raise error
        assert data is not None  # checked on src, and a world of one rank is all src
        return _done(data[0], async_op)

    def barrier(self, comm: Comm) -> None:
        return None

    # Every object handed in must be picklable in every world, so a world of one rank
    # runs the same check the torch backend's encoder runs.

    def all_gather_object(self, comm: Comm, data: Any, call: ObjectCall) -> list[Any]:
        _pickling.check(data, call.name, call.fn, comm)
        return [data]

    def gather_object(
        self, comm: Comm, data: Any, dst: int, call: ObjectCall
    ) -> Optional[list[Any]]:
        _pickling.check(data, call.name, call.fn, comm)
        return [data]

    def broadcast_object(self, comm: Comm, obj: Any, src: int, name: str, call: ObjectCall) -> Any:
        _pickling.check(obj, name, call.fn, comm)
        return obj

    def scatter_object(
        self,
        comm: Comm,
        data: Optional[list[Any]],
        src: int,
        call: ObjectCall,
        error: Optional[Exception] = None,
    ) -> Any:
        if error is not None:
            raise error
        _pickling.check(data, "data", call.fn, comm)
        assert data is not None
        return data[0]

    def all_to_all_object(self, comm: Comm, data: list[Any], call: ObjectCall) -> list[Any]:
        _pickling.check(data, "data", call.fn, comm)
        return list(data)

    # Point to point: the public functions refuse every peer in a world of one rank (one
    # out of range, or this rank itself), so send and recv never get here.

    def send(
        self, comm: Comm, data: Any, dst: int, tag: int, async_op: bool, call: ObjectCall
    ) -> Result[None]:
        fail(ValueError, call.fn, comm, "a world of one rank has no other rank to send to")

    def recv(self, comm: Comm, src: int, tag: int, async_op: bool, call: ObjectCall) -> Result[Any]:
        fail(ValueError, call.fn, comm, "a world of one rank has no other rank to receive from")

    def exchange(
        self, comm: Comm, sends: dict[int, Any], recv_from: list[int], tag: int, call: ObjectCall
    ) -> dict[int, Any]:
        return {src: sends[src] for src in recv_from}  # this rank's own entry, as passed


SINGLE = SingleBackend()
