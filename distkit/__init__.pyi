# The public names of ``distkit``: type checkers read this file, and so does the lazy
# loader in __init__.py (every "from module import name as name" line is one name).
from distkit import dist as dist
from distkit import utils as utils
from distkit.local.launch import launch as launch
from distkit.local.pool import RankError as RankError
from distkit.local.pool import RankTimeout as RankTimeout
from distkit.utils.console import RankHandler as RankHandler
from distkit.utils.console import get_logger as get_logger
from distkit.utils.console import print as print
from distkit.utils.console import track as track

__version__: str
