"""Run distkit's benchmark: see distkit/bench.py (also ``distkit bench``)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distkit.bench import main

if __name__ == "__main__":
    sys.exit(main())
