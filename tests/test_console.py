"""Rank-aware output: progress bars."""

from __future__ import annotations

import io
import time

import distkit
from distkit.testing import ranks
from distkit.utils.console import track


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_track_draws_a_bar_on_a_terminal():
    out = FakeTerminal()
    assert list(track(range(3), "counting", file=out)) == [0, 1, 2]
    assert "counting" in out.getvalue() and "3/3" in out.getvalue()


def test_track_waits_for_its_delay_and_prints_plain_text_elsewhere():
    quiet = io.StringIO()
    assert list(track(range(5), "fast", delay=10.0, file=quiet)) == list(range(5))
    assert quiet.getvalue() == ""  # finished before the delay: nothing shown
    slow = io.StringIO()
    for _ in track(range(2), "slow", delay=0.01, file=slow):
        time.sleep(0.02)
    assert slow.getvalue().startswith("slow: 2 done in ")
    assert "\x1b[" not in slow.getvalue()  # no terminal codes in a log file


def test_track_is_exported_at_the_top_level():
    assert distkit.track is track


def _capture(call) -> str:
    out = io.StringIO()
    call(out)
    return out.getvalue()


@ranks(0, 1, 2, 3)
def test_print_on_chosen_ranks_with_tags():
    import distkit.dist as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    main = _capture(lambda f: distkit.print("loss", 0.5, file=f))
    assert main == ("loss 0.5\n" if rank == 0 else "")
    everyone = _capture(lambda f: distkit.print("line one\nline two", ranks="all", file=f))
    assert everyone == f"[rank {rank}/{size}] line one\n[rank {rank}/{size}] line two\n"
    last = _capture(lambda f: distkit.print("x", ranks=[size - 1], file=f))
    assert last == (f"[rank {rank}/{size}] x\n" if rank == size - 1 else "")
    term = FakeTerminal()
    distkit.print("c", ranks="all", file=term)
    assert term.getvalue().startswith("\x1b[") and f"[rank {rank}/{size}]" in term.getvalue()


@ranks(0, 2)
def test_rank_handler_tags_log_lines():
    import logging

    import distkit.dist as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    stream = io.StringIO()
    log = logging.getLogger(f"test.rank_handler.{rank}")
    log.propagate = False
    handler = distkit.RankHandler(ranks="all", stream=stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(handler)
    try:
        log.warning("careful")
    finally:
        log.removeHandler(handler)
    assert stream.getvalue() == f"[rank {rank}/{size}] WARNING careful\n"
    quiet = io.StringIO()
    only_main = distkit.RankHandler(stream=quiet)
    only_main.emit(logging.LogRecord("x", logging.INFO, __file__, 1, "hello", None, None))
    assert quiet.getvalue() == ("hello\n" if rank == 0 else "")
