"""Synthetic DGX-like nodes and fabrics: the agent's name for
phalanx/simulated_topology.py, where they live so that `phalanx up` (which
names every simulated node in its certificates) needs nothing of agent/."""

from phalanx.simulated_topology import SIMULATED, simulated_fabric, simulated_node

__all__ = ["SIMULATED", "simulated_fabric", "simulated_node"]
