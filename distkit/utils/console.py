"""Rank-aware output with rich: progress on the main process only."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, Optional, TypeVar

T = TypeVar("T")

__all__ = ["track"]


def _is_main() -> bool:
    from distkit.dist.world import get_rank

    return get_rank() == 0


def track(
    iterable: Iterable[T],
    description: str = "working",
    total: Optional[float] = None,
    *,
    delay: float = 0.0,
    main_only: bool = True,
    file: Any = None,
) -> Iterator[T]:
    """Iterate over ``iterable`` with a rich progress bar on the main process.

    The other ranks iterate silently (``main_only=True``), so a loop run by 8 ranks shows
    one bar. When the output is not a terminal (a log file, CI), no bar is drawn; one plain
    line is written at the end instead, if the loop took longer than ``delay``.

    Args:
        iterable: What to iterate over.
        description: Text in front of the bar.
        total: Number of items, when ``len(iterable)`` does not work.
        delay: Seconds to wait before showing anything, so fast loops stay quiet.
        main_only: Show progress on global rank 0 only.
        file: Where to draw (default: ``sys.stderr``).

    Yields:
        The items of ``iterable``.

    Examples:
        >>> import distkit
        >>> sum(distkit.track(range(4), "adding"))
        6
    """
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    if main_only and not _is_main():
        yield from iterable
        return
    out = file if file is not None else sys.stderr
    start = time.monotonic()
    if not getattr(out, "isatty", lambda: False)():
        count = 0
        for count, item in enumerate(iterable, 1):  # noqa: B007  (count is used after)
            yield item
        elapsed = time.monotonic() - start
        if elapsed >= delay and delay > 0:
            print(f"{description}: {count} done in {elapsed:.1f} s", file=out)
        return

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    progress: Optional[Progress] = None
    task = None
    done = 0
    try:
        for item in iterable:
            yield item
            done += 1
            if progress is None and time.monotonic() - start >= delay:
                progress = Progress(
                    "[progress.description]{task.description}",
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    console=Console(file=out),
                    transient=False,
                )
                progress.start()
                task = progress.add_task(description, total=total, completed=done)
            elif progress is not None:
                progress.update(task, completed=done)  # type: ignore[arg-type]
    finally:
        if progress is not None:
            progress.update(task, completed=done)  # type: ignore[arg-type]
            progress.stop()
