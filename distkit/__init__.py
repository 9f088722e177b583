"""distkit: torch.distributed with return values, a no-op single process, and tools to
debug multi-rank code.

- :mod:`distkit.dist`: the collectives (``import distkit.dist as dist``).
- :func:`launch`: run a function on local ranks and get each rank's return value.
- :func:`print`, :func:`track`, :class:`RankHandler`: rank-aware output with rich.
- :mod:`distkit.testing`: a pytest plugin and a persistent pool of ranks for tests.

The public names are listed once, in ``__init__.pyi``, and loaded on first use, so
``import distkit`` imports no torch.
"""

from __future__ import annotations

from distkit import _lazy, _registry  # noqa: F401 - _registry: its fork hook, from the start

__version__ = "0.3.0"

__getattr__, __dir__, __all__ = _lazy.attach(
    __name__,
    __file__,
    torch_free={"distkit.utils.console", "distkit.local.launch", "distkit.local.pool"},
)
__all__ = [*__all__, "__version__"]
