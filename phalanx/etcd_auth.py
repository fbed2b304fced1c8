"""Least-privilege etcd users and roles for one cluster
(docs/security.md "etcd: TLS and roles").

``provision`` makes etcd's users and roles exactly what a cluster needs, and
turns auth on (run as the etcd ``root`` user, over TLS with root's client
certificate):

* ``root`` (user and role, no password): etcd needs it before auth can be
  enabled; only the operator's ``root`` client certificate logs in as it.
* role and user ``phalanx-<cluster>-coordinator``: read and write
  ``/phalanx/<cluster>/`` (the whole prefix, nothing outside it). Leases
  and watches need no more than that.
* role and user ``phalanx-<cluster>-agent``: ONLY with ``agent_user=True``
  (``phalanx etcd-auth --agent-user``), for agents on the legacy
  ``--etcd``/``--etcd-tls-dir`` path: READ of ``/phalanx/<cluster>/leader/``
  and ``/phalanx/<cluster>/reservations/``, the keys an agent's token check
  reads. By default agents hold no etcd credentials at all: they read through
  the coordinators (``AgentService.ReadToken``, docs/design.md §9.3), because
  etcd 3.4.23 lets a READ role compact, grant leases and write through
  nested transactions (docs/security.md "etcd operations per identity").
  Without ``agent_user`` the agent user and role are removed if present.

Users have no password: etcd runs with ``--client-cert-auth`` and takes the
client certificate's CN as the user, so a process is whoever its etcd
certificate names. ``provision`` is idempotent and converges: run again, it
adds what is missing and removes permissions and role grants that are not in
the list above (a hand-widened role is narrowed back). ``unprovision``
removes one cluster's users and roles (root and auth stay: other
clusters may share the etcd).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import grpc
from aetcd.rpc import auth_pb2 as apb
from aetcd.rpc import rpc_pb2 as epb
from aetcd.rpc import rpc_pb2_grpc as egrpc

from phalanx import etcd_pki
from phalanx.tls import TlsFiles

log = logging.getLogger(__name__)

READ = apb.Permission.READ
READWRITE = apb.Permission.READWRITE
_PERM_NAMES = {apb.Permission.READ: "read", apb.Permission.WRITE: "write", apb.Permission.READWRITE: "readwrite"}
TIMEOUT_S = 10.0  # one admin call; provisioning is a handful of them


class EtcdAuthError(RuntimeError):
    """A provisioning step etcd refused or did not answer; the message names
    the step, the endpoint and etcd's reason."""


@dataclass(frozen=True)
class Perm:
    kind: int  # READ / READWRITE
    key: bytes
    range_end: bytes

    def describe(self) -> str:
        kind = _PERM_NAMES.get(self.kind, str(self.kind))
        key = self.key.decode(errors="replace")
        if self.range_end == _prefix_end(key):
            return f"{kind} prefix {key}"
        if not self.range_end:
            return f"{kind} key {key}"
        return f"{kind} [{key}, {self.range_end.decode(errors='replace')})"


def _prefix_end(prefix: str) -> bytes:
    # The store's own rule, so a role covers exactly the ranges the store
    # reads (imported when used, as phalanx/up/ imports the store).
    from phalanx.store import prefix_end

    return prefix_end(prefix)


def roles_for(cluster: str, *, agent_user: bool = False) -> dict[str, tuple[Perm, ...]]:
    """The roles of one cluster and their exact permissions (pure); the
    agent's only with ``agent_user`` (the legacy opt-in)."""
    root = f"/phalanx/{cluster}/"
    roles = {etcd_pki.user_for(cluster, "coordinator"): (Perm(READWRITE, root.encode(), _prefix_end(root)),)}
    if agent_user:
        roles[etcd_pki.user_for(cluster, "agent")] = tuple(
            Perm(READ, p.encode(), _prefix_end(p)) for p in (f"{root}leader/", f"{root}reservations/"))
    return roles


def all_users(cluster: str) -> tuple[str, ...]:
    """Every user (and role) name ``provision`` may have made for ``cluster``."""
    return tuple(roles_for(cluster, agent_user=True))


