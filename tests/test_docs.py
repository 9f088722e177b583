"""Docstrings match signatures, mmengine code keeps working, the README covers the API."""

from __future__ import annotations

import ast
import inspect
import re

import pytest
from conftest import ROOT

import distkit.dist as dist
import distkit.testing
import distkit.utils
from distkit.utils import environ

PUBLIC = sorted(
    {
        (module.__name__, name): getattr(module, name)
        for module in (dist, distkit.utils, environ, distkit.testing)
        for name in getattr(module, "__all__", None)
        or [n for n in vars(module) if not n.startswith("_")]
        if inspect.isfunction(getattr(module, name))
    }.items()
)


def documented_args(doc: str) -> list[str]:
    match = re.search(r"\n\s*Args:\n(.*?)(\n\s*\n|\Z)", doc, re.S)
    if not match:
        return []
    block = match.group(1)
    indent = min(len(line) - len(line.lstrip()) for line in block.splitlines() if line.strip())
    names = []
    for line in block.splitlines():
        if len(line) - len(line.lstrip()) == indent and ":" in line:
            names.append(line.strip().split(":")[0].lstrip("*"))
    return names


@pytest.mark.parametrize(("key", "fn"), PUBLIC, ids=[f"{m}.{n}" for (m, n), _ in PUBLIC])
def test_docstring_args_match_signature(key, fn):
    doc = inspect.getdoc(fn) or ""
    assert doc, f"{key} has no docstring"
    params = [p.name for p in inspect.signature(fn).parameters.values()]
    args = documented_args(doc)
    if params:
        assert args == params, f"{key}: docstring Args {args} != signature {params}"
    else:
        assert not args


def test_every_mmengine_dist_name_exists_with_a_compatible_signature():
    mm = pytest.importorskip("mmengine.dist")
    for name in mm.__all__:
        assert hasattr(dist, name), f"distkit.dist lacks mmengine.dist.{name}"
        theirs = inspect.signature(getattr(mm, name)).parameters
        ours = inspect.signature(getattr(dist, name)).parameters
        ours_list = list(ours.values())
        for i, p in enumerate(theirs.values()):
            if p.kind is p.VAR_KEYWORD:
                assert any(q.kind is q.VAR_KEYWORD for q in ours_list), name
                continue
            assert p.name in ours, f"{name}: mmengine's argument {p.name!r} is missing"
            if p.kind is p.POSITIONAL_OR_KEYWORD and not (name == "init_dist" and i == 2):
                # init_dist's third slot is timeout in distkit; a string there is taken as
                # mmengine's init_backend (see init_dist), checked below
                assert ours_list[i].name == p.name, f"{name}: argument {i} is not {p.name!r}"
        extra = [
            q
            for q in ours_list
            if q.name not in theirs and q.kind not in (q.VAR_KEYWORD, q.VAR_POSITIONAL)
        ]
        assert all(q.default is not q.empty for q in extra), f"{name}: new required argument"
    assert dist.init_dist("none", "gloo", "torch") == (0, 1)  # mmengine's positional form


def test_readme_table_lists_every_public_function():
    readme = (ROOT / "README.md").read_text()
    missing = [
        n
        for n in dist.__all__
        if callable(getattr(dist, n)) and n[0].islower() and f"`{n}" not in readme
    ]
    assert not missing, f"README does not mention: {missing}"


@pytest.mark.parametrize("package", ["distkit", "distkit.dist", "distkit.utils"])
def test_each_package_lists_its_names_once_in_its_stub(package):
    import importlib
    import sys

    from distkit import _lazy

    module = importlib.import_module(package)
    # the stub read here with ast, not with the reader __all__ is built by
    path = ROOT / package.replace(".", "/") / "__init__.pyi"
    listed = [
        (alias.asname or alias.name, node.module)
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    ]
    names = [n for n, _ in listed]
    assert len(names) == len(set(names)), "a name is listed twice"
    assert sorted(names) == sorted(n for n in module.__all__ if n != "__version__")
    assert set(names) <= set(dir(module))
    stub = _lazy.read_stub(str(path))
    assert stub == dict(listed)
    for name, where in stub.items():
        value = getattr(module, name)
        # the stub tells type checkers where each name lives: it must be true
        source = sys.modules[where] if where != package else module
        assert getattr(source, name) is value, f"{package}.{name} is not {where}.{name}"
    # no other list of the names: the package's __init__.py holds none
    init = (ROOT / package.replace(".", "/") / "__init__.py").read_text()
    assert "_EXPORTS" not in init and "TYPE_CHECKING" not in init
