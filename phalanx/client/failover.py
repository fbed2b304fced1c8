"""The SDK's failover schedule and error translation (``AsyncClient._failover``
runs the schedule with these: ``until``, ``round_backoff``, ``not_connected``;
``exhausted`` is the error of a call no coordinator answered).

Failover and deadlines
----------------------
``addresses`` lists coordinators (any replica of any AZ can answer reads;
standbys forward writes to their leader). Every call has one overall deadline,
``timeout`` seconds. An attempt that fails with ``UNAVAILABLE`` (coordinator
down, or cut off from etcd) or runs out of its share of the deadline is
repeated on the next address, with a short backoff after a full round, until
the call's deadline (``tenacity``, stopped by that deadline: ``until``,
``round_backoff``). Each attempt gets a share of the time left (split over the
addresses not yet tried), so one hung coordinator cannot eat the whole
deadline while another could answer. A ``cancel`` that loses a race with
another write of the gang (ABORTED) is retried too, within the same deadline
(``conflict_backoff``).

Retrying is safe because every GangService RPC is idempotent:
reads trivially, ``cancel`` by nature, and ``submit`` because the client sends
an idempotency key — generated once per ``submit`` call when the caller gives
none — and reuses it on every retry of that call, so a retried submit whose
first attempt did reach etcd returns the same gang (``created=False``) instead
of creating a second one.

Why not the channel's retry service config: the addresses are
separate servers on separate channels, an up-but-partitioned coordinator
answers UNAVAILABLE on every retry of its own channel, and ``watch`` needs
resumption on another server, which a retry policy cannot do for a stream that
has already delivered messages.

Errors
------
gRPC status codes become the typed errors of :mod:`phalanx.errors` via
``from_status`` (``translate``); an error a coordinator answered also says which
cluster and coordinator answered (``.cluster``, ``.coordinator``, ``.address``).
``unreachable_reason`` and ``tls_hint`` say why no connection was made.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import grpc
import grpc.aio
from tenacity import RetryCallState

from phalanx.errors import CLUSTER_METADATA, COORDINATOR_METADATA, PhalanxError, from_status
from phalanx.tls import looks_like_handshake

# Below this an attempt is pointless; the last attempt always gets what is left.
MIN_ATTEMPT_S = 1.0
BACKOFF_START_S = 0.1
# A write that lost a race is retried sooner: the other write has landed.
_CONFLICT_BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 1.0
# Stream errors after which a watch resumes on another address.
RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})


# gRPC's words for a failed handshake (the Python API gives no better signal).
_TLS_WORDS = ("ssl", "tls", "handshake", "certificate", "hostname verification")


# gRPC's words when no connection was made at all, and what they mean to a
# user: nothing accepts connections at the address, or it cannot be reached.
_UNREACHABLE = (
    ("connection refused", "connection refused"),
    ("no route to host", "no route to host"),
    ("network is unreachable", "network unreachable"),
    ("errors resolving", "its host name does not resolve"),
    ("dns resolution failed", "its host name does not resolve"),
    ("name or service not known", "its host name does not resolve"),
)


def unreachable_reason(details: str) -> str | None:
    """Why gRPC could not connect at all (``connection refused``, ``its host
    name does not resolve``, ...), from its error details; None when it did
    connect (or said nothing this recognises)."""
    low = (details or "").lower()
    return next((why for words, why in _UNREACHABLE if words in low), None)


def tls_hint(details: str, tls: bool) -> str:
    """What to add to "no coordinator could answer" when the reason may be TLS
    (never for a connection that was not even made)."""
    low = details.lower()
    if unreachable_reason(details):
        return ""
    if tls and any(w in low for w in _TLS_WORDS):
        return (" (TLS handshake failed: the server's certificate does not verify against this client's ca.crt"
                " or is not a coordinator certificate of its cluster, or the coordinator serves plaintext)")
    if tls:
        return (" (connecting with TLS: a coordinator that closes the connection at once refused this client's"
                " certificate: another CA, expired, or not yet valid)")
    if "socket closed" in low or "connection reset" in low or "handshake" in low:
        return (" (connecting in plaintext, chosen by --insecure/PHALANX_INSECURE: if the coordinator serves TLS,"
                " give credentials: --tls-dir, $PHALANX_TLS_DIR or $PHALANX_CONFIG)")
    return ""


class NoConnection(Exception):
    """A whole round of addresses that could not even be connected to, with
    ``fail_fast``: the call ends now, not at its deadline."""


class TryNext(Exception):
    """An attempt that another address, or a later round, may still answer:
    UNAVAILABLE, its share of the deadline ran out, or a stream that closed
    before its first event. ``error`` is the gRPC error, if there was one."""

    def __init__(self, address: str, error: grpc.aio.AioRpcError | None = None):
        super().__init__(address)
        self.address = address
        self.error = error


def until(deadline: float) -> Callable[[RetryCallState], bool]:
    """tenacity stop: the call's own deadline (monotonic clock) has passed."""
    return lambda _state: time.monotonic() >= deadline


