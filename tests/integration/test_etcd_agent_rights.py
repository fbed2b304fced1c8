"""What the agent's etcd user can and cannot do, on the real etcd the tests
run (Debian's 3.4.23), call by call (docs/security.md "etcd operations per
identity").

Every call goes straight to etcd's gRPC API with the agent's client
certificate, as a compromised node would send it, and etcd is read back as
root afterwards: a refusal must leave everything as it was.

The calls etcd 3.4.23 does NOT refuse are the known gap of that version
(CVE-2026-33413: compaction and leases; CVE-2026-33343: nested
transactions). They are written as the refusals they should be and marked
``xfail(strict=True)``: they fail today, and the day the agent's etcd user is
refused them (a fixed etcd) they pass, which strict xfail turns red so the
mark and docs/security.md are updated.

This is the LEGACY agent user, which exists only where an operator opts in
(``phalanx etcd-auth --agent-user``) to keep agents on ``--etcd``. By
default agents hold no etcd credentials at all (they read through the
coordinators): tests/integration/test_agent_no_etcd_credentials.py shows
that everything such an agent is given opens nothing in etcd.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, AsyncIterator

import grpc
import pytest
from aetcd.rpc import rpc_pb2 as epb
from aetcd.rpc import rpc_pb2_grpc as egrpc

from phalanx import etcd_pki
from phalanx.tls import TlsFiles
from tests.pki import PrivateEtcd, provision

pytestmark = pytest.mark.integration

C1, C2 = "c1", "c2"
LEADER = b"/phalanx/c1/leader/az-a"
RESERVATION = b"/phalanx/c1/reservations/az-a/g1"
GANG = b"/phalanx/c1/gangs/g1"
OTHER_LEADER = b"/phalanx/c2/leader/az-a"
KNOWN_GAP = ("etcd 3.4.23 does not check this call against the caller's role (docs/security.md "
             "\"etcd operations per identity\": the known gap)")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory):
    # Its own etcd: these tests compact it and raise alarms on it.
    # The legacy agent user, opted in (phalanx etcd-auth --agent-user): what
    # an operator keeping agents on --etcd gets on this etcd.
    with PrivateEtcd(tmp_path_factory.mktemp("etcd-agent-rights"), C1, agent_user=True) as e:
        provision(e.endpoint, e.pki, C2, agent_user=True)
        yield e


class Client:
    """etcd's raw gRPC stubs as one etcd user."""

    def __init__(self, endpoint: str, tls: TlsFiles) -> None:
        creds, self.user = etcd_pki.channel_credentials(tls)
        self.channel = grpc.aio.secure_channel(endpoint, creds, options=list(etcd_pki.CHANNEL_OPTIONS))
        self.kv = egrpc.KVStub(self.channel)
        self.lease = egrpc.LeaseStub(self.channel)
        self.cluster = egrpc.ClusterStub(self.channel)
        self.maintenance = egrpc.MaintenanceStub(self.channel)
        self.auth = egrpc.AuthStub(self.channel)

    async def get(self, key: bytes, revision: int = 0) -> Any:
        return (await self.kv.Range(epb.RangeRequest(key=key, revision=revision), timeout=10)).kvs

    async def dump(self) -> list[tuple[bytes, bytes, int]]:
        """Every key in etcd, with its value and mod revision."""
        resp = await self.kv.Range(epb.RangeRequest(key=b"\0", range_end=b"\0"), timeout=10)
        return [(k.key, k.value, k.mod_revision) for k in resp.kvs]

    async def leases(self) -> set[int]:
        return {x.ID for x in (await self.lease.LeaseLeases(epb.LeaseLeasesRequest(), timeout=10)).leases}

    async def alarms(self) -> list[Any]:
        resp = await self.maintenance.Alarm(epb.AlarmRequest(action=epb.AlarmRequest.GET), timeout=10)
        return list(resp.alarms)