class _Admin:
    """The auth API of one member, as root; each call names its step."""

    def __init__(self, endpoints: Sequence[str], root: TlsFiles) -> None:
        from phalanx.store import parse_endpoints

        self.endpoint = parse_endpoints(endpoints)[0].target
        creds, self.user = etcd_pki.channel_credentials(root)
        self.channel = grpc.aio.secure_channel(self.endpoint, creds, options=list(etcd_pki.CHANNEL_OPTIONS))
        self.auth = egrpc.AuthStub(self.channel)

    async def call(self, name: str, req: Any, step: str, *, ok_if: str = "") -> Any:
        try:
            return await getattr(self.auth, name)(req, timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or ""
            if ok_if and ok_if in details:
                return None
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise EtcdAuthError(f"etcd at {self.endpoint} did not answer {step}: {exc.code().name}: {details}") from None
            raise EtcdAuthError(f"etcd at {self.endpoint} refused {step} (as etcd user {self.user!r}): "
                                f"{exc.code().name}: {details}") from None

    async def close(self) -> None:
        await self.channel.close()


async def _ensure_role(admin: _Admin, role: str, perms: Sequence[Perm]) -> None:
    await admin.call("RoleAdd", epb.AuthRoleAddRequest(name=role), f"adding role {role}", ok_if="already exists")
    got = await admin.call("RoleGet", epb.AuthRoleGetRequest(role=role), f"reading role {role}")
    have = {Perm(p.permType, bytes(p.key), bytes(p.range_end)) for p in got.perm}
    for p in have - set(perms):
        await admin.call("RoleRevokePermission",
                         epb.AuthRoleRevokePermissionRequest(role=role, key=p.key, range_end=p.range_end),
                         f"revoking {p.describe()} from role {role}")
    for p in perms:
        if p not in have:
            await admin.call("RoleGrantPermission",
                             epb.AuthRoleGrantPermissionRequest(
                                 name=role, perm=apb.Permission(permType=p.kind, key=p.key, range_end=p.range_end)),
                             f"granting {p.describe()} to role {role}")


async def _ensure_user(admin: _Admin, user: str, role: str) -> None:
    await admin.call("UserAdd", epb.AuthUserAddRequest(name=user, options=apb.UserAddOptions(no_password=True)),
                     f"adding user {user}", ok_if="already exists")
    got = await admin.call("UserGet", epb.AuthUserGetRequest(name=user), f"reading user {user}")
    for other in set(got.roles) - {role}:
        await admin.call("UserRevokeRole", epb.AuthUserRevokeRoleRequest(name=user, role=other),
                         f"revoking role {other} from user {user}")
    if role not in got.roles:
        await admin.call("UserGrantRole", epb.AuthUserGrantRoleRequest(user=user, role=role),
                         f"granting role {role} to user {user}")


async def _remove(admin: _Admin, name: str) -> None:
    """The user and role ``name`` (absent ones are fine)."""
    await admin.call("UserDelete", epb.AuthUserDeleteRequest(name=name), f"removing user {name}", ok_if="not found")
    await admin.call("RoleDelete", epb.AuthRoleDeleteRequest(role=name), f"removing role {name}", ok_if="not found")


async def provision(endpoints: str | Sequence[str], root: TlsFiles, cluster: str, *, agent_user: bool = False) -> None:
    """Create (or converge) the cluster's etcd users and roles and enable
    auth; see the module docstring. ``root``: the root user's client files
    (etcd_pki.issue_client(dir, "root")). ``agent_user``: also the legacy
    agent user; without it an agent user there is removed. Raises
    EtcdAuthError naming the step, TlsError naming a bad file, CertError for
    a bad cluster name."""
    if isinstance(endpoints, str):
        endpoints = endpoints.split(",")
    roles = roles_for(cluster, agent_user=agent_user)  # validates the cluster name before any call
    admin = _Admin(endpoints, root)
    try:
        if admin.user != etcd_pki.ROOT_USER:
            raise EtcdAuthError(f"{root.cert}: logs in as etcd user {admin.user!r}; provisioning needs "
                                f"{etcd_pki.ROOT_USER!r} (phalanx certs etcd-user --user root)")
        # etcd refuses AuthEnable without a root user holding the root role;
        # the root role needs no permissions (it is all-powerful).
        await admin.call("RoleAdd", epb.AuthRoleAddRequest(name=etcd_pki.ROOT_USER), "adding role root",
                         ok_if="already exists")
        await _ensure_user(admin, etcd_pki.ROOT_USER, etcd_pki.ROOT_USER)
        for name, perms in roles.items():
            await _ensure_role(admin, name, perms)
            await _ensure_user(admin, name, name)  # each user has the role of its own name
        for name in set(all_users(cluster)) - set(roles):
            await _remove(admin, name)  # e.g. the agent user of an earlier, opted-in provisioning
        # Enabling it again is a no-op in etcd (3.4 has no AuthStatus to ask first).
        await admin.call("AuthEnable", epb.AuthEnableRequest(), "enabling auth")
        log.info("etcd at %s: users and roles of cluster %s provisioned", admin.endpoint, cluster)
    finally:
        await admin.close()


async def unprovision(endpoints: str | Sequence[str], root: TlsFiles, cluster: str) -> None:
    """Remove the cluster's users and roles (absent ones are fine)."""
    if isinstance(endpoints, str):
        endpoints = endpoints.split(",")
    names = all_users(cluster)
    admin = _Admin(endpoints, root)
    try:
        for name in names:
            await _remove(admin, name)
    finally:
        await admin.close()


async def describe(endpoints: str | Sequence[str], root: TlsFiles, cluster: str) -> dict[str, Any]:
    """What etcd holds for the cluster now: ``{"users": {user: [roles]},
    "roles": {role: [Perm]}}`` (absent ones left out). For tests and for
    ``phalanx etcd-auth`` to show what it did."""
    if isinstance(endpoints, str):
        endpoints = endpoints.split(",")
    admin = _Admin(endpoints, root)
    try:
        out: dict[str, Any] = {"users": {}, "roles": {}}
        for name in all_users(cluster):
            u = await admin.call("UserGet", epb.AuthUserGetRequest(name=name), f"reading user {name}", ok_if="not found")
            if u is not None:
                out["users"][name] = sorted(u.roles)
            r = await admin.call("RoleGet", epb.AuthRoleGetRequest(role=name), f"reading role {name}", ok_if="not found")
            if r is not None:
                out["roles"][name] = sorted((Perm(p.permType, bytes(p.key), bytes(p.range_end)) for p in r.perm),
                                            key=lambda p: p.key)
        return out
    finally:
        await admin.close()
