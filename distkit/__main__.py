"""``python -m distkit``: the same as the ``distkit`` command."""

import sys

from distkit.cli import main

sys.exit(main())
