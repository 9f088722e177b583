"""distkit: torch.distributed with return values, a no-op single process, and tools to
debug multi-rank code.

- :mod:`distkit.dist`: the collectives (``import distkit.dist as dist``).
- :func:`launch`: run a function on local ranks and get each rank's return value.
- :func:`print`, :func:`track`, :class:`RankHandler`: rank-aware output with rich.
- :mod:`distkit.testing`: a pytest plugin and a persistent pool of ranks for tests.

Names are loaded on first use, so ``import distkit`` imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distkit import _lazy

__version__ = "0.1.0"

_EXPORTS = {
    "RankError": "distkit.testing._pool",
    "RankHandler": "distkit.utils.console",
    "RankTimeout": "distkit.testing._pool",
    "get_logger": "distkit.utils.console",
    "launch": "distkit.launcher",
    "print": "distkit.utils.console",
    "track": "distkit.utils.console",
}

__all__ = [
    "RankError",
    "RankHandler",
    "RankTimeout",
    "__version__",
    "get_logger",
    "launch",
    "print",
    "track",
]


__getattr__, __dir__ = _lazy.attach(
    __name__,
    _EXPORTS,
    torch_free={"distkit.utils.console", "distkit.launcher", "distkit.testing._pool"},
)


if TYPE_CHECKING:
    from distkit.launcher import launch
    from distkit.testing._pool import RankError, RankTimeout
    from distkit.utils.console import RankHandler, get_logger, print, track
