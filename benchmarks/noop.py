"""The single-process rows of the benchmark alone: ``python benchmarks/noop.py``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distkit.bench import main

if __name__ == "__main__":
    sys.exit(main(["--only", "noop", *sys.argv[1:]]))
