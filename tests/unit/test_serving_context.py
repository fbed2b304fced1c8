"""The servicers are typed by coordinator/serving.py's ``ServingContext``,
not by the Coordinator that builds them (no import of server.py,
tests/unit/test_import_graph.py): what they read of the replica is a member
of the protocol, and the Coordinator has every member."""

from __future__ import annotations

import ast
import asyncio
import typing
from pathlib import Path

from coordinator.config import CoordinatorConfig
from coordinator.server import Coordinator
from coordinator.serving import ServingContext

REPO = Path(__file__).resolve().parents[2]
SERVICERS = ("service.py", "service_base.py", "node_service.py", "policy_service.py", "agents.py", "peer_service.py")


def members() -> set[str]:
    return set(typing.get_type_hints(ServingContext)) | {n for n in vars(ServingContext) if not n.startswith("_")}


def used(source: str) -> set[str]:
    """Every ``self.c.X`` and ``c.X`` (caller_identity's ``c``) read."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            v = node.value
            if (isinstance(v, ast.Attribute) and v.attr == "c" and isinstance(v.value, ast.Name)
                    and v.value.id == "self") or (isinstance(v, ast.Name) and v.id == "c"):
                out.add(node.attr)
    return out


def test_the_servicers_use_only_the_protocols_members() -> None:
    for name in SERVICERS:
        extra = used((REPO / "coordinator" / name).read_text()) - members()
        assert not extra, f"coordinator/{name} uses {sorted(extra)} of the replica: add them to ServingContext"


def test_used_finds_what_a_servicer_reads() -> None:
    assert used("self.c.config.az\nc.tls_source\nself.store.keys\n") == {"config", "tls_source"}


def test_the_coordinator_has_every_member() -> None:
    async def build() -> Coordinator:  # (its watch and throttle want a running loop)
        return Coordinator(CoordinatorConfig(cluster="c", az="a", coordinator_id="x", etcd=("127.0.0.1:1",)))

    c = asyncio.run(build())
    assert not [m for m in sorted(members()) if not hasattr(c, m)]
    assert callable(c.peer_channel) and callable(c.wall)
