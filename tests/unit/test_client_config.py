"""Where the SDK and the CLI find their coordinators and credentials: the
config file's checks and the precedence of arguments, variables and the
file (phalanx.client.resolve_connection, pure; read_client_config on real
files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx import client
from phalanx.client import ClientConfig, ClientConfigError, parse_client_config, resolve_connection

CFG = Path("/etc/phalanx/config.yaml")
TLS_CFG = ClientConfig(CFG, cluster="prod", addresses=("10.0.0.1:7070", "10.0.0.2:7070"), tls_dir=Path("/etc/phalanx/admin"))
PLAIN_CFG = ClientConfig(CFG, addresses=("10.0.0.9:7070",), insecure=True)
EMPTY_CFG = ClientConfig(CFG)

# name: (kwargs of resolve_connection, (tls_dir or None, where the choice came from, addresses, where they came from))
RESOLVED = {
    "the argument": (dict(tls_dir="/a", env={}, config=None), ("/a", "tls_dir=", ("127.0.0.1:7070",), "the default address")),
    "the argument over the variable": (dict(tls_dir="/a", env={"PHALANX_TLS_DIR": "/e"}, config=TLS_CFG), ("/a", "tls_dir=", TLS_CFG.addresses, f"{CFG} (addresses)")),
    "insecure argument over the variable": (dict(insecure=True, env={"PHALANX_TLS_DIR": "/e"}, config=None), (None, "insecure=True", ("127.0.0.1:7070",), "the default address")),
    "the variable": (dict(env={"PHALANX_TLS_DIR": "/e"}, config=None), ("/e", "$PHALANX_TLS_DIR", ("127.0.0.1:7070",), "the default address")),
    "the variable over the file": (dict(env={"PHALANX_TLS_DIR": "/e"}, config=TLS_CFG), ("/e", "$PHALANX_TLS_DIR", TLS_CFG.addresses, f"{CFG} (addresses)")),
    "PHALANX_INSECURE=1 over the file": (dict(env={"PHALANX_INSECURE": "1"}, config=TLS_CFG), (None, "PHALANX_INSECURE=1", TLS_CFG.addresses, f"{CFG} (addresses)")),
    "the file": (dict(env={}, config=TLS_CFG), ("/etc/phalanx/admin", f"{CFG} (tls_dir)", TLS_CFG.addresses, f"{CFG} (addresses)")),
    "the file says plaintext": (dict(env={}, config=PLAIN_CFG), (None, f"{CFG} (insecure: true)", ("10.0.0.9:7070",), f"{CFG} (addresses)")),
    "an empty argument is no argument": (dict(tls_dir="", env={"PHALANX_TLS_DIR": "/e"}, config=None), ("/e", "$PHALANX_TLS_DIR", ("127.0.0.1:7070",), "the default address")),
    "PHALANX_INSECURE=0 is not insecure": (dict(env={"PHALANX_INSECURE": "0"}, config=TLS_CFG), ("/etc/phalanx/admin", f"{CFG} (tls_dir)", TLS_CFG.addresses, f"{CFG} (addresses)")),
    "addresses: the argument over the variable and the file": (dict(addresses="h:1", tls_dir="/a", env={"PHALANX_ADDRESS": "e:2"}, config=TLS_CFG), ("/a", "tls_dir=", ("h:1",), "addresses=")),
    "addresses: the variable over the file": (dict(tls_dir="/a", env={"PHALANX_ADDRESS": "e:2,e:3"}, config=TLS_CFG), ("/a", "tls_dir=", ("e:2", "e:3"), "$PHALANX_ADDRESS")),
}


@pytest.mark.parametrize("name", RESOLVED)
def test_resolve_connection(name: str) -> None:
    kwargs, (tls_dir, tls_from, addresses, addresses_from) = RESOLVED[name]
    kwargs = {"addresses": None, "tls_dir": None, "insecure": False, **kwargs}
    conn = resolve_connection(**kwargs)
    assert (str(conn.tls_dir) if conn.tls_dir else None, conn.tls_from) == (tls_dir, tls_from)
    assert (conn.addresses, conn.addresses_from) == (addresses, addresses_from)


REFUSED = {
    "nothing at all": (dict(env={}, config=None), ["tls_dir=", "$PHALANX_TLS_DIR", "$PHALANX_CONFIG", "~/.config/phalanx/config.yaml", "insecure=True", "PHALANX_INSECURE=1"]),
    "a config file with neither": (dict(env={}, config=EMPTY_CFG), ["no credentials"]),
    "nothing, in the CLI's words": (dict(env={}, config=None, cli=True), ["--tls-dir", "$PHALANX_TLS_DIR", "$PHALANX_CONFIG", "--insecure", "PHALANX_INSECURE=1"]),
    "TLS and plaintext in the arguments": (dict(tls_dir="/a", insecure=True, env={}, config=None), ["tls_dir= and insecure=True exclude each other"]),
    "TLS and plaintext in the variables": (dict(env={"PHALANX_TLS_DIR": "/e", "PHALANX_INSECURE": "1"}, config=None), ["$PHALANX_TLS_DIR and PHALANX_INSECURE=1 exclude each other"]),
    "PHALANX_INSECURE not a flag": (dict(env={"PHALANX_INSECURE": "maybe"}, config=None), ["$PHALANX_INSECURE: must be 1 or 0", "'maybe'"]),
    "a bad address in the variable": (dict(tls_dir="/a", env={"PHALANX_ADDRESS": "h:0"}, config=None), ["$PHALANX_ADDRESS: ", "port must be between 1 and 65535"]),
    "a bad address before missing credentials": (dict(addresses="nope", env={}, config=None, cli=True), ["--address: 'nope' is not host:port"]),
}


@pytest.mark.parametrize("name", REFUSED)
def test_resolve_connection_refuses(name: str) -> None:
    kwargs, words = REFUSED[name]
    kwargs = {"addresses": None, "tls_dir": None, "insecure": False, **kwargs}
    with pytest.raises(ClientConfigError) as info:
        resolve_connection(**kwargs)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_parse_client_config_reads_the_fields_relative_to_the_file() -> None:
    cfg = parse_client_config("cluster: prod\naddresses: [10.0.0.1:7070, 'grpc://10.0.0.2:7070/']\ntls_dir: admin\n",
                              Path("/home/u/.config/phalanx/config.yaml"))
    assert cfg == ClientConfig(Path("/home/u/.config/phalanx/config.yaml"), "prod", ("10.0.0.1:7070", "10.0.0.2:7070"),
                               Path("/home/u/.config/phalanx/admin"), False)
    assert parse_client_config("tls_dir: /abs/dir\n", CFG).tls_dir == Path("/abs/dir")
    assert parse_client_config("addresses: h:1\ninsecure: true\n", CFG) == ClientConfig(CFG, None, ("h:1",), None, True)
    assert parse_client_config("", CFG) == EMPTY_CFG


BAD_FILES = {
    "not yaml": ("a: [", "not YAML"),
    "not a mapping": ("- a\n- b\n", "must be a mapping"),
    "unknown field": ("tls-dir: x\n", "unknown field(s) tls-dir"),
    "addresses not a list": ("addresses: {a: 1}\n", "addresses: must be a list"),
    "a bad address": ("addresses: [h:99999]\n", "addresses: 'h:99999': port must be between 1 and 65535"),
    "tls_dir not a path": ("tls_dir: 3\n", "tls_dir: must be a directory path"),
    "insecure not a bool": ("insecure: yes please\n", "insecure: must be true or false"),
    "both": ("tls_dir: a\ninsecure: true\n", "exclude each other"),
    "cluster empty": ("cluster: ''\n", "cluster: must be a non-empty string"),
}


@pytest.mark.parametrize("name", BAD_FILES)
def test_parse_client_config_refuses_naming_the_file_and_field(name: str) -> None:
    text, words = BAD_FILES[name]
    with pytest.raises(ClientConfigError) as info:
        parse_client_config(text, CFG)
    assert str(info.value).startswith(f"{CFG}: ") and words in str(info.value), str(info.value)


def test_read_client_config_named_default_and_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    # The default file is read only if it exists.
    assert client.read_client_config({}) is None
    default = tmp_path / ".config" / "phalanx" / "config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text("addresses: [h:1]\ntls_dir: creds\n")
    assert client.read_client_config({}) == ClientConfig(default, None, ("h:1",), tmp_path / ".config/phalanx/creds")
    # A named one must exist.
    with pytest.raises(ClientConfigError, match=r"\$PHALANX_CONFIG=.*nowhere.yaml: no such file"):
        client.read_client_config({"PHALANX_CONFIG": str(tmp_path / "nowhere.yaml")})
    named = tmp_path / "other.yaml"
    named.write_text("insecure: true\n")
    conn = client.connection_settings(env={"PHALANX_CONFIG": str(named)})
    assert conn.tls_dir is None and conn.tls_from == f"{named} (insecure: true)"


def test_a_client_without_credentials_is_refused_before_any_connection(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PHALANX_TLS_DIR", "PHALANX_CONFIG", "PHALANX_INSECURE", "PHALANX_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ClientConfigError, match="no credentials"):
        client.Client("127.0.0.1:1")
    with pytest.raises(ClientConfigError, match="no credentials"):
        client.AsyncClient()
    assert client.AsyncClient("127.0.0.1:1", insecure=True).connection.tls_from == "insecure=True"
