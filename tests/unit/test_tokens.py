"""Bearer token files (coordinator/tokens.py): the line format and its
errors, the lookup, the authorization header, and re-reading on change."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.tokens import (
    MAX_TOKEN_BYTES, TokenFileError, TokenRefused, TokenSource, bearer_token, hash_token, lookup, new_token, parse_tokens,
)
from phalanx.certs import Identity

T1, T2 = "token-one-" + "x" * 30, "token-two-" + "y" * 30
H1, H2 = hash_token(T1), hash_token(T2)


def test_hash_and_new_token() -> None:
    assert H1.startswith("sha256:") and len(H1) == len("sha256:") + 64
    a, b = new_token(), new_token()
    assert a != b and len(a) >= 40


def test_parse_and_lookup() -> None:
    text = f"# who\n\n{H1} submitter alice queues=a,b\n  {H2} admin root  \n"
    entries = parse_tokens(text, cluster="c")
    assert [e.line for e in entries] == [3, 4]
    assert lookup(entries, T1) == Identity("c", "submitter", "alice", queues=("a", "b"))
    assert lookup(entries, T2) == Identity("c", "admin", "root")
    assert lookup(entries, "token-one-") is None
    assert lookup(entries, T1 + "z") is None
    assert lookup((), T1) is None
    assert parse_tokens("", cluster="c") == ()


@pytest.mark.parametrize("line,words", [
    ("sha256:abc viewer eve", ("f:1", "hash", "64 lowercase hex")),
    (f"{T1} viewer eve", ("hash", "never written here")),
    (H1.upper().replace("SHA256", "sha256") + " viewer eve", ("hash",)),
    (f"{H1} agent n1", ("role", "agent", "certificates")),
    (f"{H1} coordinator c1", ("role",)),
    (f"{H1} viewer a/b", ("name", "node name")),
    (f"{H1} submitter alice", ("queues", "required for a submitter")),
    (f"{H1} viewer eve queues=a", ("queues", "only for a submitter")),
    (f"{H1} submitter alice queues=A_B", ("queues", "DNS label")),
    (f"{H1} submitter alice queues=a,a", ("queues", "twice")),
    (f"{H1} submitter alice nodes=a", ("4th field", "queues=")),
    (f"{H1} viewer", ("expected", "2 field")),
    (f"{H1} viewer eve x y", ("5 field",)),
])
def test_bad_lines_name_the_line_and_field(line: str, words: tuple[str, ...]) -> None:
    with pytest.raises(TokenFileError) as e:
        parse_tokens(f"{line}\n", cluster="c", path="f")
    msg = str(e.value)
    assert msg.startswith("f:1: "), msg
    for w in words:
        assert w in msg, (w, msg)
    assert T1 not in msg  # a token pasted by mistake is not echoed into logs


def test_the_same_token_twice_is_refused() -> None:
    with pytest.raises(TokenFileError, match=r"f:3: hash: the same token as line 1"):
        parse_tokens(f"{H1} viewer a\n# x\n{H1} admin b\n", cluster="c", path="f")


def test_every_bad_line_is_named() -> None:
    with pytest.raises(TokenFileError) as e:
        parse_tokens(f"{H1} viewer ok\nbad\n{H2} wizard x\n", cluster="c", path="f")
    assert "f:2:" in str(e.value) and "f:3:" in str(e.value) and "f:1:" not in str(e.value)


@pytest.mark.parametrize("metadata,expected", [
    ((), None),
    ((("x-other", "1"),), None),
    ((("authorization", f"Bearer {T1}"),), T1),
    ((("authorization", f"bearer   {T1}  "),), T1),
])
def test_bearer_header(metadata: tuple, expected: str | None) -> None:
    assert bearer_token(metadata) == expected


@pytest.mark.parametrize("metadata,words", [
    ((("authorization", T1),), "'Bearer <token>'"),
    ((("authorization", f"Basic {T1}"),), "'Bearer <token>'"),
    ((("authorization", "Bearer "),), "'Bearer <token>'"),
    ((("authorization", "Bearer " + "x" * (MAX_TOKEN_BYTES + 1)),), "longer than"),
    ((("authorization", f"Bearer {T1}"), ("authorization", f"Bearer {T2}")), "more than one"),
    ((("authorization", b"Bearer x"),), "not text"),
])
def test_bad_bearer_headers_are_refused_without_echo(metadata: tuple, words: str) -> None:
    with pytest.raises(TokenRefused) as e:
        bearer_token(metadata)
    assert words in str(e.value) and T1 not in str(e.value)


def test_source_follows_the_file_and_keeps_the_last_good(tmp_path: Path) -> None:
    f = tmp_path / "tokens"
    f.write_text(f"{H1} viewer eve\n")
    src = TokenSource(f, cluster="c")
    assert src.identify(T1).name == "eve"
    with pytest.raises(TokenRefused) as e:
        src.identify(T2)
    assert "unknown" in str(e.value) and T2 not in str(e.value)
    # Rotation: add the new token, then remove the old one.
    f.write_text(f"{H1} viewer eve\n{H2} viewer eve\n")
    assert src.identify(T2).name == "eve" and src.identify(T1).name == "eve"
    f.write_text(f"{H2} viewer eve\n")
    with pytest.raises(TokenRefused):
        src.identify(T1)
    # A broken edit is refused as a whole: the last good entries stay.
    f.write_text(f"{H2} viewer eve\n{H1} wizard x\n")
    assert src.identify(T2).name == "eve"
    assert src.last_error is not None and ":2: role" in str(src.last_error)
    f.write_text(f"{H1} admin root\n")
    assert src.identify(T1).role == "admin" and src.last_error is None


def test_source_refuses_to_start_on_a_bad_file(tmp_path: Path) -> None:
    with pytest.raises(TokenFileError, match="cannot read"):
        TokenSource(tmp_path / "absent", cluster="c")
    f = tmp_path / "tokens"
    f.write_text("sha256:00 viewer eve\n")
    with pytest.raises(TokenFileError, match=rf"{f}:1: hash"):
        TokenSource(f, cluster="c")
