"""The policy record's format (coordinator/policy_store.py): what is
written reads back, and a record that cannot be used names the key, its
revision and the field."""

from __future__ import annotations

import json

import pytest

from coordinator.core.authz import PolicyError, parse_policy
from coordinator.policy_store import RECORD_FORMAT, record_data, record_from_kv
from phalanx.store import KV, encode

KEY = "/phalanx/c/policy"


def kv(value: object, rev: int = 7) -> KV:
    raw = value if isinstance(value, bytes) else encode(value)
    return KV(KEY, raw, 3, rev, 2, 0)


def test_written_record_reads_back() -> None:
    p = parse_policy({"max_priority": {"submitter": 3}, "submitters": {"bob": {"max_priority": 9}}, "visibility": "own"})
    data = record_data(p, set_by="admin/root", set_at=12.5)
    assert data["format"] == RECORD_FORMAT and json.loads(encode(data)) == data
    r = record_from_kv(kv(data))
    assert (r.policy, r.revision, r.set_by, r.set_at) == (p, 7, "admin/root", 12.5)


@pytest.mark.parametrize("value,words", [
    (b"{", ("not JSON",)),
    ([], ("must be a JSON object",)),
    ({"policy": {}}, ("format: must be 1",)),
    ({"format": 2, "policy": {}}, ("format: must be 1", "got 2")),
    ({"format": 1, "policy": {"visibility": "x"}}, ("policy: visibility",)),
    ({"format": 1, "policy": []}, ("policy: the policy must be a mapping",)),
])
def test_unusable_records_name_key_revision_and_field(value: object, words: tuple[str, ...]) -> None:
    with pytest.raises(PolicyError) as e:
        record_from_kv(kv(value, rev=41))
    msg = str(e.value)
    assert msg.startswith(f"{KEY} (revision 41): "), msg
    for w in words:
        assert w in msg, (w, msg)


def test_odd_metadata_does_not_stop_a_valid_policy() -> None:
    r = record_from_kv(kv({"format": 1, "policy": {}, "set_by": 5, "set_at": True}))
    assert r.set_by == "" and r.set_at == 0.0 and r.policy == parse_policy({})
