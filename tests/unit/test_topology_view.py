"""``phalanx topology``'s tree (phalanx/topology_view.py)."""

from __future__ import annotations

import random

from agent.topology import simulated_fabric, simulated_node
from phalanx.topology_view import NodeEntry, node_counts, render_tree


def fleet() -> list[NodeEntry]:
    return [
        (simulated_node("node-10", "az-a", spine="s1", leaf="l1", gpus=2, nics=1, islands=2), frozenset({1, 7}), True),
        (simulated_node("node-9", "az-a", spine="s1", leaf="l1", gpus=2, nics=1, nvlink_domain="nvl-0"), frozenset(), False),
        (simulated_node("cpu-1", "az-a", gpus=0, nics=1, rail_optimised=False), frozenset(), True),
        (simulated_node("node-1", "az-b", spine="s0", leaf="l0", gpus=2, nics=1, model="L40S"), frozenset({0, 1}), True),
    ]


EXPECTED = """\
fleet: 2 AZs, gpus 1 free / 3 used / 6 total (2 down), nodes 3/4 ready
├─ az az-a: gpus 1 free / 1 used / 4 total (2 down), nodes 2/3 ready
│  ├─ spine -: gpus 0 free / 0 used / 0 total, nodes 1/1 ready
│  │  └─ leaf -: gpus 0 free / 0 used / 0 total, nodes 1/1 ready
│  │     └─ node cpu-1 [ready] gpus 0 free / 0 used / 0 total
│  │        └─ nic mlx5_0 400G RoCE rail - ACTIVE
│  └─ spine s1: gpus 1 free / 1 used / 4 total (2 down), nodes 1/2 ready
│     └─ leaf l1: gpus 1 free / 1 used / 4 total (2 down), nodes 1/2 ready
│        ├─ node node-9 [NOT READY] gpus 0 free / 0 used / 2 total (2 down), nvlink domain nvl-0
│        │  ├─ gpu 0 H100 island 0 numa 0 down
│        │  ├─ gpu 1 H100 island 0 numa 1 down
│        │  └─ nic mlx5_0 400G RoCE rail 0 ACTIVE
│        └─ node node-10 [ready] gpus 1 free / 1 used / 2 total
│           ├─ gpu 0 H100 island 0 numa 0 free
│           ├─ gpu 1 H100 island 1 numa 1 used
│           └─ nic mlx5_0 400G RoCE rail 0 ACTIVE
└─ az az-b: gpus 0 free / 2 used / 2 total, nodes 1/1 ready
   └─ spine s0: gpus 0 free / 2 used / 2 total, nodes 1/1 ready
      └─ leaf l0: gpus 0 free / 2 used / 2 total, nodes 1/1 ready
         └─ node node-1 [ready] gpus 0 free / 2 used / 2 total
            ├─ gpu 0 L40S island 0 numa 0 used
            ├─ gpu 1 L40S island 0 numa 1 used
            └─ nic mlx5_0 400G RoCE rail 0 ACTIVE"""


def test_tree_with_counts_at_every_level() -> None:
    """Natural order (node-9 before node-10), a missing spine/leaf as "-", a
    not-ready node's GPUs "down", a stale used index (7) ignored."""
    assert render_tree(fleet()) == EXPECTED


def test_order_does_not_depend_on_input_order() -> None:
    entries = fleet()
    random.Random(7).shuffle(entries)
    assert render_tree(entries) == EXPECTED


def test_without_devices_only_the_hierarchy_is_printed() -> None:
    text = render_tree(fleet(), devices=False)
    assert text.splitlines() == [line for line in EXPECTED.splitlines() if "─ gpu " not in line and "─ nic " not in line]


def test_counts_add_up_on_a_large_fleet() -> None:
    nodes = simulated_fabric("az-a", 64, 2, 4) + simulated_fabric("az-b", 16, 1, 2, gpus=4, nics=4)
    entries = [(n, frozenset(range(k % 3)), k % 5 != 0) for k, n in enumerate(nodes)]
    text = render_tree(entries, devices=False)
    total = sum(len(n.gpus) for n in nodes)
    used = sum(node_counts(*e).used for e in entries)
    free = sum(node_counts(*e).free for e in entries)
    assert text.splitlines()[0] == f"fleet: 2 AZs, gpus {free} free / {used} used / {total} total ({total - used - free} down), nodes 64/80 ready"
    assert sum(1 for line in text.splitlines() if "─ node " in line) == 80
    assert sum(1 for line in text.splitlines() if "─ leaf " in line) == 8 + 2


def test_empty_fleet() -> None:
    assert render_tree([]) == "no nodes"
