# The public names of ``distkit.utils``: type checkers read this file, and so does the
# lazy loader in __init__.py (every "from module import name as name" line is one name).
from distkit.utils.device import cast_data_device as cast_data_device
from distkit.utils.device import get_comm_device as get_comm_device
from distkit.utils.device import get_data_device as get_data_device
from distkit.utils.groups import clear_group_cache as clear_group_cache
from distkit.utils.groups import get_cpu_group as get_cpu_group
from distkit.utils.groups import get_group as get_group
