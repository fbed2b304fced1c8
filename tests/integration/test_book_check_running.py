"""``--check-book`` (coordinator/book_check.py): a leader whose book goes
inconsistent says so at ERROR after the cycle, once. The harness starts
every coordinator with it, so any integration test whose leader's book
breaks fails at the strict teardown. The failpoint ``leader.corrupt_book``
plants one inconsistency (two gangs holding one GPU) for one check."""

from __future__ import annotations

from coordinator.book_check import PLANTED_NODE
from tests.integration.harness import LocalCluster, until

AZ = "az1"
LINE = f"book inconsistent: {PLANTED_NODE} gpu 0 held by book-check.a and book-check.b"


async def test_an_inconsistent_book_is_logged_at_error_once(local_cluster: LocalCluster) -> None:
    c = local_cluster
    coord = c.start_coordinator(AZ, "c0", extra_env={"PHALANX_FAILPOINTS": "leader.corrupt_book=on"})
    await c.wait_leader(AZ)

    async def logged() -> bool:
        return LINE in coord.log()

    await until("the planted inconsistency logged", logged)
    said = c.unexpected()
    assert len(said) == 1 and "ERROR" in said[0].text and LINE in said[0].text, said
    c.expect_log(LINE)
    assert c.unexpected() == []
    assert coord.log().count(LINE) == 1
