"""Node labels and static config -> location fields (agent/topology/labels.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import pytest

from agent.topology import DEFAULT_LABEL_RULES, DiscoveryConfig, LabelRule, discover, location_from_labels
from agent.topology.labels import UNMAPPED_LABELS, StaticSource

DOCS = Path(__file__).resolve().parents[2] / "docs" / "topology.md"


@pytest.mark.parametrize(
    "labels, expected",
    [
        (
            {"topology.kubernetes.io/region": "us-east1", "topology.kubernetes.io/zone": "us-east1-b"},
            {"region": "us-east1", "az": "us-east1-b"},
        ),
        (
            {"failure-domain.beta.kubernetes.io/region": "r-old", "failure-domain.beta.kubernetes.io/zone": "z-old"},
            {"region": "r-old", "az": "z-old"},
        ),
        (
            {"topology.kubernetes.io/zone": "new", "failure-domain.beta.kubernetes.io/zone": "old"},
            {"az": "new"},
        ),
        (
            {"fabric.topograph.run/tier-0": "leaf-1", "fabric.topograph.run/tier-1": "spine-1", "fabric.topograph.run/tier-2": "core-1",
             "accelerator.topograph.run/domain": "nvl-1"},
            {"leaf": "leaf-1", "spine": "spine-1", "nvlink_domain": "nvl-1"},
        ),
        (
            {"network.topology.nvidia.com/accelerator": "nvl1", "network.topology.nvidia.com/leaf": "s1",
             "network.topology.nvidia.com/spine": "s2", "network.topology.nvidia.com/core": "s3"},
            {"nvlink_domain": "nvl1", "leaf": "s1", "spine": "s2"},
        ),
        (
            {"network.topology.nvidia.com/accelerator": "nvl1", "network.topology.nvidia.com/block": "s1",
             "network.topology.nvidia.com/spine": "s2", "network.topology.nvidia.com/datacenter": "s3"},
            {"nvlink_domain": "nvl1", "leaf": "s1", "spine": "s2"},
        ),
        (
            {"cloud.google.com/gce-topology-block": "b1", "cloud.google.com/gce-topology-subblock": "sb1",
             "cloud.google.com/gce-topology-host": "h1"},
            {"spine": "b1", "leaf": "sb1", "rack": "sb1"},
        ),
        (
            {"topology.k8s.aws/network-node-layer-1": "nn-1", "topology.k8s.aws/network-node-layer-2": "nn-2",
             "topology.k8s.aws/network-node-layer-3": "nn-3"},
            {"spine": "nn-2", "leaf": "nn-3"},
        ),
        (
            {"cloud.provider.com/topology-block": "block-1", "cloud.provider.com/topology-rack": "rack-1"},
            {"spine": "block-1", "leaf": "rack-1", "rack": "rack-1"},
        ),
        (
            {"nvidia.com/gpu.clique": "3f2b0a6c-9d8e-4f1a-a7b5-c4d3e2f1a0b9.32766", "network.topology.nvidia.com/accelerator": "nvl72-r01"},
            {"nvlink_domain": "3f2b0a6c-9d8e-4f1a-a7b5-c4d3e2f1a0b9.32766"},
        ),
        (
            {"fabric.topograph.run/tier-0": "t0", "network.topology.nvidia.com/leaf": "v0", "cloud.google.com/gce-topology-subblock": "gke"},
            {"leaf": "t0", "rack": "gke"},
        ),
        ({"topology.kubernetes.io/zone": "  ", "failure-domain.beta.kubernetes.io/zone": "old"}, {"az": "old"}),
        ({"kubernetes.io/hostname": "n1", "cloud.google.com/gce-topology-host": "h1"}, {}),
    ],
    ids=[
        "kubernetes", "kubernetes-deprecated", "kubernetes-new-beats-deprecated", "topograph-v1", "topograph-v0",
        "topograph-v0.1-block-is-leaf", "gke", "eks", "kueue-kai-examples", "gpu-operator-clique-beats-topograph",
        "topograph-v1-beats-older-and-gke", "blank-values-skipped", "unmapped-only",
    ],
)
def test_label_mapping(labels: Mapping[str, str], expected: dict[str, str]) -> None:
    assert location_from_labels(labels) == expected


def test_static_config_beats_labels_and_all_labels_are_kept(tmp_path: Path) -> None:
    labels = {"topology.kubernetes.io/zone": "label-zone", "network.topology.nvidia.com/leaf": "label-leaf", "team": "ml"}
    topo = discover(DiscoveryConfig(node="n", az="cfg-zone", rack="r7", labels=labels, sysfs_root=tmp_path, sources=frozenset({"static", "labels"})))
    assert (topo.az, topo.leaf, topo.rack) == ("cfg-zone", "label-leaf", "r7")
    assert topo.labels == labels  # unmapped labels travel with the node record
    assert topo.sources == ("static", "labels")


def test_operators_can_map_their_own_labels(tmp_path: Path) -> None:
    rules = (LabelRule("example.com/pod", "spine", "site convention"), *DEFAULT_LABEL_RULES)
    topo = discover(DiscoveryConfig(node="n", labels={"example.com/pod": "pod-3"}, label_rules=rules, sysfs_root=tmp_path, sources=frozenset({"labels"})))
    assert topo.spine == "pod-3"


def test_rules_and_static_fields_are_validated() -> None:
    with pytest.raises(ValueError, match="unknown field 'zone'"):
        LabelRule("x/y", "zone", "typo")
    with pytest.raises(ValueError, match="unknown static location fields"):
        StaticSource(zone="a")


def test_every_label_is_in_the_documented_table() -> None:
    """docs/topology.md is the operator's copy of the mapping: keep them equal."""
    doc = DOCS.read_text()
    for key in {r.key for r in DEFAULT_LABEL_RULES} | set(UNMAPPED_LABELS):
        assert f"`{key}`" in doc, key
