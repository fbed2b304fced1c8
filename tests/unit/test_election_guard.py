"""The leader's guard on its own record (coordinator/election.py
``record_problem``): a table of what a leader record read back can be, and
whether the leader that wrote it under ``EPOCH`` with ``LEASE`` may go on."""

from __future__ import annotations

import json

import pytest

from coordinator.election import record_problem
from phalanx.store import KV

EPOCH, LEASE = 40, 0x7A
VALUE = {"id": "c0", "address": "127.0.0.1:5000"}


def kv(value: object = VALUE, *, create: int = EPOCH, mod: int = EPOCH, lease: int = LEASE) -> KV:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    return KV(key="/phalanx/t/leader/az-a", value=raw, create_revision=create, mod_revision=mod, version=1, lease=lease)


@pytest.mark.parametrize("record,words", [
    (kv(), None),
    (kv(mod=EPOCH + 9), None),  # same content re-put with our lease: still ours
    (None, "deleted"),
    (kv(create=EPOCH + 3), "recreated"),
    (kv(lease=0), "detached"),
    (kv(lease=0x99), "lease 99"),
    (kv({"id": "c0", "address": "10.9.9.9:1"}), "another value"),
    (kv({"id": "c9", "address": "127.0.0.1:5000"}), "another value"),
    (kv(b"\xff garbage"), "unreadable"),
    (kv(b"[1, 2]"), "another value"),
])
def test_record_problem(record: KV | None, words: str | None) -> None:
    why = record_problem(record, VALUE, LEASE, EPOCH)
    if words is None:
        assert why is None
    else:
        assert why is not None and words in why, why
