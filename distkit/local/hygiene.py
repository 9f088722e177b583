"""Process-wide state that a test may leave behind, and how to put it back."""

from __future__ import annotations


def reset_state() -> None:
    """Forget cached groups (destroying them), the local group, distkit settings, and
    whether collectives without a process group may run here (decided again)."""
    from distkit import _registry, _settings
    from distkit.dist.world import forget_local_group
    from distkit.utils.groups import clear_group_cache

    clear_group_cache(destroy=True)
    forget_local_group()
    _settings.reset()
    _registry.forget_alone()


def leftovers() -> list[str]:
    """What distkit state differs from a fresh process (empty when clean)."""
    from distkit import _registry, _settings
    from distkit.dist import world
    from distkit.utils import groups

    found = []
    if _registry.current._default_pg is not None:
        found.append("a default process group is still initialized")
    if groups._groups or groups._cpu_twins:
        found.append(f"{len(groups._groups)} cached process group(s)")
    if world._local_group is not None:
        found.append("a local group is still set")
    changed = _settings.changed()
    if changed:
        found.append(f"distkit settings changed: {', '.join(changed)}")
    return found
