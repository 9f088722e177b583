"""Lazy re-exports for distkit's packages (``distkit``, ``distkit.dist``, ``distkit.utils``).

A package lists ``name -> defining module``; a name is imported on first use. While torch
is not loaded, names from torch-free modules load on their own (``import distkit.dist;
dist.get_rank()`` stays cheap). Otherwise the first access loads every module of the
package and removes the package's ``__getattr__``, because CPython does not specialize
attribute lookups on a module that defines one (``dist.get_rank`` cost 33 ns to look up
instead of 10).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterable
from typing import Any, Callable


def attach(
    package: str, exports: dict[str, str], torch_free: Iterable[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return ``(__getattr__, __dir__)`` for ``package``."""
    light = set(torch_free)

    def load(module_name: str) -> None:
        module = importlib.import_module(module_name)
        namespace = vars(sys.modules[package])
        for name, where in exports.items():
            if where == module_name:
                namespace[name] = getattr(module, name)

    def __getattr__(name: str) -> Any:
        module_name = exports.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace = vars(sys.modules[package])
        if module_name in light and "torch" not in sys.modules:
            load(module_name)  # stay light: nothing here needs torch yet
        else:
            for where in sorted(set(exports.values())):
                load(where)
            namespace.pop("__getattr__", None)
        return namespace[name]

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
