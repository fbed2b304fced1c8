"""``python -m phalanx.up ARGS`` is ``phalanx up ARGS``."""

import sys

from phalanx.cli import main

if __name__ == "__main__":
    sys.exit(main(["up", *sys.argv[1:]]))
