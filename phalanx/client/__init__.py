"""Typed Python SDK for the GangService API (docs/cli.md "Python SDK").

Two clients with the same methods:

- :class:`AsyncClient` over ``grpc.aio`` — use it from asyncio code.
- :class:`Client` — a blocking facade that runs one private :class:`AsyncClient`
  on its own event loop in a background daemon thread. Chosen over the sync
  gRPC stubs so that failover, deadlines, idempotent submit retries and watch
  resumption exist in exactly one place.

Failover and deadlines
----------------------
``addresses`` lists coordinators (any replica of any AZ can answer reads;
standbys forward writes to their leader). Every call has one overall deadline,
``timeout`` seconds. An attempt that fails with ``UNAVAILABLE`` (coordinator
down, or cut off from etcd) or runs out of its share of the deadline is
repeated on the next address, with a short backoff after a full round, until
the call's deadline (``tenacity``, stopped by that deadline). Each attempt gets
a share of the time left (split over the addresses not yet tried), so one hung
coordinator cannot eat the whole deadline while another could answer. A
``cancel`` that loses a race with another write of the gang (ABORTED) is
retried too, within the same deadline.

Retrying is safe because every GangService RPC is idempotent:
reads trivially, ``cancel`` by nature, and ``submit`` because the client sends
an idempotency key — generated once per ``submit`` call when the caller gives
none — and reuses it on every retry of that call, so a retried submit whose
first attempt did reach etcd returns the same gang (``created=False``) instead
of creating a second one.

Why not the channel's retry service config: the addresses are
separate servers on separate channels, an up-but-partitioned coordinator
answers UNAVAILABLE on every retry of its own channel, and ``watch`` needs
resumption on another server, which a retry policy cannot do for a stream that
has already delivered messages.

Errors
------
gRPC status codes become the typed errors of :mod:`phalanx.errors` via
``from_status``; an error a coordinator answered also says which cluster and
coordinator answered (``.cluster``, ``.coordinator``, ``.address``). A spec that fails local validation raises
:class:`phalanx.spec.InvalidSpec` and is never sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import re
import threading
import time
from pathlib import Path
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import grpc
import grpc.aio
import yaml
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from phalanx.errors import CLUSTER_METADATA, COORDINATOR_METADATA, Conflict, FailedPrecondition, PhalanxError, from_status
from phalanx.model import GangState
from phalanx.spec import FieldError, GangSpec, InvalidSpec, load_spec, parse_spec
from phalanx.cert_names import coordinator_server_name
from phalanx.tls import (
    TlsError, TlsFiles, ca_pem_cluster, client_pems, looks_like_handshake, pem_channel, probe_server, utc_now,
)
from phalanx.v1 import gang_pb2, gang_pb2_grpc
from phalanx.v1 import types_pb2 as pb
from phalanx.wire import spec_from_pb, spec_to_pb

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

from phalanx.client_names import (  # noqa: E402 (re-exported: the SDK's names)
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

# Reconnect quickly after a coordinator restarts: gRPC's default backoff grows
# to 120 s, during which a channel fails every call without trying to connect.
_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
# Below this an attempt is pointless; the last attempt always gets what is left.
_MIN_ATTEMPT_S = 1.0
_BACKOFF_START_S = 0.1
# A write that lost a race is retried sooner: the other write has landed.
_CONFLICT_BACKOFF_START_S = 0.05
_BACKOFF_MAX_S = 1.0
# Stream errors after which a watch resumes on another address.
_RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
# WatchEvents' response header: resumed, gap or new (docs/events.md "Bounds and resume").
_RESUME_HEADER = "x-phalanx-resume"

T = TypeVar("T")
SpecLike = GangSpec | pb.GangSpec | Mapping[str, Any] | str


@dataclasses.dataclass(frozen=True)
class SubmitResult:
    """Outcome of ``submit``: the gang as stored, and whether this call created
    it (``False`` when the idempotency key matched an earlier submission)."""

    gang: pb.Gang
    created: bool


class TerminalStateReached(PhalanxError):
    """``wait`` gave up early: the gang reached a terminal state the caller did
    not ask for (e.g. FAILED while waiting for RUNNING), so the wanted state can
    never come. ``gang`` is the gang as last seen."""

    code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, gang: pb.Gang, wanted: Collection[GangState]):
        self.gang = gang
        self.state = GangState(gang.state)
        self.wanted = frozenset(wanted)
        reason = f" ({gang.reason})" if gang.reason else ""
        want = " or ".join(sorted(s.name for s in self.wanted))
        super().__init__(f"gang {gang.id} reached {self.state.name}{reason} instead of {want}")


# --- small helpers ------------------------------------------------------------


_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]+)")


def default_address() -> str:
    """What an address-less client talks to: ``$PHALANX_ADDRESS``, else
    ``127.0.0.1:7070`` (the CLI's ``--address`` default too)."""
    return os.environ.get(ADDRESS_ENV, "").strip() or DEFAULT_ADDRESS


def default_tls_dir() -> str:
    """``$PHALANX_TLS_DIR`` ("" = not set)."""
    return os.environ.get(TLS_DIR_ENV, "").strip()


# --- where a client finds its coordinators and credentials ----------------------------


class ClientConfigError(ValueError):
    """No usable credentials, or a config file / variable that cannot be
    used: the message names the file or variable, the field and the reason."""


_CONFIG_FIELDS = ("cluster", "addresses", "tls_dir", "insecure")


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """What a config file says (``$PHALANX_CONFIG``, default
    ``~/.config/phalanx/config.yaml``)::

        cluster: prod                 # optional: checked against tls_dir's CA
        addresses: [10.0.0.1:7070, 10.0.0.2:7070]
        tls_dir: prod-admin           # ca.crt, client.crt, client.key; relative to this file
        # insecure: true              # instead of tls_dir: plaintext
    """

    path: Path
    cluster: str | None = None
    addresses: tuple[str, ...] | None = None
    tls_dir: Path | None = None
    insecure: bool = False


def parse_client_config(text: str, path: Path) -> ClientConfig:
    """The config file's content, checked (pure: the text is passed in).
    ClientConfigError names the file and the field."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ClientConfigError(f"{path}: not YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ClientConfigError(f"{path}: must be a mapping of {', '.join(_CONFIG_FIELDS)}, got {type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in _CONFIG_FIELDS)
    if unknown:
        raise ClientConfigError(f"{path}: unknown field(s) {', '.join(unknown)}; known: {', '.join(_CONFIG_FIELDS)}")
    cluster = data.get("cluster")
    if cluster is not None and (not isinstance(cluster, str) or not cluster.strip()):
        raise ClientConfigError(f"{path}: cluster: must be a non-empty string, got {cluster!r}")
    addresses = None
    if data.get("addresses") is not None:
        raw = data["addresses"]
        if isinstance(raw, str):
            raw = [raw]
        if not isinstance(raw, list) or not all(isinstance(a, str) for a in raw):
            raise ClientConfigError(f"{path}: addresses: must be a list of host:port strings, got {raw!r}")
        try:
            addresses = parse_addresses(raw)
        except ValueError as exc:
            raise ClientConfigError(f"{path}: addresses: {exc}") from None
    tls_dir = None
    if data.get("tls_dir") is not None:
        raw = data["tls_dir"]
        if not isinstance(raw, str) or not raw.strip():
            raise ClientConfigError(f"{path}: tls_dir: must be a directory path, got {raw!r}")
        tls_dir = (path.parent / Path(raw).expanduser()).resolve() if not Path(raw).expanduser().is_absolute() else Path(raw).expanduser()
    insecure = data.get("insecure", False)
    if not isinstance(insecure, bool):
        raise ClientConfigError(f"{path}: insecure: must be true or false, got {insecure!r}")
    if insecure and tls_dir is not None:
        raise ClientConfigError(f"{path}: tls_dir and insecure: true exclude each other (TLS or plaintext, not both)")
    return ClientConfig(path, cluster.strip() if cluster else None, addresses, tls_dir, insecure)


def _flag(value: str, name: str) -> bool:
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    raise ClientConfigError(f"${name}: must be 1 or 0 (true/false), got {value!r}")


@dataclasses.dataclass(frozen=True)
class Connection:
    """Where a client connects and with what, and where each came from (the
    flag, variable or file, for ``phalanx config`` and for error messages).
    ``tls_dir`` None: plaintext (only ever by an explicit choice)."""

    addresses: tuple[str, ...]
    addresses_from: str
    tls_dir: Path | None
    tls_from: str
    config: ClientConfig | None = None


NO_CREDENTIALS = (
    "no credentials to reach the coordinators: give a TLS directory with ca.crt, client.crt and client.key "
    "({tls_flag} or ${tls_env}), or a config file (${config_env}, default {default_config}: cluster, addresses, "
    "tls_dir), or choose plaintext explicitly ({insecure_flag} or {insecure_env}=1)"
)


def resolve_connection(
    *,
    addresses: str | Sequence[str] | None,
    tls_dir: str | os.PathLike[str] | None,
    insecure: bool,
    env: Mapping[str, str],
    config: ClientConfig | None,
    cli: bool = False,
) -> Connection:
    """The decision (pure): the most explicit source wins, level by level:
    the caller's own arguments (``tls_dir=``/``insecure=``, the CLI's
    ``--tls-dir``/``--insecure``), then the variables (``$PHALANX_TLS_DIR``,
    ``$PHALANX_INSECURE``), then the config file (``tls_dir``, ``insecure``).
    Both TLS and plaintext at one level is an error; nothing at any level is
    the NO_CREDENTIALS error. Addresses: the argument, ``$PHALANX_ADDRESS``,
    the config file's, else 127.0.0.1:7070."""
    tls_flag, insecure_flag, address_flag = ("--tls-dir", "--insecure", "--address") if cli else \
        ("tls_dir=", "insecure=True", "addresses=")
    # The addresses first: a malformed one is named even without credentials.
    env_address = env.get(ADDRESS_ENV, "").strip()
    try:
        if addresses is not None:
            where, found = address_flag, parse_addresses(addresses)
        elif env_address:
            where, found = f"${ADDRESS_ENV}", parse_addresses(env_address)
        elif config is not None and config.addresses:
            where, found = f"{config.path} (addresses)", config.addresses
        else:
            where, found = "the default address", parse_addresses(DEFAULT_ADDRESS)
    except ValueError as exc:
        raise ClientConfigError(f"{address_flag if addresses is not None else '$' + ADDRESS_ENV}: {exc}") from None
    env_tls = env.get(TLS_DIR_ENV, "").strip()
    env_insecure = _flag(env.get(INSECURE_ENV, ""), INSECURE_ENV)
    arg_tls = str(tls_dir).strip() if tls_dir is not None else ""
    levels = [
        (tls_flag, arg_tls or None, insecure_flag, insecure),
        (f"${TLS_DIR_ENV}", env_tls or None, f"{INSECURE_ENV}=1", env_insecure),
    ]
    if config is not None:
        levels.append((f"{config.path} (tls_dir)", str(config.tls_dir) if config.tls_dir else None,
                       f"{config.path} (insecure: true)", config.insecure))
    chosen: tuple[Path | None, str] | None = None
    for tls_name, directory, insecure_name, plain in levels:
        if directory and plain:
            raise ClientConfigError(f"{tls_name} and {insecure_name} exclude each other (TLS or plaintext, not both)")
        if directory:
            chosen = (Path(directory).expanduser(), tls_name)
            break
        if plain:
            chosen = (None, insecure_name)
            break
    if chosen is None:
        raise ClientConfigError(NO_CREDENTIALS.format(
            tls_flag=tls_flag, tls_env=TLS_DIR_ENV, config_env=CONFIG_ENV, default_config=DEFAULT_CONFIG,
            insecure_flag=insecure_flag, insecure_env=INSECURE_ENV))
    return Connection(found, where, chosen[0], chosen[1], config)


