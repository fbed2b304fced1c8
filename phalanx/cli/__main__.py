"""``python -m phalanx.cli ...`` is the ``phalanx`` command (as ``python -m phalanx``)."""

import sys

from phalanx.cli import main

if __name__ == "__main__":
    sys.exit(main())
