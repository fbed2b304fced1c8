"""Reading a spec document is capped (phalanx.spec.load_spec / read_spec_bytes):
a size limit before parsing, no YAML aliases, bounded nesting, and a key
given twice is an error naming the key and its lines. Every refusal is an
InvalidSpec on ``spec`` (one clear message), never a MemoryError, a
RecursionError or a silent last-one-wins."""

from __future__ import annotations

import io

import pytest

from phalanx.spec import MAX_SPEC_BYTES, MAX_SPEC_DEPTH, InvalidSpec, load_spec, read_spec_bytes

OK = "name: ok\nmembers: 1\nresources: {gpus: 1}\n"

# The shape of the report's 385-byte spec (anchors nested under run.env,
# each level ten aliases of the one before), 4 levels deep instead of 9 so
# that a loader without the cap expands it to 10^4 strings, not 10^9.
LAUGHS = "name: lol\nmembers: 1\nresources: {gpus: 1}\nrun:\n  env:\n    A0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"    A{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 4)
)

REFUSED: list[tuple[str, str, list[str]]] = [
    ("duplicate-top-level-key", "name: dup1\nmembers: 1\nname: dup2\nresources: {gpus: 1}\n", ["duplicate key 'name'", "line 3", "first on line 1"]),
    ("duplicate-nested-key", "name: d\nmembers: 1\nresources:\n  gpus: 1\n  gpus: 2\n", ["duplicate key 'gpus'", "line 5", "first on line 4"]),
    ("duplicate-env-key", "name: d\nmembers: 1\nresources: {gpus: 1}\nrun:\n  env:\n    A: '1'\n    A: '2'\n", ["duplicate key 'A'", "line 7"]),
    ("duplicate-key-in-json", '{"name": "a", "members": 1, "resources": {"gpus": 1}, "members": 2}', ["duplicate key 'members'"]),
    ("alias", "name: &n a\nmembers: 1\nresources: {gpus: 1}\nqueue: *n\n", ["aliases", "*n", "line 4"]),
    ("merge-key-alias", "base: &b {gpus: 1}\nname: a\nmembers: 1\nresources: {<<: *b}\n", ["aliases", "*b"]),
    ("nested-aliases", LAUGHS, ["aliases", "*a0"]),
    ("deep-nesting", "name: " + "[" * 100_000, ["nested more than", str(MAX_SPEC_DEPTH)]),
    ("4301-digit-integer", "name: a\nmembers: " + "9" * 4301 + "\nresources: {gpus: 1}\n", ["not a valid value"]),
    ("over-the-size-limit", OK + "#" * MAX_SPEC_BYTES, ["more than the limit of", str(MAX_SPEC_BYTES)]),
]


@pytest.mark.parametrize("text, words", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_documents_name_spec_and_the_reason(text: str, words: list[str]) -> None:
    with pytest.raises(InvalidSpec) as info:
        load_spec(text)
    assert [e.field for e in info.value.errors] == ["spec"]
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


ACCEPTED: list[tuple[str, str]] = [
    ("plain", OK),
    ("an-anchor-nobody-refers-to", "name: &n ok\nmembers: 1\nresources: {gpus: 1}\n"),
    ("same-key-in-different-mappings", "name: ok\nmembers: 1\nresources: {gpus: 1}\nrun: {env: {name: x}}\n"),
    ("inline-merge-without-alias", "name: ok\nmembers: 1\nresources: {<<: {gpus: 2}, gpus: 1}\n"),
    ("exactly-at-the-size-limit", OK + "#" * (MAX_SPEC_BYTES - len(OK))),
]


@pytest.mark.parametrize("text", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_accepted_documents(text: str) -> None:
    assert load_spec(text).name == "ok"


def test_size_counts_bytes_not_characters() -> None:
    # 'é' is two bytes in UTF-8: a document of MAX/2+1 of them is over.
    with pytest.raises(InvalidSpec, match="more than the limit"):
        load_spec(OK + "#" + "é" * (MAX_SPEC_BYTES // 2))


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_endless_devices_end_at_the_limit(device: str) -> None:
    with open(device, "rb") as f:
        with pytest.raises(InvalidSpec) as info:
            read_spec_bytes(f, device)
    assert device in str(info.value) and str(MAX_SPEC_BYTES) in str(info.value)


READS: list[tuple[str, bytes, str | None]] = [
    ("at-the-limit", b"#" * MAX_SPEC_BYTES, None),
    ("one-byte-over", b"#" * (MAX_SPEC_BYTES + 1), "larger than the limit"),
    ("not-utf8", b"name: \xff\n", "not UTF-8"),
    ("empty", b"", None),
]


@pytest.mark.parametrize("data, error", [c[1:] for c in READS], ids=[c[0] for c in READS])
def test_read_spec_bytes(data: bytes, error: str | None) -> None:
    if error is None:
        assert read_spec_bytes(io.BytesIO(data), "f.yaml") == data.decode()
    else:
        with pytest.raises(InvalidSpec, match=error):
            read_spec_bytes(io.BytesIO(data), "f.yaml")