def config_path(env: Mapping[str, str]) -> tuple[Path, bool]:
    """The config file to read and whether it was named (``$PHALANX_CONFIG``:
    it must exist) or is the default (read only if it exists)."""
    named = env.get(CONFIG_ENV, "").strip()
    if named:
        return Path(named).expanduser(), True
    return Path(DEFAULT_CONFIG).expanduser(), False


def read_client_config(env: Mapping[str, str]) -> ClientConfig | None:
    """The config file, read and checked (the I/O around parse_client_config)."""
    path, named = config_path(env)
    try:
        text = path.read_text()
    except FileNotFoundError:
        if named:
            raise ClientConfigError(f"${CONFIG_ENV}={path}: no such file") from None
        return None
    except OSError as exc:
        raise ClientConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return parse_client_config(text, path)


def connection_settings(
    addresses: str | Sequence[str] | None = None,
    tls_dir: str | os.PathLike[str] | None = None,
    insecure: bool = False,
    *,
    env: Mapping[str, str] | None = None,
    cli: bool = False,
) -> Connection:
    """resolve_connection with this process's variables and config file.
    The config file is read only when the arguments and the variables do
    not already settle both the credentials and the addresses."""
    env = os.environ if env is None else env
    settled_tls = bool(str(tls_dir or "").strip()) or insecure or bool(env.get(TLS_DIR_ENV, "").strip()) \
        or _flag(env.get(INSECURE_ENV, ""), INSECURE_ENV)
    settled_address = addresses is not None or bool(env.get(ADDRESS_ENV, "").strip())
    config = None if (settled_tls and settled_address and not env.get(CONFIG_ENV, "").strip()) else read_client_config(env)
    return resolve_connection(addresses=addresses, tls_dir=tls_dir, insecure=insecure, env=env, config=config, cli=cli)


