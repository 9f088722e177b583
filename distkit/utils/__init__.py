"""Device selection, moving nested data, process-group caching, launcher environments
and console output.

The public names are listed once, in ``__init__.pyi``, and imported on first use:
importing ``distkit.utils`` imports no torch.
"""

from __future__ import annotations

from distkit import _lazy

__getattr__, __dir__, __all__ = _lazy.attach(
    __name__, __file__, torch_free={"distkit.utils.console", "distkit.utils.environ"}
)
