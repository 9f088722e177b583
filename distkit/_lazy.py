"""Lazy re-exports: each package lists its public names once, in its ``__init__.pyi``.

The stub is what type checkers read, and this loader reads it too: every
``from module import name as name`` line in it is a public name of the package, loaded
from that module on first use. ``from package import sub as sub`` names a subpackage or
submodule (``distkit.dist``), imported on first use as well.

While torch is not loaded, names from torch-free modules load on their own
(``import distkit.dist; dist.get_rank()`` stays cheap). Otherwise the first access loads
every module of the package and removes the package's ``__getattr__``, because CPython
does not specialize attribute lookups on a module that defines one (``dist.get_rank``
cost 33 ns to look up instead of 10).
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
from collections.abc import Iterable
from typing import Any, Callable


def read_stub(stub_path: str) -> dict[str, str]:
    """``public name -> module`` from the re-export lines of a stub file."""
    with open(stub_path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), stub_path)
    exports: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if alias.asname == alias.name:  # "name as name": an explicit re-export
                    exports[alias.name] = node.module
    return exports


def attach(
    package: str, init_file: str, torch_free: Iterable[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``, from its ``__init__.pyi``."""
    exports = read_stub(os.path.splitext(init_file)[0] + ".pyi")
    light = set(torch_free)

    def resolve(name: str) -> Any:
        where = exports[name]
        if where == package:  # "from package import sub as sub": a submodule
            return importlib.import_module(f"{package}.{name}")
        return getattr(importlib.import_module(where), name)

    def load(module_name: str) -> None:
        namespace = vars(sys.modules[package])
        for name, where in exports.items():
            if where == module_name:
                namespace[name] = resolve(name)

    def __getattr__(name: str) -> Any:
        module_name = exports.get(name)
        if module_name is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace = vars(sys.modules[package])
        if module_name == package or (module_name in light and "torch" not in sys.modules):
            namespace[name] = resolve(name)  # stay light: nothing here needs torch yet
        else:
            for where in sorted(set(exports.values()) - {package}):
                load(where)
            if all(n in namespace for n in exports):
                namespace.pop("__getattr__", None)
        return namespace[name]

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__, sorted(exports)
