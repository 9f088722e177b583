"""The contract every backend implements: one method per collective.

The public functions (:mod:`distkit.dist.tensor`, :mod:`distkit.dist.objects`) check
their arguments, resolve the group to a :class:`~distkit.dist.core.comm.Comm`, and call
``comm.backend.<collective>(comm, ...)``. A backend receives checked arguments only and
returns what the public function returns (or, with ``async_op=True``, a
:class:`~distkit.dist.Handle` of it), with the same aliasing in every backend: an entry
that comes from this rank is the caller's own tensor or object; everything else is new.

Backends: :mod:`distkit.dist.backends.single` (no process group: a world of one rank),
:mod:`distkit.dist.backends.tensors` (a torch.distributed process group) and
:mod:`distkit.dist.backends.traced` (the same group, while ``torch.compile`` traces).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, TypeVar, Union

import torch
from torch import Tensor

from distkit.dist.handle import Handle

if TYPE_CHECKING:
    from distkit.dist.codec.pickling import Naming
    from distkit.dist.core.args import Op
    from distkit.dist.core.comm import Comm

T = TypeVar("T")

#: On CPU backends, a tensor of at least this many bytes moves by one exact-size broadcast
#: per rank rather than in one (padded) all_gather: gloo's ring all_gather moves large
#: tensors 3-4x slower than one broadcast per rank (measured on this project's 2-core
#: machine: 32 MiB x 2 ranks, 83 ms against 22 ms), and broadcasts need no padding when
#: sizes differ. Used by uneven all_gather, the tensor backend and the object backend.
BROADCAST_BYTES = 256 * 1024
#: What a collective returns: its result, or with ``async_op=True`` a handle to it.
Result = Union[T, Handle[T]]


class Refused(Exception):
    """This rank's own argument error (its ``map_location``, its ``serializer``) on a
    group of several ranks: it takes its part in the call, sending the others its
    message (``told``) where it sends anything, then raises :attr:`error`. Raised at
    once, it would leave them waiting in the call, to pair it with this rank's next one."""

    def __init__(self, error: Exception, told: str) -> None:
        super().__init__(told)
        self.error = error


class ObjectCall(NamedTuple):
    """How an object collective reports errors and decodes what it receives."""

    fn: str  # the public name, for messages
    map_location: Optional[torch.device]
    serializer: str  # "pickle" or "safe"
    refused: Optional[Refused] = None  # this rank's bad arguments (see Refused)
    # what errors call the object gathered (all_gather_object, gather_object)
    name: Naming = "data"


class Backend(abc.ABC):
    """One method per collective; ``comm`` says which group and where this rank is."""

    # -- tensor collectives ---------------------------------------------------------

    @abc.abstractmethod
    def all_reduce(self, comm: Comm, data: Tensor, op: Op, async_op: bool) -> Result[Tensor]:
        """Reduce ``data`` in place; return it."""

    @abc.abstractmethod
    def all_gather(
        self, comm: Comm, data: Tensor, async_op: bool, same_shape: bool
    ) -> Result[list[Tensor]]:
        """Every rank's tensor, in rank order; ``data`` itself at this rank's index."""

    @abc.abstractmethod
    def gather(
        self, comm: Comm, data: Tensor, dst: int, async_op: bool, same_shape: bool
    ) -> Result[list[Tensor]]:
        """On ``dst``, every rank's tensor; ``[]`` elsewhere."""

    @abc.abstractmethod
    def broadcast(self, comm: Comm, data: Tensor, src: int, async_op: bool) -> Result[Tensor]:
        """Overwrite ``data`` with ``src``'s in place; return it."""

    @abc.abstractmethod
    def reduce(self, comm: Comm, data: Tensor, dst: int, op: Op, async_op: bool) -> Result[Tensor]:
        """On ``dst``, reduce into ``data`` in place; elsewhere leave it untouched."""

    @abc.abstractmethod
    def reduce_scatter(
        self, comm: Comm, data: Union[Tensor, list[Tensor]], op: Op, async_op: bool
    ) -> Result[Tensor]:
        """This rank's chunk of the reduction, as a new tensor."""

    @abc.abstractmethod
    def all_to_all(
        self, comm: Comm, data: list[Tensor], async_op: bool, same_shape: bool
    ) -> Result[list[Tensor]]:
        """What each rank sent here; ``data[rank]`` itself at this rank's index."""

    @abc.abstractmethod
    def all_to_all_single(
        self,
        comm: Comm,
        data: Tensor,
        output_split_sizes: Optional[list[int]],
        input_split_sizes: Optional[list[int]],
        async_op: bool,
    ) -> Result[Tensor]:
        """The rows each rank sent here, concatenated in rank order (a new tensor)."""

    @abc.abstractmethod
    def scatter(
        self,
        comm: Comm,
        data: Optional[list[Tensor]],
        src: int,
        async_op: bool,
        error: Optional[Exception] = None,
    ) -> Result[Tensor]:
        """This rank's tensor from ``src``'s list (``data[src]`` itself on ``src``).

        On ``src``, ``error`` is what its argument check raised: the backend passes it on
        to every rank (which raise it, instead of waiting for ``src`` forever).
        """

    @abc.abstractmethod
    def barrier(self, comm: Comm) -> None:
        """Return once every rank of the group arrived."""

    # -- object collectives ---------------------------------------------------------

    @abc.abstractmethod
    def all_gather_object(self, comm: Comm, data: Any, call: ObjectCall) -> list[Any]:
        """Every rank's object; ``data`` itself at this rank's index."""

    @abc.abstractmethod
    def gather_object(
        self, comm: Comm, data: Any, dst: int, call: ObjectCall
    ) -> Optional[list[Any]]:
        """On ``dst``, every rank's object; ``None`` elsewhere."""

    @abc.abstractmethod
    def broadcast_object(self, comm: Comm, obj: Any, src: int, name: str, call: ObjectCall) -> Any:
        """``src``'s object (``obj`` itself on ``src``); ``name`` names it in errors."""

    @abc.abstractmethod
    def scatter_object(
        self,
        comm: Comm,
        data: Optional[list[Any]],
        src: int,
        call: ObjectCall,
        error: Optional[Exception] = None,
    ) -> Any:
        """This rank's object from ``src``'s list (``data[src]`` itself on ``src``).

        ``error``: as in :meth:`scatter`.
        """

    @abc.abstractmethod
    def all_to_all_object(self, comm: Comm, data: list[Any], call: ObjectCall) -> list[Any]:
        """The object each rank sent here; ``data[rank]`` itself at this rank's index."""

    # -- point to point ----------------------------------------------------------------

    @abc.abstractmethod
    def send(
        self, comm: Comm, data: Any, dst: int, tag: int, async_op: bool, call: ObjectCall
    ) -> Result[None]:
        """Send ``data`` (a tensor, or any object) to ``dst``; ``None`` once it is out."""

    @abc.abstractmethod
    def recv(self, comm: Comm, src: int, tag: int, async_op: bool, call: ObjectCall) -> Result[Any]:
        """What ``src`` sent: a new tensor, or the object."""

    @abc.abstractmethod
    def exchange(
        self, comm: Comm, sends: dict[int, Any], recv_from: list[int], tag: int, call: ObjectCall
    ) -> dict[int, Any]:
        """Send ``sends[d]`` to each ``d`` and receive from each of ``recv_from``, all
        posted at once; ``{src: what it sent}`` (this rank's own entry as passed)."""
