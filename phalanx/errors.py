"""The small error hierarchy shared by SDK, coordinator and agent.

Translated at the boundaries by one table: the coordinator's servicers
map these to gRPC status codes, the SDK maps status codes back.
"""

from __future__ import annotations

import grpc


# Trailing metadata every GangService answer carries (coordinator/service.py),
# so that an error can say which cluster and which coordinator answered: two
# local clusters on one machine may both listen on default-looking ports.
CLUSTER_METADATA = "x-phalanx-cluster"
COORDINATOR_METADATA = "x-phalanx-coordinator"


class PhalanxError(Exception):
    """Base of every error Phalanx raises on purpose.

    Errors the SDK translated from a coordinator's answer also say who
    answered: ``cluster`` and ``coordinator`` (from the answer's trailing
    metadata; empty from a coordinator too old to send them) and ``address``
    (where the SDK sent the call). ``str()`` is the coordinator's message;
    ``origin`` is the "who answered" part, for the CLI's error line."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    cluster: str = ""
    coordinator: str = ""
    address: str = ""

    @property
    def origin(self) -> str:
        """``cluster local, coordinator az-a-c0 at 127.0.0.1:7070``; ``""``
        when nobody answered (e.g. every address unreachable)."""
        parts = []
        if self.cluster:
            parts.append(f"cluster {self.cluster}")
        if self.coordinator:
            parts.append(f"coordinator {self.coordinator}")
        where = ", ".join(parts)
        if self.address and where:
            where += f" at {self.address}"
        return where


class InvalidArgument(PhalanxError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(PhalanxError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(PhalanxError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(PhalanxError):
    """The request is valid but the gang is in the wrong state (e.g. cancel of a
    finished gang)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unimplemented(PhalanxError):
    code = grpc.StatusCode.UNIMPLEMENTED


class StoreError(PhalanxError):
    """Base of the errors the etcd store raises (phalanx/store.py)."""


class StoreUnavailable(StoreError):
    """etcd cannot be reached or has no leader; nothing was written."""

    code = grpc.StatusCode.UNAVAILABLE


class StoreDenied(StoreError):
    """etcd refused the call: the etcd user this process logs in as (the CN
    of its etcd client certificate) has no permission for the key. Not
    transient: the same call with the same credentials is refused again, so
    nothing retries it; it is a deployment error (wrong ``--etcd-tls-dir``,
    or roles not provisioned: ``phalanx etcd-auth``). To a gRPC client it
    is the server's fault, not the caller's: INTERNAL."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, key: str = "", user: str = "") -> None:
        super().__init__(message)
        self.key = key
        self.user = user


class ResourceExhausted(PhalanxError):
    """A limit was met: etcd's space quota (``StoreSpaceExhausted``), or a
    message over gRPC's size limit. Not retried: the same call meets the
    same limit until something changes."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class StoreSpaceExhausted(StoreUnavailable, ResourceExhausted):
    """etcd's space alarm (NOSPACE) is active: its database reached
    ``--quota-backend-bytes`` and etcd refuses every write (reads still
    work) until an operator compacts, defragments and disarms it
    (docs/etcd-keys.md "When etcd is full"). A StoreUnavailable, so every
    caller that already waits out an unavailable etcd does so here too; to a
    gRPC client it is RESOURCE_EXHAUSTED, naming the alarm."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NotLeader(PhalanxError):
    """This coordinator is not (or no longer) its AZ's leader. Raised when a
    fenced compare fails: step down, never retry blindly."""

    code = grpc.StatusCode.UNAVAILABLE


class Conflict(PhalanxError):
    """A guarded write lost its compare (someone else changed the record)."""

    code = grpc.StatusCode.ABORTED


class PermissionDenied(PhalanxError):
    """A peer or agent message from a coordinator that is not a current leader."""

    code = grpc.StatusCode.PERMISSION_DENIED


class DataLoss(PhalanxError):
    """A stored record cannot be read back (corrupt, or written by hand past
    the bounds): the cluster's fault, not the caller's, and not retryable."""

    code = grpc.StatusCode.DATA_LOSS


_BY_CODE: dict[grpc.StatusCode, type[PhalanxError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.UNAVAILABLE: StoreUnavailable,
    grpc.StatusCode.ABORTED: Conflict,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.DATA_LOSS: DataLoss,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
}


def from_status(code: grpc.StatusCode, message: str, *, cluster: str = "", coordinator: str = "", address: str = "") -> PhalanxError:
    """The SDK's half of the table: a gRPC status back to a typed error."""
    cls = _BY_CODE.get(code, PhalanxError)
    err = cls(message or code.name)
    err.code = code
    err.cluster, err.coordinator, err.address = cluster, coordinator, address
    return err
