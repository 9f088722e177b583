"""The handle returned by collectives called with ``async_op=True``."""

from __future__ import annotations

from datetime import timedelta
from threading import get_ident
from typing import Any, Callable, Generic, Optional, TypeVar, Union

T = TypeVar("T")


class Handle(Generic[T]):
    """A collective in flight; :meth:`wait` returns its result.

    Unlike torch's ``Work``, whose ``wait()`` returns ``True``, distkit's handle hands back
    what the blocking call would have returned. In a single process the handle is
    already complete.

    Examples:
        >>> import torch
        >>> import distkit.dist as dist
        >>> h = dist.all_reduce(torch.ones(2), async_op=True)
        >>> h.is_completed()
        True
        >>> h.wait()
        tensor([1., 1.])
    """

    __slots__ = ("__weakref__", "_finish", "_on_error", "_result", "_waiting", "_works")

    def __init__(self, works: list[Any], finish: Callable[[], T]) -> None:
        self._works: Optional[list[Any]] = works
        self._finish: Optional[Callable[[], T]] = finish
        self._result: Any = None
        self._on_error: Optional[Callable[[BaseException], Optional[BaseException]]] = None
        self._waiting = 0  # the thread blocked in wait() (for distkit's stuck report)

    @classmethod
    def completed(cls, result: T) -> Handle[T]:
        """A handle whose collective has already finished with ``result``."""
        handle: Handle[T] = cls([], lambda: result)
        handle._works = None
        handle._finish = None
        handle._result = result
        return handle

    def on_error(self, replace: Callable[[BaseException], Optional[BaseException]]) -> None:
        """Let ``replace`` turn an error of :meth:`wait` into a better one (or ``None``)."""
        self._on_error = replace

    def is_completed(self) -> bool:
        """Whether the communication has finished (``wait`` will not block)."""
        if self._works is None:
            return True
        return all(w.is_completed() for w in self._works)

    def wait(self, timeout: Union[float, timedelta, None] = None) -> T:
        """Block until the collective finished and return its result.

        Args:
            timeout: Seconds (or a timedelta) to wait before raising; ``None`` uses the
                process group's timeout.

        Returns:
            What the same collective returns with ``async_op=False``.
        """
        if self._works is not None:
            works, finish = self._works, self._finish
            if isinstance(timeout, (int, float)):
                timeout = timedelta(seconds=timeout)
            self._waiting = get_ident()
            try:
                for w in works:
                    if timeout is None:
                        w.wait()
                    else:
                        w.wait(timeout)
            except Exception as exc:
                better = self._on_error(exc) if self._on_error is not None else None
                if better is not None:
                    raise better from exc
                raise
            finally:
                self._waiting = 0
            self._result = finish() if finish is not None else None
            # a finished handle keeps its result only: what it held for the collective
            # (the group, through its error hook) would keep the group alive past
            # destroy_dist for as long as the caller keeps the handle
            self._works = None
            self._finish = None
            self._on_error = None
        return self._result

    def __repr__(self) -> str:
        state = "completed" if self._works is None else "pending"
        return f"<distkit Handle {state}>"