@pytest.fixture
async def world(etcd: PrivateEtcd) -> AsyncIterator[dict[str, Any]]:
    """root, the c1 coordinator and the c1 agent as clients; the token keys
    written by the coordinator, leader/ with its lease (as a campaign writes
    it); afterwards everything the test wrote is removed as root."""
    root = Client(etcd.endpoint, etcd.pki.root)
    coordinator = Client(etcd.endpoint, etcd.pki.role(C1, "coordinator"))
    agent = Client(etcd.endpoint, etcd.pki.role(C1, "agent"))
    assert agent.user == "phalanx-c1-agent"
    lease = (await coordinator.lease.LeaseGrant(epb.LeaseGrantRequest(TTL=300), timeout=10)).ID
    await coordinator.kv.Put(epb.PutRequest(key=LEADER, value=b'{"id": "c0"}', lease=lease), timeout=10)
    await coordinator.kv.Put(epb.PutRequest(key=RESERVATION, value=b'{"state": "COMMITTED"}'), timeout=10)
    await coordinator.kv.Put(epb.PutRequest(key=GANG, value=b'{"n": 1}'), timeout=10)
    await root.kv.Put(epb.PutRequest(key=OTHER_LEADER, value=b'{"id": "x0"}'), timeout=10)
    try:
        yield {"root": root, "coordinator": coordinator, "agent": agent, "lease": lease,
               "before": await root.dump(), "leases": await root.leases()}
    finally:
        for a in await root.alarms():
            await root.maintenance.Alarm(epb.AlarmRequest(action=epb.AlarmRequest.DEACTIVATE, memberID=a.memberID,
                                                          alarm=a.alarm), timeout=10)
        await root.kv.DeleteRange(epb.DeleteRangeRequest(key=b"/", range_end=b"\0"), timeout=10)
        for i in await root.leases():
            await root.lease.LeaseRevoke(epb.LeaseRevokeRequest(ID=i), timeout=10)
        for c in (root, coordinator, agent):
            await c.channel.close()


async def refused(call: Any) -> str:
    """Await one etcd call that must be refused as not permitted; etcd's
    words (PERMISSION_DENIED from the KV, lease and cluster APIs; the
    maintenance API says UNKNOWN "auth: permission denied")."""
    try:
        got = call if not hasattr(call, "__aiter__") else _first(call)
        answer = await got
    except grpc.aio.AioRpcError as exc:
        assert "permission denied" in (exc.details() or ""), f"{exc.code().name}: {exc.details()}"
        return exc.details() or ""
    raise AssertionError(f"etcd did not refuse it: answered {str(answer)[:200]!r}")


async def _first(stream: Any) -> Any:
    async for item in stream:
        return item
    return None


async def unchanged(w: dict[str, Any]) -> None:
    """etcd, read back as root: every key and every lease as before."""
    assert await w["root"].dump() == w["before"]
    assert await w["root"].leases() == w["leases"]


def _put(key: bytes, value: bytes = b"evil") -> Any:
    return epb.RequestOp(request_put=epb.PutRequest(key=key, value=value))


def _range(key: bytes, range_end: bytes = b"") -> Any:
    return epb.RequestOp(request_range=epb.RangeRequest(key=key, range_end=range_end))


# ---------------------------------------------------------------- refused today

async def test_the_agent_reads_exactly_its_token_keys(world: dict[str, Any]) -> None:
    agent = world["agent"]
    # What its token check reads, in one transaction:
    resp = await agent.kv.Txn(epb.TxnRequest(success=[_range(LEADER), _range(RESERVATION)]), timeout=10)
    assert [r.response_range.kvs[0].key for r in resp.responses] == [LEADER, RESERVATION]
    # and nothing else: another key of its cluster, another cluster's leader,
    # a compare on a key it may not read.
    await refused(agent.kv.Range(epb.RangeRequest(key=GANG), timeout=10))
    await refused(agent.kv.Range(epb.RangeRequest(key=OTHER_LEADER), timeout=10))
    await refused(agent.kv.Range(epb.RangeRequest(key=b"/phalanx/c1/", range_end=b"/phalanx/c10"), timeout=10))
    other = epb.Compare(key=GANG, target=epb.Compare.VERSION, result=epb.Compare.EQUAL, version=0)
    await refused(agent.kv.Txn(epb.TxnRequest(compare=[other]), timeout=10))
    await unchanged(world)


