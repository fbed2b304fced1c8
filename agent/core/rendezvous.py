"""The rank-0 agent's check of a gang's MASTER_PORT (docs/launcher.md). Pure."""

from __future__ import annotations

from typing import Mapping


def port_refusal(port: int, node: str, gang: str, held: Mapping[str, int], bind_error: str | None,
                 ports: tuple[int, int]) -> str:
    """Why rank 0 of ``gang`` may not start with ``MASTER_PORT=port`` on this
    node, or "" when it may.

    ``held``: gang -> port of the live rank-0 members this agent runs (a
    member that has not bound its port yet still has it); ``bind_error``: what
    a test bind of the port said (None: free); ``ports``: the range this
    agent owns. A port outside the range is refused too: the leader picks from
    the advertised range, so another one means a stale or foreign word."""
    first, last = ports
    if not first <= port <= last:
        return f"MASTER_PORT {port} is outside the rendezvous ports {first}-{last} of node {node}"
    for other, p in sorted(held.items()):
        if p == port and other != gang:
            return f"MASTER_PORT {port} on node {node} is held by rank 0 of gang {other}"
    if bind_error is not None:
        return f"MASTER_PORT {port} on node {node} is in use ({bind_error})"
    return ""
