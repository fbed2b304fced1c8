"""Typed Python SDK for the GangService API (docs/cli.md "Python SDK").

Two clients with the same methods:

- :class:`AsyncClient` over ``grpc.aio`` — use it from asyncio code
  (``async_client.py``).
- :class:`Client` — a blocking facade that runs one private :class:`AsyncClient`
  on its own event loop in a background daemon thread (``blocking.py``).
  Chosen over the sync gRPC stubs so that failover, deadlines, idempotent
  submit retries and watch resumption exist in exactly one place.

The package, by responsibility (docs/design.md §2):

- ``config.py``: where a client finds its coordinators and credentials
  (``ClientConfig``, ``Connection``, ``resolve_connection``,
  ``connection_settings``, ``client_tls``, ``parse_addresses``);
- ``tokens.py``: bearer tokens (``resolve_token``, ``read_token_file``);
- ``failover.py``: the retry schedule (every call has one deadline; an
  attempt that finds no coordinator moves to the next address) and the
  translation of gRPC errors into :mod:`phalanx.errors`, each naming the
  cluster and coordinator that answered; its docstring says why the SDK does
  its own failover;
- ``specs.py``: a spec checked locally before it is sent (a spec that fails
  validation raises :class:`phalanx.spec.InvalidSpec` and is never sent).

Every name is importable from ``phalanx.client`` as before the split. Importing
it loads gRPC, but neither ``cryptography`` nor ``phalanx.certs``
(tests/unit/test_cli_startup.py).
"""

from __future__ import annotations

from phalanx.client.async_client import AsyncClient, SubmitResult, TerminalStateReached
from phalanx.client.blocking import Client
from phalanx.client.config import (
    NO_CREDENTIALS,
    ClientConfig,
    ClientConfigError,
    Connection,
    client_tls,
    config_path,
    connection_settings,
    default_address,
    default_tls_dir,
    parse_address,
    parse_addresses,
    parse_client_config,
    read_client_config,
    resolve_connection,
)
from phalanx.client.failover import unreachable_reason
from phalanx.client.specs import SpecLike, spec_yaml, to_spec
from phalanx.client.tokens import (
    MAX_TOKEN_BYTES,
    TOKEN_ENV,
    TOKEN_NEEDS_TLS,
    read_token_file,
    resolve_token,
    token_credentials,
)
from phalanx.client_names import (  # re-exported: the SDK's names
    ADDRESS_ENV,
    CONFIG_ENV,
    DEFAULT_ADDRESS,
    DEFAULT_CONFIG,
    INSECURE_ENV,
    MAX_LIMIT,
    MAX_MESSAGE_BYTES,
    MAX_TIMEOUT_S,
    TLS_CA_FILE,
    TLS_CERT_FILE,
    TLS_DIR_ENV,
    TLS_KEY_FILE,
    StateLike,
    check_timeout,
    is_terminal,
    parse_states,
    state_name,
)

__all__ = [
    "AsyncClient",
    "Client",
    "SubmitResult",
    "TerminalStateReached",
    "ADDRESS_ENV",
    "TLS_DIR_ENV",
    "CONFIG_ENV",
    "INSECURE_ENV",
    "ClientConfig",
    "ClientConfigError",
    "Connection",
    "parse_client_config",
    "resolve_connection",
    "connection_settings",
    "DEFAULT_ADDRESS",
    "MAX_LIMIT",
    "MAX_MESSAGE_BYTES",
    "MAX_TIMEOUT_S",
    "default_address",
    "parse_addresses",
    "parse_states",
    "state_name",
    "is_terminal",
]
