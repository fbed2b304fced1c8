"""A coordinator's configuration; its timings are `phalanx.timings.Timings`,
validated with the rest at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from phalanx.limits import ETCD_DEFAULT_QUOTA_BYTES
from phalanx.timings import ConfigError, Timings


@dataclass(frozen=True)
class CoordinatorConfig:
    cluster: str
    az: str
    coordinator_id: str
    etcd: tuple[str, ...]
    listen: str = "127.0.0.1:0"
    advertise: str = ""  # address peers/agents/clients use; defaults to the bound one
    timings: Timings = Timings()
    max_request_bytes: int = 1024 * 1024
    # Gangs reserved concurrently (in flight etcd txns) per leader cycle.
    reserve_parallelism: int = 32
    # Bearer tokens (docs/security.md "Bearer tokens"): the file of token
    # hashes, and the second TLS port that takes them (no client
    # certificate asked there; GangService only). Both or neither.
    token_file: str = ""
    token_listen: str = ""
    # The --policy file, named in the message when the etcd record wins.
    policy_file: str = ""
    # HOST:PORT of the /metrics endpoint (docs/metrics.md); "" = off.
    metrics_listen: str = ""
    # etcd's --quota-backend-bytes: etcd does not report it, so the
    # coordinator is told (`phalanx up` passes what it started etcd with);
    # its metrics, its warnings and `phalanx status` measure against it.
    etcd_quota_bytes: int = ETCD_DEFAULT_QUOTA_BYTES

    def validate(self) -> "CoordinatorConfig":
        errors = []
        for name in ("cluster", "az", "coordinator_id"):
            v = getattr(self, name)
            if not v or "/" in v:
                errors.append(f"{name} must be non-empty and contain no '/', got {v!r}")
        if not self.etcd:
            errors.append("etcd must name at least one endpoint")
        if self.metrics_listen:
            from phalanx.metrics import parse_listen  # (imports this module)

            try:
                parse_listen(self.metrics_listen)
            except ValueError as exc:
                errors.append(str(exc))
        if not isinstance(self.etcd_quota_bytes, int) or self.etcd_quota_bytes <= 0:
            errors.append(f"etcd_quota_bytes must be a positive number of bytes (etcd's --quota-backend-bytes), "
                          f"got {self.etcd_quota_bytes!r}")
        if bool(self.token_file) != bool(self.token_listen):
            errors.append("token_file and token_listen go together (--token-file FILE --token-listen HOST:PORT)")
        if errors:
            raise ConfigError("invalid coordinator config: " + "; ".join(errors))
        self.timings.validate()
        return self
