"""Synthetic nodes and fabrics (phalanx/simulated_topology.py)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from agent.topology import infer_rails, simulated_fabric, simulated_node
from phalanx.model import Level, PcieDistance
from phalanx.topology import NodeTopology
from phalanx.wire import topology_from_pb, topology_to_pb

PIX, PXB, NODE, SYS = PcieDistance.PIX, PcieDistance.PXB, PcieDistance.NODE, PcieDistance.SYS


def test_default_node_is_dgx_like() -> None:
    n = simulated_node("a-n000", "az-a", spine="spine-0", leaf="leaf-0-0")
    assert (n.node, n.az, n.region, n.spine, n.leaf) == ("a-n000", "az-a", "local", "spine-0", "leaf-0-0")
    assert [g.numa_node for g in n.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {g.nvlink_island for g in n.gpus} == {0}
    assert all(len(g.nvlink_peers) == 7 for g in n.gpus)
    assert [(x.name, x.rail, x.rate_gbps, x.link_layer, x.state) for x in n.nics] == [
        (f"mlx5_{j}", j, 400, "Ethernet", "ACTIVE") for j in range(8)
    ]
    assert [n.distance(0, f"mlx5_{j}") for j in range(8)] == [PIX, PXB, NODE, NODE, SYS, SYS, SYS, SYS]
    assert all(n.distance(i, f"mlx5_{i}") == PIX for i in range(8))
    assert n.sources == ("simulated",)


def test_simulated_rails_are_what_discovery_would_infer() -> None:
    """A simulated node must look like a discovered one to placement."""
    for gpus, nics in ((8, 8), (8, 4), (4, 8)):
        n = simulated_node("x", "a", gpus=gpus, nics=nics)
        inferred = infer_rails(n.gpu_indices, [x.name for x in n.nics], {(l.gpu, l.nic): l.distance for l in n.links})
        assert {x.name: x.rail for x in n.nics if x.name in inferred} == inferred
        assert len(inferred) == nics  # every simulated NIC shares a switch with a GPU


@pytest.mark.parametrize(
    "gpus, islands, expected",
    [(8, 2, [0, 0, 0, 0, 1, 1, 1, 1]), (8, 8, list(range(8))), (8, 3, [0, 0, 1, 1, 2, 2, 2, 2]), (4, 9, [0, 1, 2, 3]), (1, 1, [0])],
)
def test_islands(gpus: int, islands: int, expected: list[int]) -> None:
    n = simulated_node("x", "a", gpus=gpus, islands=islands)
    assert [g.nvlink_island for g in n.gpus] == expected
    for g in n.gpus:
        assert set(g.nvlink_peers) == {h.index for h in n.gpus if h.nvlink_island == g.nvlink_island} - {g.index}


def test_fewer_nics_than_gpus_share_switches() -> None:
    n = simulated_node("x", "a", gpus=8, nics=4, rail_optimised=False)
    assert [n.distance(g, "mlx5_0") for g in range(8)] == [PIX, PIX, PXB, PXB, SYS, SYS, SYS, SYS]
    assert {x.rail for x in n.nics} == {-1}


def test_cpu_node_and_bad_arguments() -> None:
    cpu = simulated_node("cpu", "a", gpus=0, nics=1)
    assert cpu.gpus == () and cpu.links == () and len(cpu.nics) == 1
    with pytest.raises(ValueError, match="islands"):
        simulated_node("x", "a", islands=0)
    with pytest.raises(ValueError, match="gpus and nics"):
        simulated_node("x", "a", gpus=-1)
    with pytest.raises(ValueError, match="spines"):
        simulated_fabric("a", 10, 0, 1)


def test_uuids_are_stable_and_distinct() -> None:
    a, b = simulated_node("n1", "a"), simulated_node("n2", "a")
    assert a.gpus[0].uuid == simulated_node("n1", "a").gpus[0].uuid
    assert len({g.uuid for g in a.gpus + b.gpus}) == 16


def test_simulated_node_survives_the_wire_and_json() -> None:
    n = simulated_node("x", "a", spine="s", leaf="l", nvlink_domain="d", islands=2)
    assert topology_from_pb(topology_to_pb(n)) == n
    assert NodeTopology.from_dict(json.loads(json.dumps(n.to_dict()))) == n


def test_fabric_spreads_nodes_evenly_in_contiguous_runs() -> None:
    nodes = simulated_fabric("az-b", 1000, 4, 8, nodes_per_nvlink_domain=18)
    assert len(nodes) == 1000 and len({n.node for n in nodes}) == 1000
    assert nodes[0].node == "az-b-n000" and nodes[-1].node == "az-b-n999"
    per_leaf = Counter(n.domain(Level.LEAF) for n in nodes)
    assert len(per_leaf) == 32 and max(per_leaf.values()) - min(per_leaf.values()) <= 1
    leaves_in_order = [n.leaf for n in nodes]
    assert leaves_in_order == sorted(leaves_in_order, key=lambda s: tuple(int(x) for x in s.split("-")[1:]))
    assert all(n.leaf.startswith(f"leaf-{n.spine.split('-')[1]}-") for n in nodes)
    assert Counter(n.spine for n in nodes) == {f"spine-{s}": 250 for s in range(4)}
    domains = Counter(n.nvlink_domain for n in nodes)
    assert domains["az-b-nvl0"] == 18 and len(domains) == 56  # 55 full domains + 10 nodes
    assert sum(len(n.gpus) for n in nodes) == 8000


def test_small_fabrics() -> None:
    assert simulated_fabric("a", 0, 1, 1) == []
    two = simulated_fabric("a", 2, 2, 2, prefix="gpu")
    assert [(n.node, n.spine, n.leaf) for n in two] == [("gpu-n000", "spine-0", "leaf-0-0"), ("gpu-n001", "spine-1", "leaf-1-0")]
