"""Device selection, data movement, process-group caching and console output.

Re-exported lazily (see :mod:`distkit.dist`): importing ``distkit.utils`` imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distkit import _lazy

_EXPORTS = {
    "cast_data_device": "distkit.utils.device",
    "clear_group_cache": "distkit.utils.groups",
    "get_comm_device": "distkit.utils.device",
    "get_cpu_group": "distkit.utils.groups",
    "get_data_device": "distkit.utils.device",
    "get_group": "distkit.utils.groups",
}

__all__ = [
    "cast_data_device",
    "clear_group_cache",
    "get_comm_device",
    "get_cpu_group",
    "get_data_device",
    "get_group",
]


__getattr__, __dir__ = _lazy.attach(
    __name__, _EXPORTS, torch_free={"distkit.utils.console", "distkit.utils.launch"}
)


if TYPE_CHECKING:
    from distkit.utils.device import cast_data_device, get_comm_device, get_data_device
    from distkit.utils.groups import clear_group_cache, get_cpu_group, get_group
