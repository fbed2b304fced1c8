"""``phalanx up``: a whole multi-AZ cluster on one machine (docs/local-cluster.md).

Moved unchanged to ``orchestrator.py`` first, so history follows the split.
"""

from phalanx.up.orchestrator import *  # noqa: F401,F403
