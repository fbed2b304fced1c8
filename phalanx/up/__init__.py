"""``phalanx up``: a whole multi-AZ cluster on one machine, for trying
Phalanx. docs/local-cluster.md describes what it starts and prints, and how it
stops; its section "Inside: phalanx/up/" says which module holds what.

``run`` is the command (``phalanx up``, ``python -m phalanx.up``);
``UpProcess`` runs it as a child process from Python (tests, benchmarks).
"""

from phalanx.up.orchestrator import run
from phalanx.up.up_process import UpProcess

__all__ = ["UpProcess", "run"]
