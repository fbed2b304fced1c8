"""Bearer tokens for GangService (docs/security.md "Bearer tokens").

A coordinator started with ``--token-file FILE`` accepts, besides client
certificates, GangService calls that carry ``authorization: Bearer <token>``
over TLS. The file holds only hashes, one token a line::

    # comment
    sha256:<64 hex> <role> <name> [queues=q1,q2]

``role`` is admin, submitter or viewer (agents and coordinators always use
certificates); ``queues=`` is required for a submitter and refused for the
others, as in a certificate. The hash is a plain SHA-256, so a token must
be random and long (``new_token``: 256 bits), not a password.

Pure parts: ``parse_tokens`` (every bad line and field named), ``lookup``
(compares the presented token's hash with every entry in constant time, no
early exit), ``bearer_token`` (the metadata). ``TokenSource`` is the thin
driver: it reads the file at start-up (an unusable file stops the start)
and again whenever its stat changes, so rotation needs no restart (add the
new token's line, move the clients, remove the old line); a changed file
that does not parse is logged once and the previous entries are kept.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from phalanx.certs import MAX_NAME_LEN, MAX_QUEUES, Identity
from phalanx.limits import DNS_LABEL, DNS_LABEL_WHAT, MAX_QUEUE_LEN, NODE_NAME, NODE_NAME_WHAT, name_error

log = logging.getLogger(__name__)

TOKEN_ROLES = ("admin", "submitter", "viewer")
HASH_PREFIX = "sha256:"
_HEX64 = re.compile(r"[0-9a-f]{64}")
# A presented token longer than this is refused before it is hashed.
MAX_TOKEN_BYTES = 1024
MAX_TOKEN_LINES = 10_000
AUTHORIZATION = "authorization"
SCHEME = "bearer"


class TokenFileError(ValueError):
    """A token file that cannot be used; the message names the file, the
    line and the field."""


class TokenRefused(ValueError):
    """A presented token that cannot be used; the message names the check
    and never contains the token."""


@dataclass(frozen=True)
class TokenEntry:
    digest: bytes
    identity: Identity
    line: int


def hash_token(token: str) -> str:
    """The line prefix for ``token``: ``sha256:<hex>``."""
    return HASH_PREFIX + hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def _line_errors(fields: list[str], cluster: str) -> tuple[list[str], TokenEntry | None, bytes]:
    errors: list[str] = []
    if len(fields) not in (3, 4):
        return [f"expected 'sha256:<hex> <role> <name> [queues=q1,q2]', got {len(fields)} field(s)"], None, b""
    digest_text, role, name = fields[:3]
    extra = fields[3] if len(fields) == 4 else ""
    digest = b""
    if not digest_text.startswith(HASH_PREFIX) or not _HEX64.fullmatch(digest_text[len(HASH_PREFIX):]):
        errors.append("hash: must be sha256:<64 lowercase hex digits> (the token itself is never written here)")
    else:
        digest = bytes.fromhex(digest_text[len(HASH_PREFIX):])
    if role not in TOKEN_ROLES:
        errors.append(f"role: must be one of {', '.join(TOKEN_ROLES)} (agents and coordinators use certificates), got {role[:40]!r}")
    why = name_error(name, NODE_NAME, MAX_NAME_LEN, NODE_NAME_WHAT)
    if why:
        errors.append(f"name: {why}"[:200])
    queues: tuple[str, ...] = ()
    if extra:
        if not extra.startswith("queues="):
            errors.append(f"4th field: only queues=q1,q2 may follow the name, got {extra[:40]!r}")
        else:
            queues = tuple(extra[len("queues="):].split(","))
            for q in queues:
                why = name_error(q, DNS_LABEL, MAX_QUEUE_LEN, DNS_LABEL_WHAT)
                if why:
                    errors.append(f"queues: a queue {why}"[:200])
            if len(set(queues)) != len(queues):
                errors.append("queues: names a queue twice")
            if len(queues) > MAX_QUEUES:
                errors.append(f"queues: at most {MAX_QUEUES}, got {len(queues)}")
    if role == "submitter" and not queues:
        errors.append("queues: required for a submitter (queues=q1,q2: the queues it may submit to)")
    elif role in TOKEN_ROLES and role != "submitter" and extra:
        errors.append(f"queues: only for a submitter, not {role!r}")
    if errors:
        return errors, None, digest
    return [], TokenEntry(digest, Identity(cluster, role, name, queues=queues), 0), digest


def parse_tokens(text: str, *, cluster: str, path: str = "token file") -> tuple[TokenEntry, ...]:
    """The entries of a token file; TokenFileError naming ``path:line`` and
    the field of every bad line. An empty file is allowed (no token is
    accepted: the way to revoke the last one)."""
    errors: list[str] = []
    entries: list[TokenEntry] = []
    seen: dict[bytes, int] = {}
    lines = text.splitlines()
    if len(lines) > MAX_TOKEN_LINES:
        raise TokenFileError(f"{path}: {len(lines)} lines, above the limit of {MAX_TOKEN_LINES}")
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        why, entry, digest = _line_errors(line.split(), cluster)
        if digest and digest in seen:
            why.append(f"hash: the same token as line {seen[digest]} (one token, one identity)")
        elif digest:
            seen[digest] = n
        errors.extend(f"{path}:{n}: {w}" for w in why)
        if entry is not None and not why:
            entries.append(TokenEntry(entry.digest, entry.identity, n))
    if errors:
        raise TokenFileError("; ".join(errors[:20]) + (f"; ... {len(errors) - 20} more" if len(errors) > 20 else ""))
    return tuple(entries)


def lookup(entries: Iterable[TokenEntry], token: str) -> Identity | None:
    """The identity of ``token``, or None. Every entry is compared (with
    hmac.compare_digest) whatever matched, so the time taken does not say
    how close a guess came or which line matched."""
    digest = hashlib.sha256(token.encode()).digest()
    found = None
    for e in entries:
        if hmac.compare_digest(e.digest, digest):
            found = e.identity
    return found


def bearer_token(metadata: Iterable[tuple[str, Any]]) -> str | None:
    """The token of an ``authorization: Bearer <token>`` header; None when
    the call has no authorization header; TokenRefused for a malformed one
    (the message never echoes it)."""
    values = [v for k, v in metadata if k.lower() == AUTHORIZATION]
    if not values:
        return None
    if len(values) > 1:
        raise TokenRefused("bearer token: the call carries more than one authorization header")
    value = values[0]
    if not isinstance(value, str):
        raise TokenRefused("bearer token: the authorization header is not text")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != SCHEME or not token.strip():
        raise TokenRefused("bearer token: the authorization header must be 'Bearer <token>'")
    token = token.strip()
    if len(token.encode()) > MAX_TOKEN_BYTES:
        raise TokenRefused(f"bearer token: longer than {MAX_TOKEN_BYTES} bytes")
    return token


def _stat_key(path: Path) -> tuple[Any, ...]:
    try:
        st = os.stat(path)
        return (st.st_ino, st.st_mtime_ns, st.st_size, st.st_ctime_ns)
    except OSError as exc:
        return ("missing", exc.errno)


def load_tokens(path: Path, *, cluster: str) -> tuple[TokenEntry, ...]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenFileError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    return parse_tokens(text, cluster=cluster, path=str(path))


class TokenSource:
    """The entries of ``--token-file``, following the file on disk (see the
    module docstring). The first load raises TokenFileError."""

    def __init__(self, path: Path | str, *, cluster: str) -> None:
        self.path = Path(path)
        self.cluster = cluster
        self._seen = _stat_key(self.path)
        self.entries = load_tokens(self.path, cluster=cluster)
        self._refused: tuple[Any, ...] | None = None
        self.last_error: TokenFileError | None = None
        log.info("bearer tokens: %d from %s", len(self.entries), self.path)

    def refresh(self) -> None:
        """Read the file again if its stat changed; keep the current
        entries (and log once) if the new content is refused."""
        seen = _stat_key(self.path)
        if seen == self._seen or seen == self._refused:
            return
        try:
            entries = load_tokens(self.path, cluster=self.cluster)
        except TokenFileError as exc:
            self._refused, self.last_error = seen, exc
            log.error("bearer tokens: keeping the %d current tokens: the file on disk is refused: %s", len(self.entries), exc)
            return
        self._seen, self._refused, self.last_error = seen, None, None
        self.entries = entries
        log.info("bearer tokens: now %d from %s", len(entries), self.path)

    def identify(self, token: str) -> Identity:
        """The identity of ``token``; TokenRefused when no line of the file
        (as it is now) holds its hash."""
        self.refresh()
        identity = lookup(self.entries, token)
        if identity is None:
            raise TokenRefused(f"bearer token: unknown (no line of {self.path} holds its hash)")
        return identity
