"""torch's registry of process groups, read without importing torch until it matters.

``current._default_pg`` is the default process group, or ``None``: the one question
"is this process distributed?" that every part of distkit asks, always through this
module attribute.

A process group can only exist once ``torch.distributed`` has been imported, so until
then the answer is no, and ``import distkit.dist; dist.get_rank()`` never pays for
importing torch (over a second). Until torch's distributed module is loaded,
:data:`current` is a small stand-in that checks ``sys.modules``; from then on it is
torch's own registry object, read directly (18 ns, against 146 ns for
``torch.distributed.is_initialized()``). Readers must look it up through the module
(``_registry.current``), never bind it to a name of their own, so they see the switch;
the compiled shortcuts (:mod:`distkit.dist._shortcut`) hold it in a closure cell
registered with :func:`watch`, which the switch updates.
"""

from __future__ import annotations

import sys
from typing import Any

_C10D = "torch.distributed.distributed_c10d"


class _BeforeTorch:
    """Stands in for torch's registry until ``torch.distributed`` is imported."""

    __slots__ = ()

    @property
    def _default_pg(self) -> Any:
        if _C10D not in sys.modules:
            return None
        return bind()._default_pg


_cells: list[Any] = []  # closure cells holding ``current`` (see watch)


def bind() -> Any:
    """Point :data:`current` at torch's registry (importing torch.distributed if needed)."""
    global current
    # Imported here, not at the top: this module must stay importable without torch.
    from distkit._compat import torch_registry

    current = torch_registry()
    for cell in _cells:
        cell.cell_contents = current
    return current


def watch(cell: Any) -> None:
    """Keep the closure ``cell`` holding :data:`current`, now and after the switch.

    One attribute lookup fewer per call than ``_registry.current`` (a module attribute),
    for code where 20 ns count: the single-process shortcuts.
    """
    cell.cell_contents = current
    _cells.append(cell)


#: ``current._default_pg`` is the default process group, or ``None``.
current: Any = _BeforeTorch()