@pytest.mark.parametrize("what", ["put", "delete", "txn put", "txn delete", "put outside /phalanx"])
async def test_the_agent_writes_no_key(world: dict[str, Any], what: str) -> None:
    agent = world["agent"]
    call = {
        "put": lambda: agent.kv.Put(epb.PutRequest(key=LEADER, value=b"evil"), timeout=10),
        "delete": lambda: agent.kv.DeleteRange(epb.DeleteRangeRequest(key=RESERVATION), timeout=10),
        "txn put": lambda: agent.kv.Txn(epb.TxnRequest(success=[_range(LEADER), _put(RESERVATION)]), timeout=10),
        "txn delete": lambda: agent.kv.Txn(epb.TxnRequest(success=[epb.RequestOp(
            request_delete_range=epb.DeleteRangeRequest(key=LEADER))]), timeout=10),
        "put outside /phalanx": lambda: agent.kv.Put(epb.PutRequest(key=b"/other/x", value=b"v"), timeout=10),
    }[what]
    await refused(call())
    await unchanged(world)


async def test_the_agent_cannot_revoke_the_leaders_lease(world: dict[str, Any]) -> None:
    """The lease leader/<az> is attached to: revoking it would depose the
    leader. etcd checks write permission on the attached keys."""
    await refused(world["agent"].lease.LeaseRevoke(epb.LeaseRevokeRequest(ID=world["lease"]), timeout=10))
    await unchanged(world)


@pytest.mark.parametrize("what", ["defragment", "snapshot", "hash", "hashkv", "member add", "role list"])
async def test_the_agent_is_refused_administration(world: dict[str, Any], what: str) -> None:
    agent = world["agent"]
    members = await world["root"].cluster.MemberList(epb.MemberListRequest(), timeout=10)
    call = {
        "defragment": lambda: agent.maintenance.Defragment(epb.DefragmentRequest(), timeout=30),
        "snapshot": lambda: agent.maintenance.Snapshot(epb.SnapshotRequest(), timeout=30),
        "hash": lambda: agent.maintenance.Hash(epb.HashRequest(), timeout=10),
        "hashkv": lambda: agent.maintenance.HashKV(epb.HashKVRequest(), timeout=10),
        "member add": lambda: agent.cluster.MemberAdd(epb.MemberAddRequest(peerURLs=["https://127.0.0.9:1"]),
                                                      timeout=10),
        "role list": lambda: agent.auth.RoleList(epb.AuthRoleListRequest(), timeout=10),
    }[what]
    await refused(call())
    after = await world["root"].cluster.MemberList(epb.MemberListRequest(), timeout=10)
    assert [m.ID for m in after.members] == [m.ID for m in members.members]
    await unchanged(world)


async def test_the_agent_may_ask_etcds_version(world: dict[str, Any]) -> None:
    """The start-up version check (phalanx/etcd_version.py) needs Status,
    which every authenticated user may call."""
    status = await world["agent"].maintenance.Status(epb.StatusRequest(), timeout=10)
    assert status.version.count(".") == 2
    await unchanged(world)


# ------------------------------------------ NOT refused by etcd 3.4.23: the gap

@pytest.mark.xfail(strict=True, raises=AssertionError, reason=KNOWN_GAP)
async def test_the_agent_is_refused_compaction(world: dict[str, Any]) -> None:
    """CVE-2026-33413. Compaction forces every watcher of every cluster on
    this etcd into a full re-read."""
    root = world["root"]
    old = (await root.get(LEADER))[0].mod_revision
    await root.kv.Put(epb.PutRequest(key=LEADER + b"-bump", value=b"1"), timeout=10)
    head = (await root.get(LEADER + b"-bump"))[0].mod_revision
    await refused(world["agent"].kv.Compact(epb.CompactionRequest(revision=head), timeout=10))
    assert await root.get(LEADER, revision=old), "the old revision was compacted away"


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=KNOWN_GAP)
async def test_the_agent_is_refused_lease_grants(world: dict[str, Any]) -> None:
    """CVE-2026-33413: leases without limit (each one a record in etcd)."""
    await refused(world["agent"].lease.LeaseGrant(epb.LeaseGrantRequest(TTL=3600), timeout=10))
    await unchanged(world)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=KNOWN_GAP)
