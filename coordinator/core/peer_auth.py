"""Who may speak to the leader as an agent or as a peer (pure decisions).

The coordinator's thin drivers (coordinator/agents.py, the CoordinatorPeer
servicer in coordinator/server.py, AzLeader's member reports) read the
caller's certificate identity and the etcd state and ask these functions; a
refusal is returned, never raised, so each decision is a table row in
tests/unit/test_peer_auth.py. ``identity`` is None for a plaintext
coordinator (no --tls-dir): nothing is checked then, as before TLS existed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from phalanx.certs import CHECK_WRONG_CLUSTER, Identity


class Code(enum.Enum):
    """How a refusal is answered: the gRPC status of the same name (the
    drivers map it, coordinator/refusals.py; a core imports no gRPC)."""

    INVALID_ARGUMENT = enum.auto()
    UNAUTHENTICATED = enum.auto()
    PERMISSION_DENIED = enum.auto()
    FAILED_PRECONDITION = enum.auto()


@dataclass(frozen=True)
class Refusal:
    code: Code
    message: str


def _who(identity: Identity) -> str:
    return f"{identity.role} certificate {identity.name!r}"


def identity_refusal(service: str, check: str, detail: str) -> Refusal:
    """A call whose certificate names no usable identity. Another cluster's
    certificate is a known caller with no right here (PERMISSION_DENIED);
    anything else means the caller is not established (UNAUTHENTICATED)."""
    code = Code.PERMISSION_DENIED if check == CHECK_WRONG_CLUSTER else Code.UNAUTHENTICATED
    return Refusal(code, f"{service}: the client certificate is refused: {check}: {detail}")


def session_refusal(identity: Identity | None, node: str | None, az: str) -> Refusal | None:
    """AgentService.Session registering as ``node`` at the leader of ``az``:
    only an agent certificate, only one bound to ``az`` (when it names an
    AZ: certificates issued before the binding name none), and only for the
    node it names (``node`` None: before the registration is read, the role
    and the AZ alone)."""
    if identity is None:
        return None
    if identity.role != "agent":
        return Refusal(Code.PERMISSION_DENIED,
                       f"AgentService.Session needs an agent certificate; the caller presented a {_who(identity)}")
    if identity.az is not None and identity.az != az:
        return Refusal(Code.PERMISSION_DENIED,
                       f"register: agent certificate {identity.name!r} is bound to AZ {identity.az!r}; "
                       f"this coordinator serves {az!r}")
    if node is not None and identity.node != node:
        return Refusal(Code.PERMISSION_DENIED,
                       f"register: agent certificate {identity.name!r} is for node {identity.node!r}, "
                       f"the registration names node {node!r}")
    return None


def replacement_refusal(node: str, current: Identity | None, new: Identity | None) -> Refusal | None:
    """A second live session for ``node`` replaces the first only when it
    carries the same identity (the same agent reconnecting, or its renewed
    certificate); another certificate for the same node waits until the
    first session ends. Plaintext sessions (None) replace as they always did."""
    if current is None or new is None or current == new:
        return None
    return Refusal(Code.PERMISSION_DENIED,
                   f"register: node {node!r} has a live session of agent certificate {current.name!r}; "
                   f"agent certificate {new.name!r} may not replace it")


def member_refusal(reporting_node: str, gang: str, rank: int, placed_node: str | None) -> str | None:
    """A member report is taken only from the node the member is placed on
    (``placed_node``: where this AZ's placement puts ``rank`` of ``gang``;
    None when it puts it nowhere in this AZ). The reason, or None."""
    if placed_node == reporting_node:
        return None
    where = f"placed on {placed_node!r}" if placed_node is not None else "not placed in this AZ"
    return f"member {gang} rank {rank} reported by node {reporting_node!r} is {where}"


def peer_refusal(identity: Identity | None, cluster: str) -> Refusal | None:
    """CoordinatorPeer: only a coordinator certificate of this cluster."""
    if identity is None:
        return None
    if identity.cluster != cluster:
        return Refusal(Code.PERMISSION_DENIED,
                       f"CoordinatorPeer: the caller's {_who(identity)} is of cluster {identity.cluster!r}, not {cluster!r}")
    if identity.role != "coordinator":
        return Refusal(Code.PERMISSION_DENIED,
                       f"CoordinatorPeer accepts only coordinator certificates; the caller presented a {_who(identity)}")
    return None


def leader_refusal(identity: Identity | None, az: str, epoch: int, leader: tuple[str, int] | None) -> Refusal | None:
    """The caller speaks for ``az`` at ``epoch``; ``leader`` is what etcd's
    leader key of that AZ holds now (coordinator id, create revision), None
    when there is none. The certificate's name must be that leader's id and
    the epoch its epoch (the participant re-reads the epoch with the records
    it checks, so a name checked here belongs to the epoch checked there)."""
    if identity is None:
        return None
    if identity.az is not None and identity.az != az:
        return Refusal(Code.PERMISSION_DENIED,
                       f"CoordinatorPeer: coordinator certificate {identity.name!r} is bound to AZ {identity.az!r}, "
                       f"the call speaks for {az or '?'}")
    if leader is None:
        return Refusal(Code.PERMISSION_DENIED,
                       f"CoordinatorPeer: coordinator {identity.name!r} speaks for {az or '?'}, which has no leader")
    leader_id, leader_epoch = leader
    if identity.name != leader_id:
        return Refusal(Code.PERMISSION_DENIED,
                       f"CoordinatorPeer: coordinator {identity.name!r} is not the leader of {az} (its leader is {leader_id!r})")
    if epoch != leader_epoch:
        return Refusal(Code.PERMISSION_DENIED,
                       f"CoordinatorPeer: coordinator {identity.name!r} claims epoch {epoch} of {az}; "
                       f"its leadership is epoch {leader_epoch}")
    return None
