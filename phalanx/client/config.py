"""Where a client finds its coordinators and credentials (docs/security.md
"Client credentials"): the flags or arguments, the variables, the config file
(``$PHALANX_CONFIG``, default ``~/.config/phalanx/config.yaml``), in that
order (``resolve_connection``, pure; ``connection_settings`` reads this
process's variables and file); the coordinator addresses (``parse_addresses``);
the client's TLS files (``client_tls``). Imports no gRPC."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from phalanx.client_names import (
    ADDRESS_ENV,
    CONFIG_ENV,
    DEFAULT_ADDRESS,
    DEFAULT_CONFIG,
    INSECURE_ENV,
    TLS_CA_FILE,
    TLS_CERT_FILE,
    TLS_DIR_ENV,
    TLS_KEY_FILE,
)
from phalanx.tls import TlsFiles, client_pems

_HOST_PORT = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]+)")


def default_address() -> str:
    """What an address-less client talks to: ``$PHALANX_ADDRESS``, else
    ``127.0.0.1:7070`` (the CLI's ``--address`` default too)."""
    return os.environ.get(ADDRESS_ENV, "").strip() or DEFAULT_ADDRESS


def default_tls_dir() -> str:
    """``$PHALANX_TLS_DIR`` ("" = not set)."""
    return os.environ.get(TLS_DIR_ENV, "").strip()


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


# --- coordinator addresses ----------------------------------------------------------


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