async def test_the_agent_is_refused_keeping_the_leaders_lease_alive(world: dict[str, Any]) -> None:
    """CVE-2026-33413: a node could keep a dead leader's lease alive (its ID
    is listed to anyone, below), so its AZ never elects again."""

    async def one() -> Any:
        yield epb.LeaseKeepAliveRequest(ID=world["lease"])

    await refused(world["agent"].lease.LeaseKeepAlive(one(), timeout=10))
    await unchanged(world)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=KNOWN_GAP)
async def test_the_agent_is_refused_listing_every_lease(world: dict[str, Any]) -> None:
    """CVE-2026-33413: the IDs of every cluster's leases."""
    await refused(world["agent"].lease.LeaseLeases(epb.LeaseLeasesRequest(), timeout=10))


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=KNOWN_GAP)
async def test_the_agent_is_refused_revoking_an_unattached_lease(world: dict[str, Any]) -> None:
    """CVE-2026-33413: a lease with no key yet (a campaign between its grant
    and its put) is anyone's to revoke."""
    fresh = (await world["coordinator"].lease.LeaseGrant(epb.LeaseGrantRequest(TTL=300), timeout=10)).ID
    world["leases"] = await world["root"].leases()
    await refused(world["agent"].lease.LeaseRevoke(epb.LeaseRevokeRequest(ID=fresh), timeout=10))
    await unchanged(world)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=KNOWN_GAP)
async def test_the_agent_is_refused_writes_in_a_nested_transaction(world: dict[str, Any]) -> None:
    """CVE-2026-33343: a put inside a nested transaction is not checked, so
    the agent's user could rewrite leader/<az> or any key of any cluster."""
    nested = epb.RequestOp(request_txn=epb.TxnRequest(success=[_put(LEADER), _put(OTHER_LEADER)]))
    await refused(world["agent"].kv.Txn(epb.TxnRequest(success=[nested]), timeout=10))
    await unchanged(world)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=KNOWN_GAP)
async def test_the_coordinator_is_refused_other_clusters_keys_in_a_nested_transaction(world: dict[str, Any]) -> None:
    """CVE-2026-33343 for the coordinator user: its role ends at its prefix,
    a nested transaction does not."""
    nested = epb.RequestOp(request_txn=epb.TxnRequest(success=[_put(OTHER_LEADER)]))
    await refused(world["coordinator"].kv.Txn(epb.TxnRequest(success=[nested]), timeout=10))
    await unchanged(world)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=KNOWN_GAP)
async def test_the_agent_is_refused_reads_in_a_nested_transaction(world: dict[str, Any]) -> None:
    """CVE-2026-33343: every gang's spec, of every cluster."""
    nested = epb.RequestOp(request_txn=epb.TxnRequest(success=[_range(b"/phalanx/", b"/phalanx0")]))
    await refused(world["agent"].kv.Txn(epb.TxnRequest(success=[nested]), timeout=10))


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=KNOWN_GAP)
async def test_the_agent_is_refused_disarming_the_space_alarm(world: dict[str, Any]) -> None:
    """etcd's NOSPACE alarm, raised by etcd when its quota is reached (here
    by root), is what keeps writes refused until an operator has made room
    (docs/etcd-keys.md "When etcd is full"). 3.4.23 lets any user disarm it."""
    root = world["root"]
    status = await root.maintenance.Status(epb.StatusRequest(), timeout=10)
    await root.maintenance.Alarm(epb.AlarmRequest(action=epb.AlarmRequest.ACTIVATE, memberID=status.header.member_id,
                                                  alarm=epb.NOSPACE), timeout=10)
    assert [a.alarm for a in await root.alarms()] == [epb.NOSPACE]
    await refused(world["agent"].maintenance.Alarm(epb.AlarmRequest(
        action=epb.AlarmRequest.DEACTIVATE, memberID=status.header.member_id, alarm=epb.NOSPACE), timeout=10))
    assert [a.alarm for a in await root.alarms()] == [epb.NOSPACE]


def test_the_gap_is_the_one_the_docs_state() -> None:
    """docs/security.md names each call this file shows is not refused."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    for call in ("Compact", "LeaseGrant", "LeaseKeepAlive", "LeaseLeases", "LeaseRevoke", "nested", "Alarm"):
        assert call in text, call