def round_backoff(n: int, deadline: float) -> Callable[[RetryCallState], float]:
    """tenacity wait for failover over ``n`` addresses: none between the
    addresses of one round; after a whole round failed, BACKOFF_START_S
    doubling up to BACKOFF_MAX_S; never past the deadline."""

    def wait(state: RetryCallState) -> float:
        if state.attempt_number % n:
            return 0.0
        rounds = state.attempt_number // n
        pause = min(BACKOFF_START_S * 2 ** min(rounds - 1, 30), BACKOFF_MAX_S)
        return max(0.0, min(pause, deadline - time.monotonic()))

    return wait


def conflict_backoff(deadline: float) -> Callable[[RetryCallState], float]:
    """tenacity wait between retries of a write that lost a race
    (ABORTED): short, doubling, capped, never past the deadline."""

    def wait(state: RetryCallState) -> float:
        pause = min(_CONFLICT_BACKOFF_START_S * 2 ** min(state.attempt_number - 1, 30), BACKOFF_MAX_S)
        return max(0.0, min(pause, deadline - time.monotonic()))

    return wait


def answered_by(exc: grpc.aio.AioRpcError) -> dict[str, str]:
    """The cluster/coordinator a coordinator's trailing metadata names."""
    out: dict[str, str] = {}
    try:
        for key, value in exc.trailing_metadata() or ():
            if key in (CLUSTER_METADATA, COORDINATOR_METADATA) and isinstance(value, str):
                out[key] = value
    except (TypeError, ValueError):  # no or malformed metadata: nobody named
        pass
    return out


def translate(exc: grpc.aio.AioRpcError, address: str, message: str | None = None) -> PhalanxError:
    who = answered_by(exc)
    return from_status(
        exc.code(),
        exc.details() or "" if message is None else message,
        cluster=who.get(CLUSTER_METADATA, ""),
        coordinator=who.get(COORDINATOR_METADATA, ""),
        address=address,
    )


def not_connected(failed: TryNext, *, tls: bool) -> bool:
    """The attempt made no connection at all: nothing listening, no
    route, no such host, or (over TLS) a failed handshake. Not an
    UNAVAILABLE a coordinator answered (etcd down), not a timeout."""
    err = failed.error
    if err is None or err.code() != grpc.StatusCode.UNAVAILABLE or answered_by(err):
        return False
    details = err.details() or ""
    return bool(unreachable_reason(details)) or (tls and looks_like_handshake(details))


def exhausted(method: str, budget: float, failed: Sequence[TryNext], addresses: Sequence[str], *, tls: bool,
              token: bool, why: str = "") -> PhalanxError:
    """The error of a call no address answered in time (``failed``: its
    attempts; ``tls``/``token``: how the client dials; ``why``: the check the
    server's certificate failed, if one did). A coordinator that did answer
    UNAVAILABLE said why (e.g. etcd did not answer it): its words are kept
    even when later attempts merely timed out, so an etcd outage reads as one."""
    where = ", ".join(dict.fromkeys(f.address for f in failed)) or ", ".join(addresses)
    errors = [f for f in failed if f.error is not None]
    answered = [f for f in errors if f.error.code() == grpc.StatusCode.UNAVAILABLE and answered_by(f.error)]
    if answered:
        told = answered[-1]
        err = translate(told.error, told.address)
        return translate(
            told.error, told.address,
            f"{method}: no coordinator could answer within {budget:g}s (tried {where}); "
            f"{err.origin or told.address} said: {told.error.details() or 'UNAVAILABLE'}",
        )
    last = errors[-1] if errors else None
    if errors and all(unreachable_reason(f.error.details() or "") for f in errors):
        whys = ", ".join(dict.fromkeys(unreachable_reason(f.error.details() or "") or "" for f in errors))
        return translate(last.error, last.address,
                         f"{method}: nothing is listening at {where} ({whys}; is the cluster up? "
                         f"`phalanx config` shows what this command used)")
    if last is None or last.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return from_status(grpc.StatusCode.DEADLINE_EXCEEDED, f"{method}: no answer within {budget:g}s from {where}")
    code = last.error.code()
    details = last.error.details() or code.name
    hint = tls_hint(details, tls) if code == grpc.StatusCode.UNAVAILABLE else ""
    if token and code == grpc.StatusCode.UNAVAILABLE:
        hint = (" (with a bearer token: dial a coordinator's --token-listen port; its certificate port "
                "refuses a client without a certificate at the handshake)")
    if why:  # the check the server's certificate failed: that is the whole story
        return translate(last.error, last.address, f"{method}: TLS handshake failed (tried {where}): {why}")
    return translate(last.error, last.address, f"{method}: no coordinator could answer (tried {where}): {details}{hint}")
