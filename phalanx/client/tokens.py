"""Bearer tokens (docs/security.md "Bearer tokens"): which token a client
sends (``resolve_token``: the argument, else ``$PHALANX_TOKEN``), the CLI's
``--token-file``, and the channel credentials that send it over TLS."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import grpc

from phalanx.client.config import ClientConfigError
from phalanx.client_names import TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE
from phalanx.tls import TlsError, TlsFiles, ca_pem_cluster, client_pems

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
