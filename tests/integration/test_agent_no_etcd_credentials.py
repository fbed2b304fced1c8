"""Issue 22's must-hold "the agent's etcd credentials are refused compaction,
lease grants and every write", made true by giving agents none
(docs/security.md "etcd operations per identity", docs/design.md §9.3).

A cluster set up as by default: a real etcd with TLS, ``--client-cert-auth``
under its own CA and auth on, the cluster provisioned as ``phalanx
etcd-auth`` does (no agent user); a real coordinator; agents started as the
harness starts them (through the coordinators of their AZ). Everything the
agent is given (its ``--tls-dir`` files, its arguments) is then turned
against etcd, call by call: the agent's own certificate and key, and no
client certificate at all. Every call (Compact, LeaseGrant, Put, Txn, Range)
is refused, and etcd read back as root shows nothing written, no lease
granted and nothing compacted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from aetcd.rpc import rpc_pb2 as epb
from aetcd.rpc import rpc_pb2_grpc as egrpc

from phalanx import etcd_auth, etcd_pki
from phalanx.tls import TlsFiles
from tests.integration.harness import LocalCluster, dgx_node
from tests.pki import PrivateEtcd, run_sync

pytestmark = pytest.mark.integration
CLUSTER = "noagent"
AZ = "az-a"
PROBE = f"/phalanx/{CLUSTER}/probe".encode()


def calls(kv: egrpc.KVStub, lease: egrpc.LeaseStub) -> dict[str, Any]:
    """The calls a node holding the agent's files would try first."""
    return {
        "Compact": lambda: kv.Compact(epb.CompactionRequest(revision=2), timeout=10),
        "LeaseGrant": lambda: lease.LeaseGrant(epb.LeaseGrantRequest(TTL=600), timeout=10),
        "Put": lambda: kv.Put(epb.PutRequest(key=PROBE, value=b"evil"), timeout=10),
        "Txn": lambda: kv.Txn(epb.TxnRequest(success=[epb.RequestOp(
            request_put=epb.PutRequest(key=PROBE, value=b"evil"))]), timeout=10),
        "Range": lambda: kv.Range(epb.RangeRequest(key=f"/phalanx/{CLUSTER}/".encode(),
                                                   range_end=f"/phalanx/{CLUSTER}0".encode()), timeout=10),
    }


async def refused_all(endpoint: str, creds: grpc.ChannelCredentials) -> dict[str, str]:
    """Each call with ``creds``: how etcd refused it (an answer fails)."""
    out = {}
    async with grpc.aio.secure_channel(endpoint, creds, options=list(etcd_pki.CHANNEL_OPTIONS)) as ch:
        for name, call in calls(egrpc.KVStub(ch), egrpc.LeaseStub(ch)).items():
            try:
                answer = await call()
            except grpc.aio.AioRpcError as exc:
                out[name] = f"{exc.code().name}: {exc.details()}"
                continue
            raise AssertionError(f"etcd answered {name} to the agent's credentials: {str(answer)[:200]!r}")
    return out


async def root_view(endpoint: str, root: TlsFiles) -> tuple[set[bytes], set[int]]:
    """As root: every key and every lease; raises if etcd was compacted
    (revision 1 is readable until then)."""
    creds, _ = etcd_pki.channel_credentials(root)
    async with grpc.aio.secure_channel(endpoint, creds, options=list(etcd_pki.CHANNEL_OPTIONS)) as ch:
        kv, lease = egrpc.KVStub(ch), egrpc.LeaseStub(ch)
        resp = await kv.Range(epb.RangeRequest(key=b"\0", range_end=b"\0"), timeout=10)
        leases = {x.ID for x in (await lease.LeaseLeases(epb.LeaseLeasesRequest(), timeout=10)).leases}
        await kv.Range(epb.RangeRequest(key=b"\0", range_end=b"\0", revision=1, keys_only=True), timeout=10)
        return {k.key for k in resp.kvs}, leases


@pytest.fixture
def etcd(tmp_path: Path):
    # Provisioned as `phalanx etcd-auth` does by default: no agent user.
    with PrivateEtcd(tmp_path, CLUSTER, agent_user=False) as e:
        yield e


async def test_everything_the_agent_is_given_opens_nothing_in_etcd(etcd: PrivateEtcd, tmp_path: Path) -> None:
    users = run_sync(etcd_auth.describe(etcd.endpoint, etcd.pki.root, CLUSTER))["users"]
    assert sorted(users) == [etcd_pki.user_for(CLUSTER, "coordinator")], users
    c = await LocalCluster(etcd.endpoint, CLUSTER, tmp_path, etcd_pki=etcd.pki).start()
    try:
        c.start_coordinator(AZ, "c0")
        await c.wait_leader(AZ)
        given = c.agents_tls(["n1"], AZ)
        # What the agent is given: its certificate dir and its coordinators; no etcd.
        assert given["etcd_tls"] is None and given["coordinators"] == [c.coordinators["c0"].address], given
        c.start_agents(AZ, [dgx_node("n1", AZ)])
        await c.wait_nodes_ready(AZ, 1)  # it registered: its reads went through the coordinator

        mine = TlsFiles.issued(given["tls_dir"], "agent", "n1")
        etcd_ca = etcd.pki.root.ca.read_bytes()
        before = await root_view(etcd.endpoint, etcd.pki.root)
        refusals = {
            # The agent's own certificate and key, even trusting etcd's CA
            # (which the agent is not given) to let the handshake go ahead.
            "agent certificate": await refused_all(etcd.endpoint, grpc.ssl_channel_credentials(
                root_certificates=etcd_ca, private_key=mine.key.read_bytes(),
                certificate_chain=mine.cert.read_bytes())),
            # No client certificate at all.
            "no client certificate": await refused_all(
                etcd.endpoint, grpc.ssl_channel_credentials(root_certificates=etcd_ca)),
        }
        for how, got in refusals.items():
            assert sorted(got) == ["Compact", "LeaseGrant", "Put", "Range", "Txn"], (how, got)
            # Refused by the handshake (--client-cert-auth under etcd's own
            # CA), not by etcd's roles: no call reached etcd's API.
            assert all(v.startswith("UNAVAILABLE") for v in got.values()), (how, got)
        # Every file in the agent's --tls-dir, as a client certificate: none is one etcd trusts.
        for crt in sorted(Path(given["tls_dir"]).glob("agent-*.crt")):
            key = crt.with_suffix(".key")
            got = await refused_all(etcd.endpoint, grpc.ssl_channel_credentials(
                root_certificates=etcd_ca, private_key=key.read_bytes(), certificate_chain=crt.read_bytes()))
            assert len(got) == 5, (crt, got)
        # Read back as root: nothing written, no lease granted, not compacted.
        (keys_before, leases_before), (keys_after, leases_after) = before, await root_view(etcd.endpoint,
                                                                                           etcd.pki.root)
        assert PROBE not in keys_after, "a refused Put or Txn wrote"
        assert leases_after <= leases_before, f"a lease appeared: {leases_after - leases_before}"
    finally:
        await c.close()
