"""Where a node sits in the network, from static configuration and node labels.

Hardware cannot tell a node which leaf switch, spine or zone it hangs off;
that comes from the operator (static config) or from labels that a cloud
provider, NVIDIA topograph or the GPU Operator put on the Kubernetes node.
``DEFAULT_LABEL_RULES`` maps the label names those tools use to Phalanx's
levels; docs/topology.md prints the same table.

Rules for one field are tried in order; the first label present with a
non-empty value wins. Labels that describe tiers Phalanx does not model (a
topograph "core"/"datacenter" tier above the spine, GKE's per-host id) are kept
in ``NodeTopology.labels`` but not mapped: a switch tier above the spine is not
an availability zone, and guessing one would merge fault domains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from agent.topology.base import LABELS, LOCATION_FIELDS, STATIC, PartialTopology


@dataclass(frozen=True)
class LabelRule:
    """``key`` (a node label) supplies ``field`` (a ``NodeTopology`` location
    field). ``origin`` says who writes the label, for the docs and for
    ``explain``."""

    key: str
    field: str
    origin: str

    def __post_init__(self) -> None:
        if self.field not in LOCATION_FIELDS:
            raise ValueError(f"label rule for {self.key!r}: unknown field {self.field!r}; expected one of {LOCATION_FIELDS}")


# Order within a field is precedence. Sources checked against the tools' docs:
# Kubernetes well-known labels; NVIDIA topograph (docs.nvidia.com/topograph,
# "Node Labels and Annotations", v0.1 -> v1.x label families); NVIDIA GPU
# Operator / GPU Feature Discovery (nvidia.com/gpu.clique, also KAI's default
# GPU-network-acceleration label); GKE (cloud.google.com/gce-topology-*, used
# in Kueue TAS "gke-default" Topology); EKS (topology.k8s.aws/network-node-layer-N);
# the example labels of the Kueue TAS KEP-2724 and KAI scheduler topology docs
# (cloud.provider.com/topology-*), which clusters copy verbatim.
DEFAULT_LABEL_RULES: tuple[LabelRule, ...] = (
    # region
    LabelRule("topology.kubernetes.io/region", "region", "Kubernetes well-known label"),
    LabelRule("failure-domain.beta.kubernetes.io/region", "region", "Kubernetes, deprecated since 1.17"),
    # availability zone
    LabelRule("topology.kubernetes.io/zone", "az", "Kubernetes well-known label"),
    LabelRule("failure-domain.beta.kubernetes.io/zone", "az", "Kubernetes, deprecated since 1.17"),
    # spine (pod / block): second switch tier
    LabelRule("fabric.topograph.run/tier-1", "spine", "NVIDIA topograph v1.x"),
    LabelRule("network.topology.nvidia.com/spine", "spine", "NVIDIA topograph v0.x"),
    LabelRule("cloud.google.com/gce-topology-block", "spine", "GKE (Kueue TAS gke-default level 1)"),
    LabelRule("topology.k8s.aws/network-node-layer-2", "spine", "EKS instance topology, middle layer"),
    LabelRule("cloud.provider.com/topology-block", "spine", "Kueue TAS / KAI docs example"),
    # leaf (ToR / rail group): first switch tier
    LabelRule("fabric.topograph.run/tier-0", "leaf", "NVIDIA topograph v1.x"),
    LabelRule("network.topology.nvidia.com/leaf", "leaf", "NVIDIA topograph v0.x"),
    LabelRule("network.topology.nvidia.com/block", "leaf", "NVIDIA topograph v0.1 (block = leaf switch)"),
    LabelRule("cloud.google.com/gce-topology-subblock", "leaf", "GKE (Kueue TAS gke-default level 2)"),
    LabelRule("topology.k8s.aws/network-node-layer-3", "leaf", "EKS instance topology, bottom layer (3-layer types)"),
    LabelRule("cloud.provider.com/topology-rack", "leaf", "Kueue TAS / KAI docs example"),
    # rack: informational, shown by `phalanx topology`
    LabelRule("cloud.provider.com/topology-rack", "rack", "Kueue TAS / KAI docs example"),
    LabelRule("cloud.google.com/gce-topology-subblock", "rack", "GKE (a sub-block is a rack)"),
    # multi-node NVLink domain (GB200 NVL72): only fills in when NVML reports none
    LabelRule("nvidia.com/gpu.clique", "nvlink_domain", "NVIDIA GPU Operator (GFD/DRA); KAI default"),
    LabelRule("accelerator.topograph.run/domain", "nvlink_domain", "NVIDIA topograph v1.x"),
    LabelRule("network.topology.nvidia.com/accelerator", "nvlink_domain", "NVIDIA topograph v0.x"),
)

# Labels deliberately left unmapped (see module docstring); documented so
# nobody "fixes" them into a level they do not mean.
UNMAPPED_LABELS: Mapping[str, str] = {
    "fabric.topograph.run/tier-2": "topograph v1.x core tier, above the spine",
    "network.topology.nvidia.com/core": "topograph v0.x core tier, above the spine",
    "network.topology.nvidia.com/datacenter": "topograph v0.1 datacenter tier, above the spine",
    "accelerator.topograph.run/sub-domain": "topograph v1.x partition inside an NVLink domain",
    "cloud.google.com/gce-topology-host": "GKE physical host id, below the leaf",
    "topology.k8s.aws/network-node-layer-1": "EKS top layer, above the spine",
    "topology.k8s.aws/network-node-layer-4": "EKS bottom layer on 4-layer instance types (finer than leaf)",
    "kubernetes.io/hostname": "the node itself",
}


def location_from_labels(labels: Mapping[str, str], rules: Sequence[LabelRule] = DEFAULT_LABEL_RULES) -> dict[str, str]:
    """Location fields found in ``labels``: first matching rule per field."""
    found: dict[str, str] = {}
    for rule in rules:
        if rule.field in found:
            continue
        value = labels.get(rule.key, "").strip()
        if value:
            found[rule.field] = value
    return found


class LabelSource:
    """``TopologySource`` over the node's labels."""

    name = LABELS

    def __init__(self, labels: Mapping[str, str], rules: Sequence[LabelRule] = DEFAULT_LABEL_RULES) -> None:
        self.labels = dict(labels)
        self.rules = tuple(rules)

    def discover(self) -> PartialTopology:
        return PartialTopology(LABELS, location=location_from_labels(self.labels, self.rules), labels=self.labels)


class StaticSource:
    """``TopologySource`` over values the operator wrote in the agent's
    config. They outrank labels: an operator's explicit word beats a label
    some other controller may have stamped."""

    name = STATIC

    def __init__(self, **location: str) -> None:
        unknown = set(location) - set(LOCATION_FIELDS)
        if unknown:
            raise ValueError(f"unknown static location fields {sorted(unknown)}; expected {LOCATION_FIELDS}")
        self.location = {k: v.strip() for k, v in location.items() if v and v.strip()}

    def discover(self) -> PartialTopology:
        return PartialTopology(STATIC, location=dict(self.location))
