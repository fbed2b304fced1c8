"""What the coordinator's servicers use of the replica that serves them.

``coordinator.server.Coordinator`` builds the servicers and satisfies
``ServingContext``; the servicers (``coordinator/service.py``,
``coordinator/agents.py``) are typed by it, not by the Coordinator, so they
do not import ``coordinator/server.py`` (tests/unit/test_import_graph.py).
"""

from __future__ import annotations

from typing import Callable, Protocol

import grpc

from coordinator.broadcast import Broadcaster
from coordinator.config import CoordinatorConfig
from coordinator.etcd_space import EtcdSpaceWatch
from coordinator.leader import AzLeader
from coordinator.policy_store import PolicyCache
from coordinator.throttle import Throttle
from coordinator.tokens import TokenSource
from phalanx.store import Store
from phalanx.tls import ServerCredentialsSource


class ServingContext(Protocol):
    """The replica's parts a servicer reads; ``leader`` is the current one
    (None while this replica does not lead), ``tls_source`` None when it
    serves plaintext, ``tokens`` None without ``--token-file``."""

    config: CoordinatorConfig
    store: Store
    leader: AzLeader | None
    tls_source: ServerCredentialsSource | None
    tokens: TokenSource | None
    policies: PolicyCache
    throttle: Throttle
    fanout: Broadcaster
    space_watch: EtcdSpaceWatch
    wall: Callable[[], float]

    def peer_channel(self, address: str) -> grpc.aio.Channel: ...
