"""A client's TLS verdict is remembered per content and window
(phalanx/tls_check_cache.py): the next command skips the X.509 parse, and
no change of bytes or of time lets a bad certificate through the client's
own check. Real certificates from phalanx.certs."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx import certs, tls_check_cache as cache
from phalanx.tls import TlsError, TlsFiles, client_pems

NOW = datetime.datetime(2026, 12, 4, 12, 0, tzinfo=datetime.timezone.utc)
DAY = datetime.timedelta(days=1)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def client_dir(tmp_path: Path, cluster: str = "c1", *, days: int = 30, name: str = "u") -> TlsFiles:
    ca = tmp_path / f"ca-{cluster}"
    if not (ca / certs.CA_CERT).exists():
        certs.init_ca(ca, cluster, now=NOW - DAY)
    crt, key, _ = certs.issue(ca, "admin", name, now=NOW, days=days)
    return TlsFiles(ca / certs.CA_CERT, crt, key)


# --- the pure parts --------------------------------------------------------------------------

def test_verdict_only_inside_the_window() -> None:
    key = "k"
    entries = cache.remembered({}, key, "c1", NOW - DAY, NOW + DAY, NOW)
    assert cache.verdict(entries, key, NOW) == "c1"
    assert cache.verdict(entries, key, NOW + DAY) == "c1"  # the last instant still valid
    assert cache.verdict(entries, key, NOW + DAY + datetime.timedelta(seconds=1)) is None
    assert cache.verdict(entries, key, NOW - DAY - datetime.timedelta(seconds=1)) is None
    assert cache.verdict(entries, "other", NOW) is None


@pytest.mark.parametrize("entry", [None, "x", {}, {"cluster": "", "valid_from": 0, "valid_until": 2e9},
                                   {"cluster": "c", "valid_from": "0", "valid_until": 2e9},
                                   {"cluster": "c", "valid_from": 0}, {"cluster": 3, "valid_from": 0, "valid_until": 2e9}])
def test_a_malformed_entry_is_a_miss(entry) -> None:
    assert cache.verdict({"k": entry}, "k", NOW) is None


def test_bounded_least_recently_checked_out() -> None:
    entries: dict = {}
    for i in range(cache.MAX_ENTRIES + 5):
        entries = cache.remembered(entries, f"k{i}", "c", NOW - DAY, NOW + DAY, NOW + datetime.timedelta(seconds=i))
    assert len(entries) == cache.MAX_ENTRIES
    assert "k0" not in entries and "k4" not in entries and f"k{cache.MAX_ENTRIES + 4}" in entries


def test_the_digest_covers_every_byte_of_every_file_and_the_use() -> None:
    base = cache.digest(b"ca", b"cert", b"key", "client")
    assert len({base, cache.digest(b"ca!", b"cert", b"key", "client"), cache.digest(b"ca", b"cert!", b"key", "client"),
                cache.digest(b"ca", b"cert", b"key!", "client"), cache.digest(b"ca", b"cert", b"key", "server"),
                cache.digest(b"cac", b"ert", b"key", "client")}) == 6


# --- client_pems with real files -----------------------------------------------------------

def test_first_check_is_remembered_then_reused(tmp_path, cache_home) -> None:
    files = client_dir(tmp_path)
    assert client_pems(files, now=NOW)[3] == "c1"
    doc = json.loads((cache_home / "phalanx" / cache.FILE_NAME).read_text())
    (entry,) = doc["entries"].values()
    assert entry["cluster"] == "c1" and entry["valid_until"] == (NOW + 30 * DAY).timestamp()
    assert (cache_home / "phalanx" / cache.FILE_NAME).stat().st_mode & 0o777 == 0o600
    # A hit parses nothing: the same check in a process where cryptography cannot be imported.
    code = ("import sys, datetime; sys.modules['cryptography'] = None\n"
            "from pathlib import Path\nfrom phalanx.tls import TlsFiles, client_pems\n"
            f"f = TlsFiles(Path({str(files.ca)!r}), Path({str(files.cert)!r}), Path({str(files.key)!r}))\n"
            f"print(client_pems(f, now=datetime.datetime.fromisoformat({NOW.isoformat()!r}))[3])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, XDG_CACHE_HOME=str(cache_home)))
    assert out.returncode == 0 and out.stdout.strip() == "c1", out.stderr


def test_past_the_window_the_full_check_says_expired(tmp_path, cache_home) -> None:
    files = client_dir(tmp_path, days=2)
    client_pems(files, now=NOW)
    with pytest.raises(TlsError) as e:
        client_pems(files, now=NOW + 3 * DAY)
    assert e.value.check == certs.CHECK_EXPIRED and e.value.path == str(files.cert)


def test_new_bytes_are_checked_in_full(tmp_path, cache_home) -> None:
    """A file replaced after a passing check (here: a certificate of another
    cluster's CA, key and all) is judged on its own bytes."""
    files = client_dir(tmp_path)
    client_pems(files, now=NOW)
    other = client_dir(tmp_path, "c2")
    files.cert.write_bytes(other.cert.read_bytes())
    files.key.write_bytes(other.key.read_bytes())
    with pytest.raises(TlsError) as e:
        client_pems(files, now=NOW)
    assert e.value.check == certs.CHECK_UNKNOWN_CA


def test_a_remembered_cluster_is_not_another_clusters(tmp_path, cache_home) -> None:
    files = client_dir(tmp_path)
    client_pems(files, now=NOW)
    with pytest.raises(TlsError) as e:
        client_pems(files, cluster="c9", now=NOW)
    assert e.value.check == certs.CHECK_WRONG_CLUSTER


def test_an_unusable_cache_is_a_miss_not_an_error(tmp_path, monkeypatch) -> None:
    files = client_dir(tmp_path)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    assert client_pems(files, now=NOW)[3] == "c1"
    garbage = tmp_path / "garbage"
    (garbage / "phalanx").mkdir(parents=True)
    (garbage / "phalanx" / cache.FILE_NAME).write_text("{not json")
    monkeypatch.setenv("XDG_CACHE_HOME", str(garbage))
    assert client_pems(files, now=NOW)[3] == "c1"
    assert json.loads((garbage / "phalanx" / cache.FILE_NAME).read_text())["version"] == cache.VERSION
