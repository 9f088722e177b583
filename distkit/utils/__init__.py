"""Device selection, data movement and process-group caching for distkit.dist."""

from distkit.utils.device import cast_data_device, get_comm_device, get_data_device
from distkit.utils.groups import clear_group_cache, get_cpu_group, get_group

__all__ = [
    "cast_data_device",
    "clear_group_cache",
    "get_comm_device",
    "get_cpu_group",
    "get_data_device",
    "get_group",
]
