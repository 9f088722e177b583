"""torch.distributed collectives with return values, and a no-op single process.

Use it as ``import distkit.dist as dist``. Every name of ``mmengine.dist`` is here with a
compatible signature.

The public names are listed once, in ``__init__.pyi`` (which type checkers read), and
each is imported from its module on first use: ``import distkit.dist; dist.get_rank()``
therefore never imports torch (over a second) while no process group can exist yet;
see :mod:`distkit._registry`.
"""

from __future__ import annotations

from distkit import _lazy

__getattr__, __dir__, __all__ = _lazy.attach(__name__, __file__, torch_free={"distkit.dist.world"})
