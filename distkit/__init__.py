"""distkit: torch.distributed with return values and a no-op single process."""

__version__ = "0.1.0"

from distkit.utils.console import track

__all__ = ["__version__", "track"]
