"""``phalanx topology``'s tree (phalanx/topology_view.py)."""

from __future__ import annotations

import random

from agent.topology import simulated_fabric, simulated_node
from phalanx.topology_view import NodeEntry, render_tree


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
    assert render_tree(fleet(), devices=False) == """\
fleet: 2 AZs, gpus 1 free / 3 used / 6 total (2 down), nodes 3/4 ready
├─ az az-a: gpus 1 free / 1 used / 4 total (2 down), nodes 2/3 ready
│  ├─ spine -: gpus 0 free / 0 used / 0 total, nodes 1/1 ready
│  │  └─ leaf -: gpus 0 free / 0 used / 0 total, nodes 1/1 ready
│  │     └─ node cpu-1 [ready] gpus 0 free / 0 used / 0 total
│  └─ spine s1: gpus 1 free / 1 used / 4 total (2 down), nodes 1/2 ready
│     └─ leaf l1: gpus 1 free / 1 used / 4 total (2 down), nodes 1/2 ready
│        ├─ node node-9 [NOT READY] gpus 0 free / 0 used / 2 total (2 down), nvlink domain nvl-0
│        └─ node node-10 [ready] gpus 1 free / 1 used / 2 total
└─ az az-b: gpus 0 free / 2 used / 2 total, nodes 1/1 ready
   └─ spine s0: gpus 0 free / 2 used / 2 total, nodes 1/1 ready
      └─ leaf l0: gpus 0 free / 2 used / 2 total, nodes 1/1 ready
         └─ node node-1 [ready] gpus 0 free / 2 used / 2 total"""


def test_counts_add_up_on_a_large_fleet() -> None:
    """Counts worked out by hand, not by the code under test. Entry k (az-a
    k = 0..63, 8 GPUs each; az-b k = 64..79, 4 GPUs each) uses GPUs
    0..k%3-1 and is down when k%5 == 0.
    - total: 64*8 + 16*4 = 576 (az-a 512, az-b 64).
    - used: sum of k%3 over k < 80 = 26*3 + (0 + 1) = 79 (az-a 63, az-b 16),
      ready or not.
    - down nodes k = 5j, j = 0..15 (az-a j <= 12: 13 nodes, az-b 65, 70, 75):
      nodes 64/80 ready (az-a 51/64, az-b 13/16); their used GPUs, (2j)%3:
      az-a 12, az-b 2 + 1 + 0 = 3.
    - free = ready GPUs - used on ready nodes: az-a 51*8 - (63-12) = 357,
      az-b 13*4 - (16-3) = 39; fleet 396.
    - down = total - used - free: az-a 92, az-b 9, fleet 101.
    - az-b's leaf-0-0 holds k = 64..71: used 1+2+0+1+2+0+1+2 = 9, down nodes
      65 (2 used) and 70 (1 used): free 6*4 - 6 = 18, down 32 - 9 - 18 = 5."""
    nodes = simulated_fabric("az-a", 64, 2, 4) + simulated_fabric("az-b", 16, 1, 2, gpus=4, nics=4)
    entries = [(n, frozenset(range(k % 3)), k % 5 != 0) for k, n in enumerate(nodes)]
    lines = render_tree(entries, devices=False).splitlines()
    assert lines[0] == "fleet: 2 AZs, gpus 396 free / 79 used / 576 total (101 down), nodes 64/80 ready"
    assert "├─ az az-a: gpus 357 free / 63 used / 512 total (92 down), nodes 51/64 ready" in lines
    assert "└─ az az-b: gpus 39 free / 16 used / 64 total (9 down), nodes 13/16 ready" in lines
    assert "   └─ spine spine-0: gpus 39 free / 16 used / 64 total (9 down), nodes 13/16 ready" in lines
    assert "      ├─ leaf leaf-0-0: gpus 18 free / 9 used / 32 total (5 down), nodes 6/8 ready" in lines
    assert "      │  ├─ node az-b-n001 [NOT READY] gpus 0 free / 2 used / 4 total (2 down)" in lines
    assert "      │  ├─ node az-b-n002 [ready] gpus 4 free / 0 used / 4 total" in lines
    assert sum(1 for line in lines if "─ node " in line) == 80
    assert sum(1 for line in lines if "─ leaf " in line) == 8 + 2
    assert len(lines) == 1 + 2 + (2 + 1) + (8 + 2) + 80


def test_empty_fleet() -> None:
    assert render_tree([]) == "no nodes"
