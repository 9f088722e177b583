"""distkit's process-wide settings, all declared here so tests can reset them.

Declared in one place (not by the modules that use them) because modules load lazily: a
setting must exist before the code that reads it was ever imported.
"""

from __future__ import annotations

import os
from typing import Any


def _flag(name: str, default: bool = False) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value in ("1", "true", "yes", "on")


def _seconds(name: str, default: float) -> float:
    """Seconds from the environment variable ``name`` (``default`` when it is unset or
    empty). A value that is not a number of seconds, zero or more, raises: silently
    falling back would hide the typo, and ``nan`` would make every deadline unreachable."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:  # not a number, nan, or negative
        raise ValueError(
            f"{name}={value!r} is not a number of seconds (zero or more): set it to, for "
            f"example, {default:g}, or unset it for the default ({default:g})"
        )
    return seconds


_DEFAULTS: dict[str, Any] = {
    # how object collectives decode what other ranks send: "pickle" or "safe"
    "serializer": os.environ.get("DISTKIT_SERIALIZER", "pickle"),
    # classes the safe serializer may load, as (module, qualname) pairs
    "safe_allow": frozenset(),
    # the most bytes an object decoded by the safe serializer may take (None: 256 per
    # byte received)
    "safe_max_bytes": None,
    # cross-rank checks before every collective (DISTKIT_DEBUG=1)
    "debug": _flag("DISTKIT_DEBUG"),
    # the default cross-rank check of the first calls at each call site and a sample of
    # the rest (DISTKIT_CHECK=0 turns it off; see distkit.dist.guard.check)
    "check": _flag("DISTKIT_CHECK", default=True),
    # seconds a rank waits in one collective before distkit reports who has not arrived
    # and where every rank is (DISTKIT_STUCK_AFTER; 0 turns the report off)
    "stuck_after": _seconds("DISTKIT_STUCK_AFTER", 60.0),
    # seconds a timed-out rank waits for the others to post where they are
    "hang_grace": 5.0,
}
#: The settings changed in this process (the rest have their defaults).
values: dict[str, Any] = {}


def default(name: str) -> Any:
    """The value of setting ``name`` at start-up (from the environment, or built in)."""
    return _DEFAULTS[name]


def get(name: str) -> Any:
    return values.get(name, _DEFAULTS[name])


def set(name: str, value: Any) -> None:
    if name not in _DEFAULTS:
        raise KeyError(f"unknown distkit setting {name!r}")
    values[name] = value


def changed() -> list[str]:
    return sorted(k for k, v in values.items() if v != _DEFAULTS[k])


def reset() -> None:
    values.clear()
