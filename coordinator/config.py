"""A coordinator's configuration; its timings are `phalanx.timings.Timings`,
validated with the rest at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.core.compaction import retention_error
from coordinator.core.fanout import StreamLimits
from coordinator.core.rate_limit import RateLimits
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
    # Finished gangs this AZ keeps in etcd at most, by count and by bytes of
    # their records (0: etcd_quota_bytes/16), oldest out first, whatever
    # gang_retention_s says (docs/etcd-keys.md "Retention by count and bytes").
    max_finished_gangs: int = 50_000
    # History of an etcd this coordinator does not run, compacted by the
    # AZ's leader to what it saw this long ago; 0: off, etcd's own
    # --auto-compaction-* flags do it (docs/etcd-keys.md "Compaction").
    etcd_compact_retention_s: float = 0.0
    max_finished_bytes: int = 0
    # Ids of collected gangs kept (``expired/<id>``, a few hundred bytes
    # each) so that GetGang can say "finished and expired"; cluster-wide.
    max_expired_ids: int = 100_000
    # Watch streams (docs/limits.md "Watch streams"): open per identity and
    # in all, changes buffered per stream, changes kept for a resume.
    watch: StreamLimits = StreamLimits()
    # Submissions and agent registrations per identity (docs/limits.md "Rate limits").
    rates: RateLimits = RateLimits()
    # The leader checks its book after each admission cycle and logs what
    # is inconsistent at ERROR (coordinator/book_check.py; docs/book.md).
    check_book: bool = False

    @property
    def finished_bytes_bound(self) -> int:
        return self.max_finished_bytes or self.etcd_quota_bytes // 16

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
        for name in ("max_finished_gangs", "max_finished_bytes", "max_expired_ids"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0 or (v == 0 and name == "max_finished_gangs"):
                errors.append(f"{name} must be a positive whole number, got {v!r}")
        if isinstance(self.etcd_quota_bytes, int) and isinstance(self.max_finished_bytes, int) \
                and self.max_finished_bytes > self.etcd_quota_bytes // 4:
            errors.append(f"max_finished_bytes must be at most a quarter of etcd_quota_bytes "
                          f"({self.max_finished_bytes} > {self.etcd_quota_bytes // 4}): one AZ's finished gangs must "
                          f"leave etcd room for the live ones, their history and the other AZs'")
        if not isinstance(self.etcd_compact_retention_s, (int, float)) or self.etcd_compact_retention_s < 0:
            errors.append(f"etcd_compact_retention_s must be 0 (off) or a number of seconds, "
                          f"got {self.etcd_compact_retention_s!r}")
        else:
            e = retention_error(self.etcd_compact_retention_s, self.timings.etcd_space_poll_s)
            if e:
                errors.append(e)
        errors += self.watch.errors()
        errors += self.rates.errors()
        if bool(self.token_file) != bool(self.token_listen):
            errors.append("token_file and token_listen go together (--token-file FILE --token-listen HOST:PORT)")
        if errors:
            raise ConfigError("invalid coordinator config: " + "; ".join(errors))
        self.timings.validate()
        return self
