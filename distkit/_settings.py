"""distkit's process-wide settings, in one place so tests can reset them."""

from __future__ import annotations

from typing import Any

_DEFAULTS: dict[str, Any] = {}
_values: dict[str, Any] = {}


def register(name: str, default: Any) -> None:
    """Declare a setting and its default (modules call this at import)."""
    _DEFAULTS.setdefault(name, default)


def get(name: str) -> Any:
    return _values.get(name, _DEFAULTS[name])


def set(name: str, value: Any) -> None:
    if name not in _DEFAULTS:
        raise KeyError(f"unknown distkit setting {name!r}")
    _values[name] = value


def changed() -> list[str]:
    return sorted(k for k, v in _values.items() if v != _DEFAULTS[k])


def reset() -> None:
    _values.clear()
