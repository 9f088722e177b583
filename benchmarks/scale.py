"""The scale rows of the benchmark alone (2, 4 and 8 ranks, with the cost model):
``python benchmarks/scale.py [--quick] [--ranks 2,4,8] [--payload-mib 64]``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distkit.bench import main

if __name__ == "__main__":
    sys.exit(main(["--only", "scale", *sys.argv[1:]]))
