"""The client's names and pure helpers that need neither gRPC nor protobuf:
environment variables, defaults, bounds, state names. ``phalanx.client``
re-exports them; the CLI imports them from here, so that ``--help``,
``--version`` and a usage error start without loading gRPC (docs/cli.md
"Start-up time")."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from phalanx.model import TERMINAL_STATES, GangState

DEFAULT_ADDRESS = "127.0.0.1:7070"
# Where the CLI and the SDK look for the cluster when no address is given.
ADDRESS_ENV = "PHALANX_ADDRESS"
# A directory with the client's TLS files (docs/security.md): the cluster's
# CA certificate and this client's certificate and key, under these names.
TLS_DIR_ENV = "PHALANX_TLS_DIR"
TLS_CA_FILE = "ca.crt"
TLS_CERT_FILE = "client.crt"
TLS_KEY_FILE = "client.key"
# A kubeconfig-style file: which cluster, its coordinators, the TLS dir.
CONFIG_ENV = "PHALANX_CONFIG"
DEFAULT_CONFIG = "~/.config/phalanx/config.yaml"
# Plaintext is never a default: only insecure=True, --insecure or this.
INSECURE_ENV = "PHALANX_INSECURE"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# A call's deadline: gRPC turns a deadline of about 1e11 s or more into "no
# deadline" (an overflow), so a typo would hang for ever; an hour is far
# beyond any failover this client does.
MAX_TIMEOUT_S = 3600.0
# ListGangsRequest.limit is an int32.
MAX_LIMIT = 2**31 - 1

StateLike = GangState | int | str


def check_timeout(value: float, what: str = "timeout") -> float:
    """A call deadline in seconds: (0, MAX_TIMEOUT_S]. Raises ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number of seconds, got {value!r}")
    if not (0 < value <= MAX_TIMEOUT_S):  # also refuses NaN
        raise ValueError(f"{what} must be greater than 0 and at most {MAX_TIMEOUT_S:g} seconds, got {value:g}")
    return float(value)


def parse_states(states: Collection[StateLike] | StateLike | None) -> frozenset[GangState]:
    """Accept ``GangState``, wire enum ints, or names (``"running"``,
    ``"GANG_STATE_RUNNING"``). Raises ValueError naming a bad one."""
    if states is None:
        return frozenset()
    if isinstance(states, (str, int)):
        states = [states]
    out: set[GangState] = set()
    for s in states:
        if isinstance(s, GangState):
            out.add(s)
        elif isinstance(s, int) and not isinstance(s, bool):
            try:
                out.add(GangState(s))
            except ValueError:
                raise ValueError(f"unknown gang state {s}") from None
        elif isinstance(s, str):
            text = s.strip().upper()
            if text.startswith("GANG_STATE_"):
                text = text[len("GANG_STATE_"):]
            out.add(GangState.parse(text))
        else:
            raise ValueError(f"unknown gang state {s!r}")
    return frozenset(out)


def state_name(gang: Any) -> str:
    """``"RUNNING"`` etc. of a ``pb.Gang``; ``"UNSPECIFIED"`` for a gang without a state."""
    try:
        return GangState(gang.state).name
    except ValueError:
        return "UNSPECIFIED"


def is_terminal(gang: Any) -> bool:
    return gang.state in {int(s) for s in TERMINAL_STATES}
