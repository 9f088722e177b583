"""distkit: torch.distributed with return values and a no-op single process."""

__version__ = "0.1.0"
