"""One record type per etcd record (issue #14 item 3, docs/design.md §19.3):
the records that were read as raw JSON until now (decisions, member
summaries, names, idempotency keys) round-trip through their type, parse the
shapes already stored in etcd, and refuse a record they cannot read with a
BadRecord (a ValueError, so records.UNREADABLE covers it) naming the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from coordinator.core.progress import MemberReport
from coordinator.core.records import UNREADABLE, BadRecord, IdempotencyRecord, MemberSummary, NameRecord
from coordinator.core.twophase_model import DecisionRecord, Outcome
from phalanx.model import MemberPhase


def stored(value: Any) -> Any:
    """What a reader gets back: the value as the store encodes it, decoded."""
    return json.loads(json.dumps(value, sort_keys=True, separators=(",", ":")))


# --- decisions/<gang>/<inc> -----------------------------------------------------


@pytest.mark.parametrize("rec", [
    DecisionRecord(gang="g-1", incarnation=1, outcome=Outcome.COMMIT, by="az-a", reason="all voted YES"),
    DecisionRecord(gang="g-1", incarnation=7, outcome=Outcome.ABORT, by="az-b", reason="in doubt past prepare_timeout_s"),
    DecisionRecord(gang="g-1", incarnation=2, outcome=Outcome.ABORT),
], ids=["commit", "abort-by-participant", "no-by-no-reason"])
def test_a_decision_round_trips(rec: DecisionRecord) -> None:
    assert DecisionRecord.from_dict(stored(rec.to_dict()), gang=rec.gang, incarnation=rec.incarnation) == rec


def test_a_decision_stores_the_shape_the_chaos_checker_and_old_coordinators_read() -> None:
    rec = DecisionRecord(gang="g-1", incarnation=3, outcome=Outcome.COMMIT, by="az-a", reason="r")
    assert rec.to_dict() == {"outcome": "COMMIT", "by": "az-a", "reason": "r"}


@pytest.mark.parametrize("old,want", [
    ({"outcome": "COMMIT", "by": "az-a", "reason": "all voted YES"}, (Outcome.COMMIT, "az-a", "all voted YES")),
    ({"outcome": "ABORT"}, (Outcome.ABORT, "", "")),
    ({"outcome": "ABORT", "by": "az-c", "reason": "", "later": 1}, (Outcome.ABORT, "az-c", "")),
], ids=["as-written", "outcome-only", "unknown-field-ignored"])
def test_stored_decisions_parse(old: dict, want: tuple) -> None:
    rec = DecisionRecord.from_dict(old, gang="g-9", incarnation=4)
    assert (rec.outcome, rec.by, rec.reason) == want and rec.key == ("g-9", 4)


@pytest.mark.parametrize("bad,field", [
    ([1, 2], "not a JSON object"),
    ({}, "'outcome' is missing"),
    ({"outcome": "MAYBE"}, "'outcome'"),
    ({"outcome": "commit"}, "'outcome'"),
    ({"outcome": None}, "'outcome'"),
    ({"outcome": "COMMIT", "by": 3}, "'by'"),
    ({"outcome": "COMMIT", "reason": ["x"]}, "'reason'"),
], ids=["not-object", "no-outcome", "unknown-outcome", "lower-case", "null-outcome", "by-not-str", "reason-not-str"])
def test_an_unreadable_decision_is_refused_naming_the_field(bad: Any, field: str) -> None:
    with pytest.raises(BadRecord, match="decision record") as err:
        DecisionRecord.from_dict(bad, gang="g-1", incarnation=1)
    assert field in str(err.value)
    assert isinstance(err.value, UNREADABLE)


@pytest.mark.parametrize("suffix,want", [("g-1/3", ("g-1", 3)), ("train-0a1b2c3d/12", ("train-0a1b2c3d", 12))])
def test_a_decision_key_names_its_gang_and_incarnation(suffix: str, want: tuple) -> None:
    assert DecisionRecord.key_of(suffix) == want


@pytest.mark.parametrize("suffix", ["g-1", "g-1/", "/3", "g-1/x", "g-1/-1", "g-1/3/4"])
def test_a_key_that_is_not_a_decision_key_is_refused(suffix: str) -> None:
    with pytest.raises(BadRecord, match="not <gang>/<incarnation>"):
        DecisionRecord.key_of(suffix)


# --- members/<gang>/<az> --------------------------------------------------------

RUNNING = MemberReport(MemberPhase.RUNNING, 0, "", "n1")
FAILED = MemberReport(MemberPhase.FAILED, 3, "exit 3", "n2")


@pytest.mark.parametrize("reports", [{}, {0: RUNNING}, {10: FAILED, 2: RUNNING}], ids=["none", "one", "ranks-unordered"])
def test_a_member_summary_round_trips(reports: dict) -> None:
    rec = MemberSummary.of(2, "az-b", reports)
    back = MemberSummary.from_dict(stored(rec.to_dict()))
    assert back == rec and back.reports() == reports


def test_summaries_of_the_same_reports_are_equal_however_listed() -> None:
    # The writer skips a write of what it already wrote by this equality.
    assert MemberSummary.of(1, "az-a", {1: FAILED, 0: RUNNING}) == MemberSummary.of(1, "az-a", {0: RUNNING, 1: FAILED})
    assert MemberSummary.of(1, "az-a", {0: RUNNING}) != MemberSummary.of(1, "az-a", {0: FAILED})


def test_a_member_summary_stores_the_shape_written_before() -> None:
    assert MemberSummary.of(4, "az-c", {1: FAILED}).to_dict() == {
        "incarnation": 4, "az": "az-c", "members": {"1": {"phase": 4, "exit_code": 3, "reason": "exit 3", "node": "n2"}}}


@pytest.mark.parametrize("old,want", [
    ({"incarnation": 1, "az": "az-z", "members": {}}, {}),
    ({"incarnation": 1, "az": "az-z"}, {}),
    ({"incarnation": 1, "az": "az-a", "members": {"3": {"phase": 5}}}, {3: MemberReport(MemberPhase.STOPPED)}),
    ({"incarnation": 1, "az": "az-a", "members": {"0": {"phase": 2, "exit_code": 0, "reason": "", "node": "n1"}}},
     {0: RUNNING}),
], ids=["empty", "no-members-field", "phase-only", "as-written"])
def test_stored_member_summaries_parse(old: dict, want: dict) -> None:
    assert MemberSummary.from_dict(old).reports() == want


@pytest.mark.parametrize("bad,field", [
    ("x", "not a JSON object"),
    ({"az": "az-a"}, "'incarnation' is missing"),
    ({"incarnation": 1}, "'az' is missing"),
    ({"incarnation": "1", "az": "az-a"}, "'incarnation'"),
    ({"incarnation": True, "az": "az-a"}, "'incarnation'"),
    ({"incarnation": 1, "az": 7}, "'az'"),
    ({"incarnation": 1, "az": "az-a", "members": []}, "'members'"),
    ({"incarnation": 1, "az": "az-a", "members": {"r0": {"phase": 2}}}, "'members.r0'"),
    ({"incarnation": 1, "az": "az-a", "members": {"-1": {"phase": 2}}}, "'members.-1'"),
    ({"incarnation": 1, "az": "az-a", "members": {"0": 2}}, "members.0"),
    ({"incarnation": 1, "az": "az-a", "members": {"0": {}}}, "'phase' is missing"),
    ({"incarnation": 1, "az": "az-a", "members": {"0": {"phase": 99}}}, "'members.0.phase'"),
    ({"incarnation": 1, "az": "az-a", "members": {"0": {"phase": "2"}}}, "'members.0.phase'"),
    ({"incarnation": 1, "az": "az-a", "members": {"0": {"phase": 4, "exit_code": "3"}}}, "'members.0.exit_code'"),
    ({"incarnation": 1, "az": "az-a", "members": {"0": {"phase": 4, "reason": 3}}}, "'members.0.reason'"),
    ({"incarnation": 1, "az": "az-a", "members": {"0": {"phase": 4, "node": None}}}, "'members.0.node'"),
], ids=["not-object", "no-incarnation", "no-az", "incarnation-str", "incarnation-bool", "az-not-str",
        "members-list", "rank-not-number", "rank-negative", "member-not-object", "no-phase", "phase-unknown",
        "phase-str", "exit-code-str", "reason-not-str", "node-null"])
def test_an_unreadable_member_summary_is_refused_naming_the_field(bad: Any, field: str) -> None:
    with pytest.raises(BadRecord, match="member summary") as err:
        MemberSummary.from_dict(bad)
    assert field in str(err.value)


# --- names/<name>, idempotency/<key> --------------------------------------------


@pytest.mark.parametrize("cls", [NameRecord, IdempotencyRecord])
def test_a_gang_pointer_round_trips_in_the_stored_shape(cls: type) -> None:
    rec = cls("train-0a1b2c3d")
    assert rec.to_dict() == {"id": "train-0a1b2c3d"}
    assert cls.from_dict(stored(rec.to_dict())) == rec


def test_a_name_and_an_idempotency_record_are_different_types() -> None:
    assert NameRecord("g-1") != IdempotencyRecord("g-1")


@pytest.mark.parametrize("cls,what", [(NameRecord, "name record"), (IdempotencyRecord, "idempotency record")])
@pytest.mark.parametrize("bad,field", [
    (["g-1"], "not a JSON object"),
    ({}, "'id' is missing"),
    ({"id": 7}, "'id'"),
    ({"id": ""}, "'id' is empty"),
], ids=["not-object", "no-id", "id-not-str", "id-empty"])
def test_an_unreadable_gang_pointer_is_refused_naming_record_and_field(cls: type, what: str, bad: Any, field: str) -> None:
    with pytest.raises(BadRecord, match=what) as err:
        cls.from_dict(bad)
    assert field in str(err.value)
