"""Who may read which token records through ``AgentService.ReadToken``
(docs/design.md §9.3 "Where the token check reads"; pure).

A coordinator replica of ``az`` answers an agent's read of ``leader/<az>``
and, for a start, ``reservations/<az>/<gang>``: only to an agent
certificate (bound to ``az`` when it names an AZ), only for its own AZ,
and the reservation only when it places a member on the certificate's node.
Everything else is PERMISSION_DENIED naming the check; a refused read
returns no record.
"""

from __future__ import annotations

from typing import Any

from coordinator.core.peer_auth import Code, Refusal, session_refusal
from phalanx.certs import Identity

SERVICE = "AgentService.ReadToken"
MAX_GANG_CHARS = 256


def caller_refusal(identity: Identity | None, az: str, requested_az: str, gang: str) -> Refusal | None:
    """Before any read: the role, the certificate's AZ, the gang id, the AZ
    asked for.
    ``identity`` None: a plaintext coordinator checks nothing."""
    if identity is not None:
        r = session_refusal(identity, None, az)
        if r is not None:
            return Refusal(r.code, r.message.replace("AgentService.Session", SERVICE).replace("register: ", "token read: "))
    if len(gang) > MAX_GANG_CHARS or "/" in gang or not gang.isprintable():
        return Refusal(Code.INVALID_ARGUMENT,
                       f"token read: gang {gang[:64]!r}: not a gang id (at most {MAX_GANG_CHARS} printable "
                       "characters, no '/')")
    if requested_az != az:
        return Refusal(Code.PERMISSION_DENIED,
                       f"token read: az {requested_az!r}: this coordinator serves {az!r} and reads only its records")
    return None


def reservation_refusal(identity: Identity | None, gang: str, record: Any) -> Refusal | None:
    """After the read, before the answer: the reservation (its JSON, None
    when absent) must place a member on the caller's node. An absent record
    is answered as absent (the agent starts nothing on it); one that does
    not name the node, or cannot be read as one, is refused. A plaintext
    coordinator checks nothing."""
    if identity is None or record is None:
        return None
    nodes = record.get("nodes") if isinstance(record, dict) else None
    if isinstance(nodes, dict) and identity.node in nodes:
        return None
    return Refusal(Code.PERMISSION_DENIED,
                   f"token read: reservation of {gang!r} places no member on node {identity.node!r} "
                   f"(agent certificate {identity.name!r})")
