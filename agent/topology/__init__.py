"""Topology discovery by node agents (docs/design.md §11, docs/topology.md).

``discover(DiscoveryConfig(...))`` merges NVML, sysfs, ``nvidia-smi topo -m``,
static config and node labels into one ``phalanx.topology.NodeTopology``.
``simulated_node`` / ``simulated_fabric`` build synthetic ones.

Nothing in this package imports grpc or asyncio, or keeps time.
"""

from agent.topology.base import GpuFacts, LinkFacts, NicFacts, PartialTopology, TopologySource
from agent.topology.discover import DiscoveryConfig, discover, infer_rails, merge, sources_for
from agent.topology.labels import DEFAULT_LABEL_RULES, LabelRule, location_from_labels
from agent.topology.simulated import simulated_fabric, simulated_node

__all__ = [
    "DEFAULT_LABEL_RULES",
    "DiscoveryConfig",
    "GpuFacts",
    "LabelRule",
    "LinkFacts",
    "NicFacts",
    "PartialTopology",
    "TopologySource",
    "discover",
    "infer_rails",
    "location_from_labels",
    "merge",
    "simulated_fabric",
    "simulated_node",
    "sources_for",
]
