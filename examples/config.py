"""mmengine-style Python configs for the examples, with no dependency.

The format is mmengine's: a config's top-level names (not dunders, modules or functions)
are the config. ``_base_`` (a path or a list of paths, relative to the file) is loaded
first; two bases may not share a key; the file's own values merge in (dicts key by key,
``_delete_=True`` replaces a dict, anything else replaces).
``load("configs/eval.py", {"train.epochs": 3})`` gives ``cfg.train.epochs``,
``cfg.to_dict()`` and ``cfg.filename``. ``--cfg-options a.b=1 c=[1,2] d=None e=true`` goes
through :class:`OverrideAction`: Python literals, bare words are strings,
``true``/``false``/``null`` work, ``1,2`` is a list. Unlike mmengine, an override of a key
that does not exist raises ``KeyError`` (with the closest key) instead of adding it.

Reading these configs with mmengine itself (``mmengine.Config.fromfile``) gives the same
values: ``tests/test_train_examples.py`` checks it. This loader spares the examples
mmengine's dependencies (opencv-python, matplotlib: about 370 MiB).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import runpy
import types
from collections.abc import Mapping, Sequence
from typing import Any, Optional


class ConfigDict(dict):
    """A dict whose keys are also attributes (``cfg.train.epochs``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no key {name!r}") from None

    def to_dict(self) -> dict:
        """Plain nested dicts, e.g. to save in a checkpoint."""
        return _convert(self, dict)


class Config(ConfigDict):
    """The top level of a loaded config; ``filename`` is the path it was loaded from, as given."""

    filename: str

    def __init__(self, data: Mapping, filename: str) -> None:
        super().__init__(data)
        dict.__setattr__(self, "filename", filename)


def _convert(value: Any, mapping: type) -> Any:
    """``value`` with every nested mapping turned into ``mapping`` (dict or ConfigDict)."""
    if isinstance(value, Mapping):
        return mapping({k: _convert(v, mapping) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return type(value)(_convert(v, mapping) for v in value)
    return value


def _merge(child: Mapping, base: Mapping) -> dict:
    """``child`` merged into a copy of ``base``: dicts key by key, other values replace."""
    out = dict(base)
    for key, value in child.items():
        if isinstance(value, Mapping):
            value = dict(value)
            replace = value.pop("_delete_", False)
            if not replace and isinstance(out.get(key), Mapping):
                value = _merge(value, out[key])
        out[key] = value
    return out


def _read(path: str, chain: tuple[str, ...]) -> dict:
    if path in chain:
        raise ValueError(f"config inheritance cycle: {' -> '.join((*chain, path))}")
    names = runpy.run_path(path, run_name="__config__")
    skip = (types.ModuleType, types.FunctionType)
    own = {k: v for k, v in names.items() if not k.startswith("__") and not isinstance(v, skip)}
    bases = own.pop("_base_", [])
    merged: dict = {}
    for rel in [bases] if isinstance(bases, str) else bases:
        base_path = os.path.normpath(os.path.join(os.path.dirname(path), rel))
        if not os.path.isfile(base_path):
            raise FileNotFoundError(f"{path}: _base_ file {rel!r} not found ({base_path})")
        base = _read(base_path, (*chain, path))
        clash = sorted(set(base) & set(merged), key=str)
        if clash:
            raise KeyError(f"{path}: keys {clash} are defined by more than one _base_ file")
        merged.update(base)
    return _merge(own, merged)


def load(path: str, overrides: Optional[Mapping[str, Any]] = None) -> Config:
    """Load the Python config at ``path``, then apply ``overrides`` (dotted keys)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {os.path.abspath(path)}")
    cfg = Config(_convert(_read(os.path.abspath(path), ()), ConfigDict), filename=path)
    for dotted, value in (overrides or {}).items():
        set_key(cfg, dotted, value)
    return cfg


def set_key(cfg: Mapping, dotted: str, value: Any) -> None:
    """Set ``cfg[a][b][c] = value`` for ``dotted == "a.b.c"``; every key must exist."""
    node: Any = cfg
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth]) or "the config"
        if not isinstance(node, Mapping):
            raise KeyError(f"cannot set {dotted!r}: {where} is a {type(node).__name__}, not a dict")
        if part not in node:
            close = difflib.get_close_matches(part, [str(k) for k in node], n=1)
            hint = f"; did you mean {'.'.join([*parts[:depth], close[0]])!r}?" if close else ""
            raise KeyError(f"cannot set {dotted!r}: {where} has no key {part!r}{hint}")
        if depth == len(parts) - 1:
            old = node[part]
            both = isinstance(old, Mapping) and isinstance(value, Mapping)
            node[part] = _convert(_merge(value, old) if both else value, ConfigDict)
        else:
            node = node[part]


_WORDS = {"true": True, "false": False, "null": None, "none": None}


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):  # a bare word: a string, or true/false/null
        return _WORDS.get(node.id.lower(), node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _literal(node.operand)
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_literal(n) for n in node.elts]
        return items if isinstance(node, ast.List) else tuple(items)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    raise ValueError("not a literal")


def parse_value(text: str) -> Any:
    """``"3"`` -> 3, ``"1,2"`` -> [1, 2], ``"true"`` -> True, ``"sgd"`` -> "sgd" (a non-literal
    stays a string)."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
        value = _literal(tree)
    except (SyntaxError, ValueError):
        return text
    if isinstance(tree, ast.Tuple) and not text.strip().startswith("("):
        return list(value)  # a bare a,b,c is a list
    return value


class OverrideAction(argparse.Action):
    """argparse action for ``--cfg-options key=value ...``: builds ``{key: parsed value}``."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: Optional[str] = None,
    ) -> None:
        options = dict(getattr(namespace, self.dest, None) or {})
        items = [values] if isinstance(values, str) or not isinstance(values, Sequence) else values
        for item in items:
            key, sep, text = item.partition("=")
            if not sep or not key:
                parser.error(f"{option_string}: expected key=value, got {item!r}")
            options[key] = parse_value(text)
        setattr(namespace, self.dest, options)
