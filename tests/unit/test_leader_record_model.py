"""The one leader record model (phalanx/leader_record.py): the stored shape,
its parser (every missing or mistyped field refused by name, an oversized
record refused), and the value the campaign writes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from phalanx.leader_record import BadLeaderRecord, LeaderInfo
from phalanx.limits import MAX_LEADER_RECORD_BYTES
from phalanx.store import KV, encode

STORED = {"id": "coord-a1", "address": "10.0.0.5:50051"}


def kv_of(value: bytes, create: int = 17, lease: int = 0x2a) -> KV:
    return KV(key="/phalanx/c1/leader/az-a", value=value, create_revision=create, mod_revision=create, version=1,
              lease=lease)


def test_a_stored_record_parses_with_the_epoch_and_lease_of_the_read() -> None:
    info = LeaderInfo.from_kv("az-a", kv_of(encode(STORED)))
    assert info == LeaderInfo(az="az-a", coordinator_id="coord-a1", address="10.0.0.5:50051", epoch=17, lease=0x2a)


def test_the_campaign_writes_what_the_parser_reads_back() -> None:
    value = LeaderInfo.value("coord-a1", "10.0.0.5:50051")
    assert value == STORED
    assert LeaderInfo.from_kv("az-a", kv_of(encode(value))).coordinator_id == "coord-a1"


def test_unknown_fields_of_a_newer_writer_are_ignored() -> None:
    info = LeaderInfo.from_dict("az-a", {**STORED, "since": 12.5}, epoch=3)
    assert (info.coordinator_id, info.address, info.epoch) == ("coord-a1", "10.0.0.5:50051", 3)


REFUSED: list[tuple[str, Any, str]] = [
    ("id missing", {"address": "h:1"}, "leader/az-a: id is missing"),
    ("address missing", {"id": "c1"}, "leader/az-a: address is missing"),
    ("id not a string", {"id": 7, "address": "h:1"}, "leader/az-a: id must be a string, got int"),
    ("address not a string", {"id": "c1", "address": ["h:1"]}, "leader/az-a: address must be a string, got list"),
    ("id null", {"id": None, "address": "h:1"}, "leader/az-a: id must be a string, got NoneType"),
    ("id empty", {"id": "", "address": "h:1"}, "leader/az-a: id must not be empty"),
    ("address blank", {"id": "c1", "address": "  "}, "leader/az-a: address must not be empty"),
    ("id with a slash", {"id": "a/b", "address": "h:1"}, "leader/az-a: id must contain no '/'"),
    ("not an object", ["c1", "h:1"], "leader/az-a: not a JSON object but list"),
]


@pytest.mark.parametrize("data,message", [(d, m) for _, d, m in REFUSED], ids=[n for n, _, _ in REFUSED])
def test_a_record_with_a_missing_or_mistyped_field_is_refused_naming_it(data: Any, message: str) -> None:
    with pytest.raises(BadLeaderRecord) as e:
        LeaderInfo.from_kv("az-a", kv_of(json.dumps(data).encode()))
    assert str(e.value).startswith(message), str(e.value)
    assert isinstance(e.value, ValueError)  # unreadable like every other record


def test_a_record_that_is_not_json_is_refused() -> None:
    with pytest.raises(BadLeaderRecord, match=r"^leader/az-a: not JSON"):
        LeaderInfo.from_kv("az-a", kv_of(b"\xff{"))


def test_an_oversized_record_is_refused_before_it_is_parsed() -> None:
    big = encode({**STORED, "address": "h" * MAX_LEADER_RECORD_BYTES})
    with pytest.raises(BadLeaderRecord, match=rf"^leader/az-a: the record is {len(big)} bytes, more than the "
                                              rf"{MAX_LEADER_RECORD_BYTES}"):
        LeaderInfo.from_kv("az-a", kv_of(big))
    # The largest record the campaign may write still parses.
    fits = LeaderInfo.value("c", "h" * (MAX_LEADER_RECORD_BYTES - len(encode({"id": "c", "address": ""}))))
    assert LeaderInfo.from_kv("az-a", kv_of(encode(fits))).address == fits["address"]


@pytest.mark.parametrize("cid,address,field", [("", "h:1", "id"), ("a/b", "h:1", "id"), ("c1", "", "address"),
                                                ("c1", "h" * MAX_LEADER_RECORD_BYTES, "id and address")])
def test_the_campaign_refuses_a_value_its_readers_would_refuse(cid: str, address: str, field: str) -> None:
    with pytest.raises(BadLeaderRecord, match=rf"^leader record: {field}"):
        LeaderInfo.value(cid, address)