def client_tls(directory: str | os.PathLike[str]) -> tuple[TlsFiles, str]:
    """The client's TLS files in ``directory`` and the cluster its CA is
    for, checked now: TlsError names the file and the check (a missing
    file, a key that is not the certificate's, another CA, expired).
    Files that passed before are not parsed again (phalanx.tls.client_pems)."""
    d = Path(directory)
    files = TlsFiles(d / TLS_CA_FILE, d / TLS_CERT_FILE, d / TLS_KEY_FILE)
    return files, client_pems(files)[3]


# --- bearer tokens (docs/security.md "Bearer tokens") -------------------------------

TOKEN_ENV = "PHALANX_TOKEN"
MAX_TOKEN_BYTES = 1024
TOKEN_NEEDS_TLS = ("token: a bearer token is sent only over TLS: give tls_dir= / --tls-dir / $PHALANX_TLS_DIR "
                   "(a directory with the cluster's ca.crt; client.crt/.key are optional with a token)")


def resolve_token(token: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The bearer token to send: ``token``, else ``$PHALANX_TOKEN``; None
    for none. ClientConfigError (never echoing it) for one that is not a
    single printable word."""
    value = (token if token is not None else (os.environ if env is None else env).get(TOKEN_ENV, "")).strip()
    if not value:
        return None
    if not value.isprintable() or any(c.isspace() for c in value) or len(value.encode()) > MAX_TOKEN_BYTES:
        raise ClientConfigError(f"token: must be one word of printable text, at most {MAX_TOKEN_BYTES} bytes")
    return value


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in the file at ``path`` (the CLI's --token-file): its one
    line; ClientConfigError naming the file."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ClientConfigError(f"--token-file: {path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    if not text.strip():
        raise ClientConfigError(f"--token-file: {path}: is empty")
    return text.strip()


def token_credentials(directory: str | os.PathLike[str], token: str) -> tuple[grpc.ChannelCredentials, str]:
    """Channel credentials that verify the coordinator against ``ca.crt``
    in ``directory`` (and present client.crt/.key when they are there) and
    send ``authorization: Bearer <token>`` on every call, and the CA's
    cluster. gRPC itself refuses call credentials on a plaintext channel."""
    d = Path(directory)
    if (d / TLS_CERT_FILE).exists():
        ca_pem, cert_pem, key_pem, cluster = client_pems(TlsFiles(d / TLS_CA_FILE, d / TLS_CERT_FILE, d / TLS_KEY_FILE))
        base = grpc.ssl_channel_credentials(root_certificates=ca_pem, private_key=key_pem, certificate_chain=cert_pem)
    else:
        ca = d / TLS_CA_FILE
        try:
            ca_pem = ca.read_bytes()
        except OSError as exc:
            raise TlsError(ca, "cannot read", exc.strerror or str(exc)) from None
        cluster = ca_pem_cluster(ca, ca_pem)
        base = grpc.ssl_channel_credentials(root_certificates=ca_pem)
    return grpc.composite_channel_credentials(base, grpc.access_token_call_credentials(token)), cluster


# gRPC's words for a failed handshake (the Python API gives no better signal).
_TLS_WORDS = ("ssl", "tls", "handshake", "certificate", "hostname verification")


# gRPC's words when no connection was made at all, and what they mean to a
# user: nothing accepts connections at the address, or it cannot be reached.
_UNREACHABLE = (
    ("connection refused", "connection refused"),
    ("no route to host", "no route to host"),
    ("network is unreachable", "network unreachable"),
    ("errors resolving", "its host name does not resolve"),
    ("dns resolution failed", "its host name does not resolve"),
    ("name or service not known", "its host name does not resolve"),
)


def unreachable_reason(details: str) -> str | None:
    """Why gRPC could not connect at all (``connection refused``, ``its host
    name does not resolve``, ...), from its error details; None when it did
    connect (or said nothing this recognises)."""
    low = (details or "").lower()
    return next((why for words, why in _UNREACHABLE if words in low), None)


def _tls_hint(details: str, tls: bool) -> str:
    """What to add to "no coordinator could answer" when the reason may be TLS
    (never for a connection that was not even made)."""
    low = details.lower()
    if unreachable_reason(details):
        return ""
    if tls and any(w in low for w in _TLS_WORDS):
        return (" (TLS handshake failed: the server's certificate does not verify against this client's ca.crt"
                " or is not a coordinator certificate of its cluster, or the coordinator serves plaintext)")
    if tls:
        return (" (connecting with TLS: a coordinator that closes the connection at once refused this client's"
                " certificate: another CA, expired, or not yet valid)")
    if "socket closed" in low or "connection reset" in low or "handshake" in low:
        return (" (connecting in plaintext, chosen by --insecure/PHALANX_INSECURE: if the coordinator serves TLS,"
                " give credentials: --tls-dir, $PHALANX_TLS_DIR or $PHALANX_CONFIG)")
    return ""


def parse_address(item: str) -> str:
    """``host:port``, ``[ipv6]:port``, optionally ``http://`` / ``grpc://``
    in front and ``/`` behind, -> ``host:port``. Raises ValueError naming the
    entry and what is wrong (a port outside 1..65535 is caught here, not as
    a connection error seconds later)."""
    text = item.strip()
    for scheme in ("http://", "https://", "grpc://"):
        if text.startswith(scheme):
            text = text[len(scheme):]
    text = text.rstrip("/")
    m = _HOST_PORT.fullmatch(text)
    if m is None:
        raise ValueError(f"{item.strip()!r} is not host:port")
    port = int(m["port"]) if len(m["port"]) <= 5 else 0
    if not 1 <= port <= 65535:
        raise ValueError(f"{item.strip()!r}: port must be between 1 and 65535, got {m['port']}")
    return f"{m['host']}:{port}"


def parse_addresses(addresses: str | Sequence[str]) -> tuple[str, ...]:
    """``"h1:p1,h2:p2"`` or a sequence of such strings -> ``("h1:p1", "h2:p2")``.
    Blank entries are dropped; duplicates keep their first position; a
    malformed entry raises ValueError naming it (``parse_address``)."""
    parts = [addresses] if isinstance(addresses, str) else list(addresses)
    out: list[str] = []
    for part in parts:
        for item in str(part).split(","):
            if not item.strip():
                continue
            address = parse_address(item)
            if address not in out:
                out.append(address)
    if not out:
        raise ValueError("no coordinator address given")
    return tuple(out)


def to_spec(spec: SpecLike) -> GangSpec:
    """Validate locally whatever the caller handed us. Raises InvalidSpec."""
    if isinstance(spec, GangSpec):
        # Re-validate: a dataclass can be built by hand, bypassing parse_spec.
        return parse_spec(spec.to_dict())
    if isinstance(spec, pb.GangSpec):
        return spec_from_pb(spec)
    if isinstance(spec, str):
        return load_spec(spec)
    if isinstance(spec, Mapping):
        return parse_spec(spec)
    raise InvalidSpec([FieldError("spec", f"must be a GangSpec, a mapping or YAML text, got {type(spec).__name__}")])


# --- the async client -----------------------------------------------------------


class _NoConnection(Exception):
    """A whole round of addresses that could not even be connected to, with
    ``fail_fast``: the call ends now, not at its deadline."""


class _TryNext(Exception):
    """An attempt that another address, or a later round, may still answer:
    UNAVAILABLE, its share of the deadline ran out, or a stream that closed
    before its first event. ``error`` is the gRPC error, if there was one."""

    def __init__(self, address: str, error: grpc.aio.AioRpcError | None = None):
        super().__init__(address)
        self.address = address
        self.error = error


def _until(deadline: float) -> Callable[[RetryCallState], bool]:
    """tenacity stop: the call's own deadline (monotonic clock) has passed."""
    return lambda _state: time.monotonic() >= deadline


def _round_backoff(n: int, deadline: float) -> Callable[[RetryCallState], float]:
    """tenacity wait for failover over ``n`` addresses: none between the
    addresses of one round; after a whole round failed, _BACKOFF_START_S
    doubling up to _BACKOFF_MAX_S; never past the deadline."""

    def wait(state: RetryCallState) -> float:
        if state.attempt_number % n:
            return 0.0
        rounds = state.attempt_number // n
        pause = min(_BACKOFF_START_S * 2 ** min(rounds - 1, 30), _BACKOFF_MAX_S)
        return max(0.0, min(pause, deadline - time.monotonic()))

    return wait


def _conflict_backoff(deadline: float) -> Callable[[RetryCallState], float]:
    """tenacity wait between retries of a write that lost a race
    (ABORTED): short, doubling, capped, never past the deadline."""

    def wait(state: RetryCallState) -> float:
        pause = min(_CONFLICT_BACKOFF_START_S * 2 ** min(state.attempt_number - 1, 30), _BACKOFF_MAX_S)
        return max(0.0, min(pause, deadline - time.monotonic()))

    return wait


def _answered_by(exc: grpc.aio.AioRpcError) -> dict[str, str]:
    """The cluster/coordinator a coordinator's trailing metadata names."""
    out: dict[str, str] = {}
    try:
        for key, value in exc.trailing_metadata() or ():
            if key in (CLUSTER_METADATA, COORDINATOR_METADATA) and isinstance(value, str):
                out[key] = value
    except (TypeError, ValueError):  # no or malformed metadata: nobody named
        pass
    return out


def _translate(exc: grpc.aio.AioRpcError, address: str, message: str | None = None) -> PhalanxError:
    who = _answered_by(exc)
    return from_status(
        exc.code(),
        exc.details() or "" if message is None else message,
        cluster=who.get(CLUSTER_METADATA, ""),
        coordinator=who.get(COORDINATOR_METADATA, ""),
        address=address,
    )


class AsyncClient:
    """Async client for one Phalanx cluster. Use as ``async with AsyncClient(...)``
    or call :meth:`close`. Channels are opened lazily, on the running loop.

    ``addresses`` ``None`` (the default): ``$PHALANX_ADDRESS``, else the
    config file's, else ``127.0.0.1:7070``, as the CLI. ``timeout``: each
    call's deadline in seconds, failover included, at most MAX_TIMEOUT_S.
    ``tls_dir``: a directory with ``ca.crt``, ``client.crt`` and
    ``client.key`` (TLS with this client certificate); ``None`` (the
    default): ``$PHALANX_TLS_DIR``, else the config file's ``tls_dir``
    (``$PHALANX_CONFIG``, default ``~/.config/phalanx/config.yaml``).
    Plaintext only with ``insecure=True`` (or ``$PHALANX_INSECURE=1``, or
    ``insecure: true`` in the config file); no credentials at all is a
    ClientConfigError naming every way to give them (``resolve_connection``).
    The TLS files are checked here (TlsError names the file and the check)
    and read again for every new channel; the server must present a
    coordinator certificate of the CA's cluster."""

    def __init__(self, addresses: str | Sequence[str] | None = None, timeout: float = 10.0,
                 tls_dir: str | os.PathLike[str] | None = None, insecure: bool = False, *,
                 connection: Connection | None = None, token: str | None = None, fail_fast: bool = False):
        self.timeout = check_timeout(timeout)
        # ``fail_fast`` (the CLI): a round in which no address could even be
        # connected to (nothing listening, no route, no such host, a failed
        # TLS handshake) ends the call at once instead of retrying until the
        # deadline; an SDK caller may be waiting for a cluster to come up.
        self._fail_fast = fail_fast
        # ``connection``: already resolved (the CLI, whose errors name its flags).
        self.connection = connection or connection_settings(addresses, tls_dir, insecure)
        self.addresses: tuple[str, ...] = self.connection.addresses
        self._tls: tuple[TlsFiles, str] | None = None
        # ``token`` (else $PHALANX_TOKEN): a bearer token, sent only over TLS.
        self._token = resolve_token(token)
        if self._token is not None:
            if self.connection.tls_dir is None:
                raise ClientConfigError(TOKEN_NEEDS_TLS)
            token_credentials(self.connection.tls_dir, self._token)  # checked now, as the TLS files are
        if self.connection.tls_dir is not None and self._token is None:
            self._tls = client_tls(self.connection.tls_dir)
            config = self.connection.config
            if config is not None and config.cluster and str(config.path) in self.connection.tls_from \
                    and config.cluster != self._tls[1]:
                raise ClientConfigError(f"{config.path}: cluster: {config.cluster!r}, but the CA in tls_dir "
                                        f"{self.connection.tls_dir} is cluster {self._tls[1]!r}")
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, gang_pb2_grpc.GangServiceStub] = {}
        # Index of the address that answered last: stick to a working server.
        self._current = 0
        self._closed = False

    @property
    def last_address(self) -> str:
        """The address that answered the last call (the first one before any)."""
        return self.addresses[self._current]

    # -- plumbing --

    def _stub(self, address: str) -> gang_pb2_grpc.GangServiceStub:
        if self._closed:
            raise RuntimeError("client is closed")
        stub = self._stubs.get(address)
        if stub is None:
            if self._token is not None and self.connection.tls_dir is not None:
                credentials, cluster = token_credentials(self.connection.tls_dir, self._token)
                channel = grpc.aio.secure_channel(address, credentials, options=[
                    ("grpc.ssl_target_name_override", coordinator_server_name(cluster)), *_CHANNEL_OPTIONS])
            elif self._tls is not None:
                files, cluster = self._tls
                # The files as they are now (a renewal is used by the next
                # channel), checked as coordinator_channel checks them.
                ca_pem, cert_pem, key_pem, _ = client_pems(files, cluster=cluster)
                channel = pem_channel(address, ca_pem, cert_pem, key_pem, cluster=cluster, options=_CHANNEL_OPTIONS)
            else:
                channel = grpc.aio.insecure_channel(address, options=list(_CHANNEL_OPTIONS))
            self._channels[address] = channel
            stub = self._stubs[address] = gang_pb2_grpc.GangServiceStub(channel)
        return stub

    async def _call(
        self,
        method: str,
        request: Any,
        *,
        timeout: float | None = None,
        retried: bool = False,
        on_retry_error: Callable[[PhalanxError], Awaitable[Any]] | None = None,
    ) -> Any:
        """One unary RPC with failover (module docstring). ``on_retry_error``
        may turn an error seen on a *retry* into a result (used by cancel);
        ``retried``: this whole call is itself a retry."""

        async def attempt(k: int, address: str, share: float) -> Any:
            try:
                return await getattr(self._stub(address), method)(request, timeout=share)
            except grpc.aio.AioRpcError as exc:
                # DEADLINE_EXCEEDED: this attempt's share ran out; the next
                # address is tried while the call's own deadline allows.
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise _TryNext(address, exc) from None
                err = _translate(exc, address)
                if (k or retried) and on_retry_error is not None:
                    return await on_retry_error(err)
                raise err from None

        return await self._failover(method, self.timeout if timeout is None else timeout, attempt)

    async def _failover(self, method: str, budget: float, attempt: Callable[[int, str, float], Awaitable[T]]) -> T:
        """The failover schedule shared by unary calls and watch opening, run
        by tenacity: ``attempt(k, address, share)`` on the addresses in
        rotation (from the one that answered last), each given a share of
        the time left split over the addresses not yet tried this round,
        until one answers or ``budget`` is spent; after each whole round
        that failed, a short backoff. ``attempt`` raises _TryNext to move on;
        any other error ends the call at once."""
        deadline = time.monotonic() + budget
        n = len(self.addresses)
        start = self._current
        counter = itertools.count()
        failed: list[_TryNext] = []

        async def once() -> T:
            k = next(counter)
            index = (start + k) % n
            address = self.addresses[index]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _TryNext(address)
            share = max(remaining / (n - k % n), min(_MIN_ATTEMPT_S, remaining))
            try:
                result = await attempt(k, address, share)
            except _TryNext as exc:
                failed.append(exc)
                if self._fail_fast and k % n == n - 1 and all(self._not_connected(f) for f in failed[-n:]):
                    raise _NoConnection() from None  # retrying cannot help: say so now
                raise
            self._current = index
            return result

        retrying = AsyncRetrying(
            stop=_until(deadline),
            wait=_round_backoff(n, deadline),
            retry=retry_if_exception_type(_TryNext),
            reraise=True,
        )
        try:
            return await retrying(once)
        except (_TryNext, _NoConnection):
            raise self._exhausted(method, budget, failed, await self._why_refused(failed)) from None

    def _not_connected(self, failed: _TryNext) -> bool:
        """The attempt made no connection at all: nothing listening, no
        route, no such host, or (over TLS) a failed handshake. Not an
        UNAVAILABLE a coordinator answered (etcd down), not a timeout."""
        err = failed.error
        if err is None or err.code() != grpc.StatusCode.UNAVAILABLE or _answered_by(err):
            return False
        details = err.details() or ""
        return bool(unreachable_reason(details)) or (self.connection.tls_dir is not None
                                                     and looks_like_handshake(details))

    async def _why_refused(self, failed: Sequence[_TryNext]) -> str:
        """Under TLS, when the last address failed the handshake: which
        check the server's certificate failed (probe_server), else ""."""
        last = next((f for f in reversed(failed) if f.error is not None), None)
        if self._tls is None or last is None or last.error is None or last.error.code() != grpc.StatusCode.UNAVAILABLE \
                or not looks_like_handshake(last.error.details() or ""):
            return ""
        files, cluster = self._tls
        refusal = await asyncio.to_thread(probe_server, last.address, files, cluster=cluster, now=utc_now())
        return str(refusal) if refusal is not None else ""

    def _exhausted(self, method: str, budget: float, failed: Sequence[_TryNext], why: str = "") -> PhalanxError:
        """The error of a call no address answered in time. A coordinator
        that did answer UNAVAILABLE said why (e.g. etcd did not answer it):
        its words are kept even when later attempts merely timed out, so an
        etcd outage reads as one."""
        where = ", ".join(dict.fromkeys(f.address for f in failed)) or ", ".join(self.addresses)
        errors = [f for f in failed if f.error is not None]
        answered = [f for f in errors if f.error.code() == grpc.StatusCode.UNAVAILABLE and _answered_by(f.error)]
        if answered:
            told = answered[-1]
            err = _translate(told.error, told.address)
            return _translate(
                told.error, told.address,
                f"{method}: no coordinator could answer within {budget:g}s (tried {where}); "
                f"{err.origin or told.address} said: {told.error.details() or 'UNAVAILABLE'}",
            )
        last = errors[-1] if errors else None
        if errors and all(unreachable_reason(f.error.details() or "") for f in errors):
            whys = ", ".join(dict.fromkeys(unreachable_reason(f.error.details() or "") or "" for f in errors))
            return _translate(last.error, last.address,
                              f"{method}: nothing is listening at {where} ({whys}; is the cluster up? "
                              f"`phalanx config` shows what this command used)")
        if last is None or last.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return from_status(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method}: no answer within {budget:g}s from {where}")
        code = last.error.code()
        details = last.error.details() or code.name
        hint = _tls_hint(details, self._tls is not None) if code == grpc.StatusCode.UNAVAILABLE else ""
        if self._token is not None and code == grpc.StatusCode.UNAVAILABLE:
            hint = (" (with a bearer token: dial a coordinator's --token-listen port; its certificate port "
                    "refuses a client without a certificate at the handshake)")
        if why:  # the check the server's certificate failed: that is the whole story
            return _translate(last.error, last.address, f"{method}: TLS handshake failed (tried {where}): {why}")
        return _translate(last.error, last.address, f"{method}: no coordinator could answer (tried {where}): {details}{hint}")

    # -- API --

    async def submit(self, spec: SpecLike, idempotency_key: str | None = None) -> SubmitResult:
        """Validate ``spec`` locally (raises InvalidSpec, nothing is sent), then
        submit it. Returns once the gang is durable in etcd."""
        domain = to_spec(spec)
        if not idempotency_key:
            import uuid  # here: only a submission needs it (docs/cli.md "Start-up time")

            idempotency_key = str(uuid.uuid4())
        request = gang_pb2.SubmitGangRequest(spec=spec_to_pb(domain), idempotency_key=idempotency_key)
        response: gang_pb2.SubmitGangResponse = await self._call("SubmitGang", request)
        return SubmitResult(gang=response.gang, created=response.created)

    async def get(self, id: str) -> pb.Gang:
        """The gang with this id; for a name, the live gang of that name,
        else the newest kept (finished, not yet collected) one."""
        return await self._call("GetGang", gang_pb2.GetGangRequest(id=id))

    async def list(
        self,
        states: Collection[StateLike] | StateLike | None = None,
        queue: str = "",
        owner_az: str = "",
        name_prefix: str = "",
        limit: int = 0,
    ) -> list[pb.Gang]:
        """Gangs matching every given filter (``limit`` 0: the server's default;
        at most MAX_LIMIT, the wire's int32)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= MAX_LIMIT:
            raise ValueError(f"limit must be an integer between 0 and {MAX_LIMIT}, got {limit!r}")
        request = gang_pb2.ListGangsRequest(
            states=[int(s) for s in sorted(parse_states(states))],
            queue=queue,
            owner_az=owner_az,
            name_prefix=name_prefix,
            limit=limit,
        )
        # A reply carries a bounded number of bytes; follow the pages. A
        # coordinator older than paging sends no token: one page is all.
        gangs: list[pb.Gang] = []
        while True:
            response: gang_pb2.ListGangsResponse = await self._call("ListGangs", request)
            gangs.extend(response.gangs)
            if not response.next_page_token:
                return gangs
            request.page_token = response.next_page_token

    async def watch(self, id: str) -> AsyncIterator[pb.Gang]:
        """Yield the gang now, then on every change, until it is terminal.

        If the stream breaks (coordinator gone, or it ended the stream before
        the gang was terminal), the watch resumes on the next address; changes
        already delivered are not repeated (events are ordered by etcd
        revision). Each (re)connection must deliver its first event within
        ``timeout``; there is no overall deadline, a watch lasts as long as the
        gang does. A coordinator that hangs mid-stream (SIGSTOP) without
        closing its connection is not detected (no keepalive pings: servers
        punish clients that ping more often than they allow)."""
        last_revision = -1
        pause = _BACKOFF_START_S
        while True:
            call, event = await self._open_watch(id)
            try:
                while event is not grpc.aio.EOF:
                    revision = event.revision or event.gang.mod_revision
                    if not revision or revision > last_revision:
                        last_revision = max(last_revision, revision)
                        pause = _BACKOFF_START_S
                        yield event.gang
                    if is_terminal(event.gang):
                        return
                    try:
                        event = await call.read()
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() not in _RESUMABLE or self._closed:
                            raise _translate(exc, self.last_address) from None
                        break
            finally:
                call.cancel()
            # Paced, so a server that keeps ending streams early is not spun on.
            await asyncio.sleep(pause)
            pause = min(pause * 2, _BACKOFF_MAX_S)

    async def watch_events(self, id: str, after_seq: int = 0) -> AsyncIterator[pb.GangEventRecord]:
        """Yield the gang's events (``Gang.events``, docs/events.md) with a
        ``seq`` above ``after_seq``, oldest first: those recorded so far, then
        each new one as the gang's record changes, until the gang is
        terminal. Built on ``watch``, so it resumes the same way. A
        ``dropped`` marker is yielded when events were dropped (the bound)
        before this reader saw them."""
        last = after_seq
        async for gang in self.watch(id):
            for e in gang.events:
                if e.seq > last:
                    last = e.seq
                    yield e

    async def watch_cluster_events(self, queue: str = "", on_open: Callable[[], None] | None = None,
                                   on_gap: Callable[[int], None] | None = None
                                   ) -> AsyncIterator[gang_pb2.ClusterEvent]:
        """Yield every gang event recorded from now on, of every queue or of
        ``queue``, as ``ClusterEvent`` (the gang's id, name and queue, and the
        event), in etcd order (so each gang's in ``seq`` order); only the
        gangs this caller may see. Never ends by itself. ``on_open`` is
        called each time the stream is open (events from then on reach it).
        If the stream breaks it is reopened on the next address, with the
        same failover rules as ``watch``, after the last revision received:
        events recorded while it was closed are sent when that coordinator
        still holds them (docs/events.md "Bounds and resume"; each gang's
        ``watch_events`` has its history). When it no longer does,
        ``on_gap`` is called with the revision asked for: events recorded
        after it and before the reopen are not sent."""
        pause = _BACKOFF_START_S
        after = 0  # the last revision whose events all arrived
        newest, at_newest = 0, set[tuple[str, int]]()  # the newest revision received, and its events
        while True:
            call = await self._open_cluster_events(queue, after)
            if after and on_gap is not None and dict(await call.initial_metadata()).get(_RESUME_HEADER) == "gap":
                on_gap(after)
            if on_open is not None:
                on_open()
            try:
                while True:
                    try:
                        event = await call.read()
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() not in _RESUMABLE or self._closed:
                            raise _translate(exc, self.last_address) from None
                        break
                    if event is grpc.aio.EOF:
                        break
                    pause = _BACKOFF_START_S
                    if event.revision:
                        # Events of one revision come together: a resume asks
                        # again for the last one, whose events already here are skipped.
                        key = (event.gang_id, event.event.seq)
                        if event.revision < newest or (event.revision == newest and key in at_newest):
                            continue
                        if event.revision > newest:
                            newest, at_newest = event.revision, set()
                        at_newest.add(key)
                        after = newest - 1
                    yield event
            finally:
                call.cancel()
            await asyncio.sleep(pause)
            pause = min(pause * 2, _BACKOFF_MAX_S)

    async def _open_cluster_events(self, queue: str, after: int = 0) -> Any:
        """Open a WatchEvents stream and wait for its headers (sent once the
        coordinator has read where every gang stands), with the same
        failover and deadline rules as a unary call."""

        async def attempt(_k: int, address: str, share: float) -> Any:
            call = self._stub(address).WatchEvents(gang_pb2.WatchEventsRequest(queue=queue, after_revision=after))
            try:
                await asyncio.wait_for(call.initial_metadata(), timeout=share)
            except asyncio.TimeoutError:
                call.cancel()
                raise _TryNext(address) from None
            except BaseException:
                call.cancel()
                raise
            if call.done():
                # Refused before it opened (authorization, a bad queue): the
                # status says why; a resumable one tries the next address.
                code = await call.code()
                if code != grpc.StatusCode.OK:
                    exc = grpc.aio.AioRpcError(code, await call.initial_metadata(), await call.trailing_metadata(),
                                               details=await call.details())
                    if code in _RESUMABLE and not self._closed:
                        raise _TryNext(address, exc)
                    raise _translate(exc, address)
            return call

        return await self._failover("WatchEvents", self.timeout, attempt)

    async def _open_watch(self, id: str) -> tuple[Any, gang_pb2.GangEvent]:
        """Open a WatchGang stream and read its first event, with the same
        failover and deadline rules as a unary call."""

        async def attempt(_k: int, address: str, share: float) -> tuple[Any, gang_pb2.GangEvent]:
            call = self._stub(address).WatchGang(gang_pb2.WatchGangRequest(id=id))
            try:
                event = await asyncio.wait_for(call.read(), timeout=share)
            except asyncio.TimeoutError:
                call.cancel()
                raise _TryNext(address) from None
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _RESUMABLE and not self._closed:
                    raise _TryNext(address, exc) from None
                raise _translate(exc, address) from None
            except BaseException:
                call.cancel()
                raise
            if event is grpc.aio.EOF:
                raise _TryNext(address)  # closed with OK before any event: ask someone else
            return call, event

        return await self._failover("WatchGang", self.timeout, attempt)

    async def wait(self, id: str, states: Collection[StateLike] | StateLike, timeout: float) -> pb.Gang:
        """Return the gang as soon as it is in one of ``states``.

        Raises ``TimeoutError`` after ``timeout`` seconds, and
        :class:`TerminalStateReached` as soon as the gang reaches a terminal
        state (SUCCEEDED, FAILED, CANCELLED) that is not among ``states`` —
        the wanted state can then never come, so there is nothing to wait for."""
        wanted = parse_states(states)
        if not wanted:
            raise ValueError("wait needs at least one state")
        wanted_ints = {int(s) for s in wanted}
        last: pb.Gang | None = None

        async def follow() -> pb.Gang:
            nonlocal last
            agen = self.watch(id)
            try:
                async for gang in agen:
                    last = gang
                    if gang.state in wanted_ints:
                        return gang
                    if is_terminal(gang):
                        raise TerminalStateReached(gang, wanted)
            finally:
                await agen.aclose()
            # watch only ends on a terminal gang, handled above.
            raise PhalanxError(f"watch of gang {id} ended unexpectedly")

        try:
            return await asyncio.wait_for(follow(), timeout=timeout)
        except asyncio.TimeoutError:
            now = f" (now {state_name(last)})" if last is not None else ""
            want = " or ".join(sorted(s.name for s in wanted))
            raise TimeoutError(f"gang {id} did not reach {want} within {timeout:g}s{now}") from None

    async def cancel(self, id: str, reason: str = "") -> pb.Gang:
        """Cancel a gang (whole-gang teardown). Returns the gang as updated.

        A cancel that races another write of the gang (admission placing it
        at that moment) loses its compare and is answered ABORTED; it is
        retried (tenacity, within this call's deadline) until it takes
        effect, so a returned cancel has happened."""
        deadline = time.monotonic() + self.timeout
        request = gang_pb2.CancelGangRequest(id=id, reason=reason)
        tries = itertools.count()

        async def already_done(err: PhalanxError) -> pb.Gang:
            # A retry whose first attempt did land sees a finished gang: that
            # is our own cancel succeeding, not an error.
            if isinstance(err, FailedPrecondition):
                gang = await self.get(id)
                if gang.state == int(GangState.CANCELLED):
                    return gang
            raise err

        async def once() -> pb.Gang:
            retried = next(tries) > 0
            return await self._call(
                "CancelGang", request, timeout=max(deadline - time.monotonic(), 1e-3),
                retried=retried, on_retry_error=already_done,
            )

        retrying = AsyncRetrying(
            stop=_until(deadline),
            wait=_conflict_backoff(deadline),
            retry=retry_if_exception_type(Conflict),
            reraise=True,
        )
        return await retrying(once)

    async def explain(self, id: str) -> gang_pb2.ExplainGangResponse:
        """Why a gang is where it is: a summary and, when it cannot be placed,
        the shortfall in each candidate domain."""
        return await self._call("ExplainGang", gang_pb2.ExplainGangRequest(id=id))

    async def nodes(self, az: str = "") -> list[pb.NodeStatus]:
        response: gang_pb2.ListNodesResponse = await self._call("ListNodes", gang_pb2.ListNodesRequest(az=az))
        return list(response.nodes)

    async def status(self) -> gang_pb2.ClusterStatusResponse:
        """Each AZ's leader, epoch and capacity; gang counts by state."""
        return await self._call("ClusterStatus", gang_pb2.ClusterStatusRequest())

    # -- node lifecycle (docs/nodes.md), admin only --

    async def cordon(self, az: str, node: str, cordoned: bool = True) -> pb.NodeStatus:
        """Cordon ``node`` of ``az`` (nothing new is placed on it, what runs
        there stays), or uncordon it with ``cordoned=False``."""
        return await self._call("CordonNode", gang_pb2.CordonNodeRequest(az=az, node=node, cordoned=cordoned))

    async def drain(self, az: str, node: str, *, requeue: bool = False, timeout: float = 300.0) -> gang_pb2.DrainNodeResponse:
        """Cordon the node and, with ``requeue``, restart its gangs on other
        nodes (else let them finish); then wait until it holds no devices
        or ``timeout`` s pass. The last answer: ``gangs`` is empty when the
        node holds no devices, else it names those still there."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        answer = await self._call("DrainNode", gang_pb2.DrainNodeRequest(az=az, node=node, requeue=requeue))
        requeued = list(answer.requeued)
        pause = _BACKOFF_START_S
        while answer.gangs and loop.time() + pause < deadline:
            await asyncio.sleep(pause)
            pause = min(pause * 2, _BACKOFF_MAX_S)
            answer = await self._call("DrainNode", gang_pb2.DrainNodeRequest(az=az, node=node))
        del answer.requeued[:]
        answer.requeued.extend(requeued)
        return answer

    async def delete_node(self, az: str, node: str, *, force: bool = False) -> list[str]:
        """Remove the node's record; FailedPrecondition naming the gangs
        while it holds devices, unless ``force``. The gangs that held its
        devices (``force`` only). A live agent registers it again."""
        response = await self._call("DeleteNode", gang_pb2.DeleteNodeRequest(az=az, node=node, force=force))
        return list(response.gangs)

    # -- the policy (docs/security.md "Policy as data") --

    async def get_policy(self) -> tuple[dict[str, Any], gang_pb2.PolicyRecord]:
        """The cluster's policy (defaults filled in) and its record
        (``revision``: pass it to set_policy; 0 when none is stored)."""
        record = await self._call("GetPolicy", gang_pb2.GetPolicyRequest())
        return json.loads(record.policy_json), record

    async def set_policy(self, policy: Mapping[str, Any], expected_revision: int) -> gang_pb2.PolicyRecord:
        """Replace the policy (admin only), if it is still at
        ``expected_revision`` (from get_policy; 0: none stored yet);
        FailedPrecondition when someone changed it since."""
        request = gang_pb2.SetPolicyRequest(policy_json=json.dumps(dict(policy), sort_keys=True),
                                            expected_revision=expected_revision)
        return await self._call("SetPolicy", request)

    async def close(self) -> None:
        self._closed = True
        channels = list(self._channels.values())
        self._channels.clear()
        self._stubs.clear()
        for channel in channels:
            await channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# --- the blocking client ----------------------------------------------------------


class Client:
    """Blocking client with the same methods as :class:`AsyncClient`.

    Runs an AsyncClient on a private event loop in a daemon thread; every
    method submits a coroutine there and waits for its result. Safe to share
    between threads. ``watch`` returns a plain iterator."""

    def __init__(self, addresses: str | Sequence[str] | None = None, timeout: float = 10.0,
                 tls_dir: str | os.PathLike[str] | None = None, insecure: bool = False, *, token: str | None = None,
                 fail_fast: bool = False):
        # fail_fast: as AsyncClient's (a round that reaches no address at all ends the call).
        self._async = AsyncClient(addresses, timeout, tls_dir, insecure, token=token,
                                  fail_fast=fail_fast)  # validates before a thread exists
        self.connection = self._async.connection
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="phalanx-client", daemon=True)
        self._thread.start()
        self.addresses = self._async.addresses
        self.timeout = self._async.timeout

    def _run(self, coro: Awaitable[T]) -> T:
        if self._loop.is_closed():
            raise RuntimeError("client is closed")
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt in the caller: stop the RPC too
            raise

    def submit(self, spec: SpecLike, idempotency_key: str | None = None) -> SubmitResult:
        return self._run(self._async.submit(spec, idempotency_key))

    def get(self, id: str) -> pb.Gang:
        return self._run(self._async.get(id))

    def list(
        self,
        states: Collection[StateLike] | StateLike | None = None,
        queue: str = "",
        owner_az: str = "",
        name_prefix: str = "",
        limit: int = 0,
    ) -> list[pb.Gang]:
        return self._run(self._async.list(states, queue, owner_az, name_prefix, limit))

    def watch(self, id: str) -> Iterator[pb.Gang]:
        return self._iterate(self._async.watch(id))

    def watch_events(self, id: str, after_seq: int = 0) -> Iterator[pb.GangEventRecord]:
        return self._iterate(self._async.watch_events(id, after_seq))

    def watch_cluster_events(self, queue: str = "", on_open: Callable[[], None] | None = None,
                             on_gap: Callable[[int], None] | None = None) -> Iterator[gang_pb2.ClusterEvent]:
        return self._iterate(self._async.watch_cluster_events(queue, on_open, on_gap))

    def _iterate(self, agen: Any) -> Iterator[Any]:
        """An async generator of the client's loop, as a blocking iterator
        (closed on the loop when the caller stops early)."""
        try:
            while True:
                item = self._run(_anext(agen))
                if item is _END:
                    return
                yield item
        finally:
            if not self._loop.is_closed():
                asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop).result()

    def wait(self, id: str, states: Collection[StateLike] | StateLike, timeout: float) -> pb.Gang:
        return self._run(self._async.wait(id, states, timeout))

    def cancel(self, id: str, reason: str = "") -> pb.Gang:
        return self._run(self._async.cancel(id, reason))

    def explain(self, id: str) -> gang_pb2.ExplainGangResponse:
        return self._run(self._async.explain(id))

    def nodes(self, az: str = "") -> list[pb.NodeStatus]:
        return self._run(self._async.nodes(az))

    def status(self) -> gang_pb2.ClusterStatusResponse:
        return self._run(self._async.status())

    def get_policy(self) -> tuple[dict[str, Any], gang_pb2.PolicyRecord]:
        return self._run(self._async.get_policy())

    def cordon(self, az: str, node: str, cordoned: bool = True) -> pb.NodeStatus:
        return self._run(self._async.cordon(az, node, cordoned))

    def drain(self, az: str, node: str, *, requeue: bool = False, timeout: float = 300.0) -> gang_pb2.DrainNodeResponse:
        return self._run(self._async.drain(az, node, requeue=requeue, timeout=timeout))

    def delete_node(self, az: str, node: str, *, force: bool = False) -> list[str]:
        return self._run(self._async.delete_node(az, node, force=force))

    def set_policy(self, policy: Mapping[str, Any], expected_revision: int) -> gang_pb2.PolicyRecord:
        return self._run(self._async.set_policy(policy, expected_revision))

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._async.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_END = object()


async def _anext(agen: AsyncIterator[T]) -> T | object:
    # run_coroutine_threadsafe needs a coroutine (__anext__ gives an awaitable),
    # and StopAsyncIteration does not cross a concurrent Future cleanly.
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return _END


def spec_yaml(spec: GangSpec) -> str:
    """The YAML form of a validated spec (used by ``phalanx submit -o yaml``)."""
    return yaml.safe_dump(spec.to_dict(), sort_keys=False)
