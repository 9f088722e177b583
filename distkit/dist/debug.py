"""Debug mode: the ranks of a group check that they are in the same collective.

With debug mode on (``DISTKIT_DEBUG=1`` or :func:`set_debug`), every collective on a
process group first exchanges a small signature of the call among the group's ranks:
its name, the op, dtypes, shapes where they must match, ``src``/``dst``, the serializer,
and the call site. When they disagree, every rank raises
:class:`~distkit.dist.CollectiveMismatchError`, naming each rank's call and call site,
instead of hanging or computing garbage (see :mod:`distkit.dist.guard.debugmode`).
"""

from __future__ import annotations

from distkit import _settings


def set_debug(enabled: bool = True) -> None:
    """Turn the collective debug mode on or off for this process.

    In debug mode every collective on a process group first checks, with one small
    exchange among the group's ranks, that every rank is in the same collective with
    compatible arguments: the op, dtypes, shapes where they must match, ``src``/``dst``
    and the object serializer. On a mismatch every rank raises
    :class:`CollectiveMismatchError` listing each rank's call and call site (file:line),
    instead of hanging or computing garbage. It costs one extra small all_gather per
    collective (``docs/debugging.md`` has the measured cost). The environment variable
    ``DISTKIT_DEBUG=1`` turns it on at start-up. Turn it on (or off) on every rank.

    Args:
        enabled: Whether to check.

    Examples:
        >>> import distkit.dist as dist
        >>> dist.set_debug(True)
        >>> dist.get_debug()
        True
        >>> dist.set_debug(False)
    """
    _settings.set("debug", bool(enabled))


def get_debug() -> bool:
    """Whether the collective debug mode is on (see :func:`set_debug`).

    Examples:
        >>> import distkit.dist as dist
        >>> dist.get_debug()
        False
    """
    return bool(_settings.get("debug"))
