"""Rank-aware output: progress bars."""

from __future__ import annotations

import io
import time

import distkit
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
