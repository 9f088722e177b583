"""Rank-aware output with rich: print, logging and progress that know their rank.

With several ranks writing to one terminal, lines interleave and nobody knows who said
what. :func:`print` writes on the main process only by default, or on chosen ranks with
a coloured ``[rank r/n]`` tag on every line; :class:`RankHandler` does the same for
``logging``; :func:`track` shows one progress bar, on the main process. When the output
is not a terminal (a log file, CI) they write plain text: no colours, no bars.

Torch-free at import, like ``distkit.dist.world``: these work before torch is loaded.
The rank comes from :mod:`distkit._registry`, as everywhere in distkit.
"""

from __future__ import annotations

import builtins
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, Optional, TypeVar, Union

from distkit import _registry

T = TypeVar("T")
Ranks = Union[int, str, Iterable[int], None]

#: Colours cycled over ranks in terminal output.
PALETTE = ("cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta")


def _rank_and_size() -> tuple[int, int]:
    pg = _registry.current._default_pg
    return (0, 1) if pg is None else (pg.rank(), pg.size())


def _is_main() -> bool:
    return _rank_and_size()[0] == 0


def _selected(ranks: Ranks, rank: int) -> bool:
    if ranks is None or ranks == "all":
        return True
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        return rank == ranks
    if isinstance(ranks, (str, bool)):
        raise ValueError(f"ranks must be an int, a list of ints or 'all', got {ranks!r}")
    return rank in set(ranks)


def _tagged(ranks: Ranks) -> bool:
    """Whether output selected by ``ranks`` may come from several ranks (so needs a tag)."""
    return not (isinstance(ranks, int) and not isinstance(ranks, bool))


def _is_terminal(stream: Any) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def _tag_lines(text: str, rank: int, size: int, color: bool) -> str:
    tag = f"[rank {rank}/{size}]"
    if color:
        tag = f"\x1b[{_ANSI[PALETTE[rank % len(PALETTE)]]}m{tag}\x1b[0m"
    return "\n".join(f"{tag} {line}" for line in text.split("\n"))


_ANSI = {
    "cyan": "36",
    "magenta": "35",
    "green": "32",
    "yellow": "33",
    "blue": "34",
    "red": "31",
    "bright_cyan": "96",
    "bright_magenta": "95",
}


def print(
    *objects: Any,
    ranks: Ranks = 0,
    sep: str = " ",
    end: str = "\n",
    file: Any = None,
    flush: bool = True,
) -> None:
    """Print like the builtin, on the chosen ranks only.

    Single process: prints (rank 0 of 1), with the tag when ``ranks`` is not one rank.

    Args:
        *objects: What to print, as the builtin ``print`` does.
        ranks: ``0`` (default: the main process), another rank, a list of ranks, or
            ``"all"``. When more than one rank may print, every line starts with a
            ``[rank r/n]`` tag, coloured per rank on a terminal.
        sep: Separator between objects.
        end: Written after the last object.
        file: Stream to write to (default ``sys.stdout``).
        flush: Flush after writing (each call is written in one piece, so lines from
            different ranks do not cut into each other).

    Examples:
        >>> import distkit
        >>> distkit.print("loss", 0.25)
        loss 0.25
        >>> distkit.print("hello", ranks="all")
        [rank 0/1] hello
    """
    rank, size = _rank_and_size()
    if not _selected(ranks, rank):
        return
    stream = file if file is not None else sys.stdout
    text = sep.join(str(o) for o in objects)
    if _tagged(ranks):
        text = _tag_lines(text, rank, size, _is_terminal(stream))
    stream.write(text + end)
    if flush:
        stream.flush()


class RankHandler(logging.Handler):
    """A logging handler that writes on the chosen ranks, tagging lines with the rank.

    Args:
        ranks: Which ranks write: ``0`` (default), another rank, a list, or ``"all"``
            (every line then starts with a ``[rank r/n]`` tag, coloured on a terminal).
        level: The handler's level.
        stream: Where to write (default ``sys.stderr``).

    Examples:
        >>> import logging, sys
        >>> import distkit
        >>> log = logging.getLogger("doc.example")
        >>> log.addHandler(distkit.RankHandler(ranks="all", stream=sys.stdout))
        >>> log.warning("disk is full")
        [rank 0/1] disk is full
    """

    def __init__(self, ranks: Ranks = 0, level: int = logging.NOTSET, stream: Any = None):
        super().__init__(level)
        _selected(ranks, 0)  # validate early
        self.ranks = ranks
        self.stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            rank, size = _rank_and_size()
            if not _selected(self.ranks, rank):
                return
            stream = self.stream if self.stream is not None else sys.stderr
            text = self.format(record)
            if _tagged(self.ranks):
                text = _tag_lines(text, rank, size, _is_terminal(stream))
            stream.write(text + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def get_logger(
    name: str = "distkit", ranks: Ranks = 0, level: int = logging.INFO, fmt: Optional[str] = None
) -> logging.Logger:
    """A logger that writes through a :class:`RankHandler` (added once per logger).

    Args:
        name: Logger name.
        ranks: Which ranks write (see :class:`RankHandler`).
        level: Logger level.
        fmt: A ``logging.Formatter`` format (default ``"%(levelname)s %(message)s"``).

    Returns:
        The logger, which no longer propagates to the root logger.

    Examples:
        >>> import distkit
        >>> distkit.get_logger("doc.main").name
        'doc.main'
    """
    logger = logging.getLogger(name)
    if not any(isinstance(h, RankHandler) for h in logger.handlers):
        handler = RankHandler(ranks)
        handler.setFormatter(logging.Formatter(fmt or "%(levelname)s %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return logger


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
            builtins.print(f"{description}: {count} done in {elapsed:.1f} s", file=out)
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
