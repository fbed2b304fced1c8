"""A client's TLS files, checked once per content (docs/cli.md "Start-up").

Checking a client's three files (``phalanx.tls.load``: the CA parses and
names a cluster, the key is the certificate's, the certificate is the CA's,
for client use, valid now) takes the X.509 library, which costs a short-lived
command such as ``phalanx get`` about a fifth of its run. The verdict is a
function of the three files' bytes and of the time alone, and the time
enters only through the certificate's validity window. So a verdict is
remembered, keyed by a SHA-256 digest of the three files' bytes, with that
window; the next command with the same bytes inside the window skips the
parse. Any change to any file (a renewal, a rotation, a half-written pair)
is another digest, checked in full; an entry past its window is checked in
full again (and then says "expired"). kubectl keeps its discovery cache in
~/.kube/cache the same way.

The file is ``$XDG_CACHE_HOME/phalanx/tls-checks.json`` (default
``~/.cache``), mode 0600 in a 0700 directory, at most ``MAX_ENTRIES``
entries (the least recently checked out). It holds digests, cluster names and
times, nothing a key could be recovered from. Nothing depends on it: an
unreadable, corrupt or unwritable cache is a cache miss, never an error.
It saves time only; the server's handshake checks the certificate anyway.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

MAX_ENTRIES = 64
FILE_NAME = "tls-checks.json"
VERSION = 1


def cache_path(env: Mapping[str, str] | None = None) -> Path | None:
    """Where the verdicts live; None when there is no home to keep them in."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or (str(Path(env["HOME"]) / ".cache") if env.get("HOME") else "")
    return Path(base) / "phalanx" / FILE_NAME if base else None


def digest(ca_pem: bytes, cert_pem: bytes, key_pem: bytes, use: str) -> str:
    """One digest of the three files and the use they were checked for
    (each part length-prefixed, so no two triples share a digest)."""
    h = hashlib.sha256(b"phalanx tls check v1\0" + use.encode() + b"\0")
    for part in (ca_pem, cert_pem, key_pem):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()


def verdict(entries: Mapping[str, Any], key: str, now: datetime.datetime) -> str | None:
    """The cluster remembered for ``key`` if ``now`` is inside its window,
    else None (unknown, malformed or outside: check in full). Pure."""
    e = entries.get(key)
    if not isinstance(e, dict):
        return None
    cluster, start, end = e.get("cluster"), e.get("valid_from"), e.get("valid_until")
    if not isinstance(cluster, str) or not cluster or not isinstance(start, (int, float)) \
            or not isinstance(end, (int, float)):
        return None
    t = now.timestamp()
    return cluster if start <= t <= end else None


def remembered(entries: Mapping[str, Any], key: str, cluster: str, valid_from: datetime.datetime,
               valid_until: datetime.datetime, now: datetime.datetime) -> dict[str, Any]:
    """``entries`` with this verdict added (checked now), the least
    recently checked beyond MAX_ENTRIES dropped. Pure."""
    out = {k: v for k, v in entries.items() if isinstance(v, dict) and k != key}
    out[key] = {"cluster": cluster, "valid_from": valid_from.timestamp(), "valid_until": valid_until.timestamp(),
                "checked": now.timestamp()}
    if len(out) > MAX_ENTRIES:
        keep = sorted(out, key=lambda k: out[k].get("checked", 0) if isinstance(out[k].get("checked"), (int, float)) else 0)
        for k in keep[:len(out) - MAX_ENTRIES]:
            del out[k]
    return out


def read_entries(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("entries"), dict):
        return {}
    return doc["entries"]


def write_entries(path: Path | None, entries: Mapping[str, Any]) -> None:
    """Replace the file atomically; any failure is ignored (a cache)."""
    if path is None:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"version": VERSION, "entries": dict(entries)}, f)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
