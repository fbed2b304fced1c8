"""etcd's quota reaches the coordinators (docs/etcd-keys.md "When etcd is
full"): etcd does not report --quota-backend-bytes, so `phalanx up` passes
what it started etcd with, and the coordinator takes it as a validated
flag (default etcd's own, 2 GiB)."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.__main__ import parse_everything
from phalanx.etcd_server import EtcdServer
from phalanx.limits import ETCD_DEFAULT_QUOTA_BYTES
from phalanx.timings import ConfigError
from phalanx.up.children import build_children
from phalanx.up.config import UpConfig


def up_config() -> UpConfig:
    return UpConfig(azs=("az-a",), coordinators_per_az=1, nodes_per_az=1, spines=None, leaves_per_spine=None,
                    etcd="", workload=False, launch=False, state_dir="/tmp/x", cluster="local", base_port=7070,
                    gangs_per_az=0, start_timeout=30.0, insecure=True)


def coordinator_argv(quota: int) -> list[str]:
    children = build_children(up_config(), "127.0.0.1:2379", [7070], Path("/tmp/logs"), Path("/tmp/agents"),
                              etcd_quota_bytes=quota)
    (coord,) = [c for c in children if c.kind == "coordinator"]
    return coord.argv[coord.argv.index("coordinator") + 1:]


def test_up_passes_the_quota_it_started_etcd_with() -> None:
    argv = coordinator_argv(12345)
    assert argv[argv.index("--etcd-quota-bytes") + 1] == "12345"
    assert parse_everything(argv)[0].etcd_quota_bytes == 12345


def test_up_with_an_etcd_of_the_users_passes_none_and_the_default_applies() -> None:
    argv = coordinator_argv(0)
    assert "--etcd-quota-bytes" not in argv
    assert parse_everything(argv)[0].etcd_quota_bytes == ETCD_DEFAULT_QUOTA_BYTES == 2 * 1024**3


def test_etcd_is_started_with_the_quota_it_is_given(tmp_path: Path) -> None:
    cmd = EtcdServer(data_dir=tmp_path, quota_backend_bytes=4096).command()
    assert cmd[cmd.index("--quota-backend-bytes") + 1] == "4096"
    cmd = EtcdServer(data_dir=tmp_path).command()
    assert cmd[cmd.index("--quota-backend-bytes") + 1] == str(ETCD_DEFAULT_QUOTA_BYTES)


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_a_quota_that_is_no_size_is_refused_naming_the_field(bad: str) -> None:
    with pytest.raises(ConfigError, match="etcd_quota_bytes must be a positive number of bytes"):
        parse_everything(["--az", "az-a", "--id", "c0", "--etcd", "127.0.0.1:2379", "--insecure",
                          "--etcd-quota-bytes", bad])


BASE = ["--az", "az-a", "--id", "c0", "--etcd", "127.0.0.1:2379", "--insecure"]


def test_finished_gang_bounds_default_from_the_quota() -> None:
    config = parse_everything(BASE + ["--etcd-quota-bytes", str(1024**3)])[0]
    assert (config.max_finished_gangs, config.finished_bytes_bound) == (50_000, 1024**3 // 16)
    config = parse_everything(BASE + ["--max-finished-gangs", "7", "--max-finished-bytes", "4096"])[0]
    assert (config.max_finished_gangs, config.finished_bytes_bound) == (7, 4096)


@pytest.mark.parametrize("flags,words", [
    (["--max-finished-gangs", "0"], "max_finished_gangs must be a positive whole number"),
    (["--max-finished-bytes", "-1"], "max_finished_bytes must be a positive whole number"),
    (["--max-expired-ids", "-1"], "max_expired_ids must be a positive whole number"),
    (["--etcd-quota-bytes", "4000", "--max-finished-bytes", "1001"],
     "max_finished_bytes must be at most a quarter of etcd_quota_bytes (1001 > 1000)"),
])
def test_finished_gang_bounds_that_cannot_hold_are_refused_naming_the_field(flags: list[str], words: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_everything(BASE + flags)
    assert words in str(err.value)
