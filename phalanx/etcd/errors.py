"""What etcd's error answers mean to the store, by table (docs/style.md §6):
``classify`` (pure), ``translate`` into the errors of phalanx/errors.py,
and ``Compacted`` for a watch whose start revision is gone."""

from __future__ import annotations

from typing import Callable

import grpc

from phalanx.errors import StoreDenied, StoreSpaceExhausted, StoreUnavailable
from phalanx.tls import TlsFiles

# Codes that say "this member did not answer" (including etcd's "no leader",
# which the hasleader metadata turns into UNAVAILABLE): the store moves to the
# next member for later calls. Other codes are answers and move nothing.
FAILOVER_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
TRANSIENT_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}
# etcd's answers when auth is on. "permission denied": the user's role does
# not cover the key. "user name is empty"/"not found": the certificate's CN
# is no etcd user (roles not provisioned). Both are refusals, never retried.
DENIED_DETAILS = ("permission denied", "user name is empty", "user name not found")
# "auth: revision in header is old" (etcd's ErrAuthOldRevision, sent as
# "etcdserver: revision of auth store is old"): etcd stamped the request
# with the auth revision when it arrived and, before applying it, the users
# or roles changed (``phalanx etcd-auth`` provisioning or removing another
# cluster on the same etcd). It does hit coordinators: with another
# cluster's roles provisioned in a loop, about a third of a coordinator's
# txns got it (docs/security.md "etcd: TLS and roles"). etcd
# refused the request before applying anything, so sending it again is
# safe even for a write (the "never retry a write" rule is about writes
# whose outcome is unknown; clientv3 resends these too): the store resends
# it at once, at most AUTH_OLD_RESENDS times, and then treats it as a
# transient failure of that one call (StoreUnavailable, which every caller
# already treats as "try again later"). The member is fine, so it does not
# move the store to another one.
AUTH_OLD_REVISION = ("revision of auth store is old", "revision in header is old")
AUTH_OLD_RESENDS = 3
# etcd's ErrGRPCNoSpace ("etcdserver: mvcc: database space exceeded",
# RESOURCE_EXHAUSTED): the NOSPACE alarm is active and every write is refused
# until an operator recovers (docs/etcd-keys.md "When etcd is full").
NO_SPACE = "database space exceeded"
NO_SPACE_RECOVERY = ("etcd's space alarm (NOSPACE) is active: its database reached --quota-backend-bytes and etcd "
                     "refuses every write until an operator compacts, defragments and disarms it "
                     "(docs/etcd-keys.md \"When etcd is full\")")


def classify(code: grpc.StatusCode, details: str) -> str:
    """What an etcd error answer means to the store (pure): "denied"
    (StoreDenied), "auth-old" (resend, see above), "no-space" (etcd's space
    alarm: StoreSpaceExhausted), "transient" or "refused" (both
    StoreUnavailable; only "transient" may move to another member)."""
    if code == grpc.StatusCode.PERMISSION_DENIED or any(d in details for d in DENIED_DETAILS):
        return "denied"
    if NO_SPACE in details:
        return "no-space"
    if any(d in details for d in AUTH_OLD_REVISION):
        return "auth-old"
    return "transient" if code in TRANSIENT_CODES else "refused"


def is_auth_old(exc: grpc.aio.AioRpcError) -> bool:
    return classify(exc.code(), exc.details() or "") == "auth-old"


def translate(exc: grpc.aio.AioRpcError, what: str, key: str | Callable[[], str] = "", *,
              tls: TlsFiles | None, user: str) -> Exception:
    """The error a failed call raises: ``what`` names the call (and the
    member), ``key`` the key it touched (a callable: worked out only for a
    refusal), ``tls`` and ``user`` the store's client files and etcd user."""
    details = exc.details() or ""
    kind = classify(exc.code(), details)
    if kind == "denied":
        return denied(what, key() if callable(key) else key, details, user)
    if kind == "auth-old":
        return StoreUnavailable(f"etcd refused {what} for now: the etcd users or roles changed while it was "
                                f"checked, {AUTH_OLD_RESENDS + 1} times in a row ({details}); nothing was "
                                f"applied, sending it again may pass")
    if kind == "no-space":
        return StoreSpaceExhausted(f"etcd refused {what}: {NO_SPACE_RECOVERY} ({exc.code().name}: {details})")
    if kind == "transient":
        hint = ""
        if tls is not None and ("ssl" in details.lower() or "handshake" in details.lower()):
            hint = (f" (TLS handshake failed: is {tls.ca} the CA of etcd's server certificate, and "
                    f"{tls.cert} issued by etcd's CA?)")
        elif tls is None and "socket closed" in details.lower():
            hint = " (plaintext: an etcd that serves TLS only closes such connections; give its client files)"
        return StoreUnavailable(f"etcd unavailable during {what}: {exc.code().name}: {details}{hint}")
    return StoreUnavailable(f"etcd refused {what}: {exc.code().name}: {details}")


def denied(what: str, key: str, details: str, user: str) -> StoreDenied:
    """etcd refused ``what`` on ``key`` to the etcd ``user`` ("" in plaintext)."""
    shown = repr(user) if user else "(none: plaintext)"
    on = f" touching {key}" if key and key not in what else ""
    return StoreDenied(f"etcd denied {what}{on} to etcd user {shown}: {details}; that user's role does not "
                       f"allow it (roles: phalanx etcd-auth)", key=key, user=user)


class Compacted(Exception):
    """The watch start revision was compacted; re-list, then watch again."""

    def __init__(self, compact_revision: int):
        super().__init__(f"revision compacted (oldest available {compact_revision})")
        self.compact_revision = compact_revision
