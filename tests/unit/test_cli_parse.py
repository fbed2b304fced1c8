"""The ``phalanx`` command without a cluster: argument parsing, local spec
validation (nothing may leave the machine), exit codes and error lines."""

from __future__ import annotations

import argparse
import io
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.launcher import MemberKey
from phalanx import cli, procs
from phalanx.member_logs import member_exit_path, member_log_path
from phalanx.model import GangState


@pytest.fixture(autouse=True)
def _plaintext_client_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about parsing, deadlines and failover against dead or
    silent addresses, where no TLS handshake happens: plaintext, chosen
    explicitly ($PHALANX_INSECURE) as the client requires, and no config
    file of the machine's user (HOME is empty). Credentials have their own
    tests (test_client_config.py)."""
    for name in ("PHALANX_TLS_DIR", "PHALANX_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PHALANX_INSECURE", "1")
    monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def silent_listener() -> Iterator[tuple[socket.socket, str]]:
    """A listening socket that nobody serves: any connection attempt to it
    would be queued in its backlog, which the test can then detect."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    yield sock, f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def assert_never_contacted(sock: socket.socket) -> None:
    with pytest.raises(BlockingIOError):
        conn, _ = sock.accept()
        conn.close()


@pytest.fixture
def unused_address() -> str:
    """An address where nothing listens (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(list(argv))


# --- parsing ------------------------------------------------------------------------

PARSES: list[tuple[str, list[str], dict[str, object]]] = [
    ("submit-defaults", ["submit", "g.yaml"], {"command": "submit", "file": "g.yaml", "output": "id", "idempotency_key": None, "dry_run": False}),
    ("submit-key-and-output", ["submit", "g.yaml", "--idempotency-key", "k1", "-o", "wide"], {"idempotency_key": "k1", "output": "wide"}),
    ("submit-stdin", ["submit", "-"], {"file": "-"}),
    ("get-json", ["get", "tiny-1a2b3c4d", "-o", "json"], {"command": "get", "id": "tiny-1a2b3c4d", "output": "json"}),
    ("list-filters", ["list", "--queue", "q", "--az", "az-b", "--name-prefix", "ll", "--limit", "5"], {"queue": "q", "az": "az-b", "name_prefix": "ll", "limit": 5, "states": []}),
    ("list-states-repeat-and-comma", ["list", "--state", "running,pending", "--state", "FAILED"], {"states": [GangState.RUNNING, GangState.PENDING, GangState.FAILED]}),
    ("list-state-wire-name", ["list", "--state", "GANG_STATE_RESERVED"], {"states": [GangState.RESERVED]}),
    ("watch", ["watch", "g1"], {"command": "watch", "id": "g1"}),
    ("wait", ["wait", "g1", "--for", "running", "--timeout", "30"], {"wanted": [GangState.RUNNING], "timeout": 30.0}),
    ("wait-several", ["wait", "g1", "--for", "running,succeeded"], {"wanted": [GangState.RUNNING, GangState.SUCCEEDED], "timeout": 300.0}),
    ("cancel-reason", ["cancel", "g1", "--reason", "oops"], {"command": "cancel", "reason": "oops"}),
    ("explain", ["explain", "g1"], {"command": "explain", "output": "text"}),
    ("nodes-az", ["nodes", "--az", "az-a"], {"command": "nodes", "az": "az-a"}),
    ("status", ["status"], {"command": "status", "output": "text"}),
    ("topology", ["topology", "--az", "az-c"], {"command": "topology", "az": "az-c"}),
    ("logs", ["logs", "g1", "--rank", "3", "--state-dir", "/tmp/x"], {"gang": "g1", "rank": 3, "incarnation": None, "state_dir": "/tmp/x", "follow": False}),
    ("logs-follow", ["logs", "g1", "-f"], {"follow": True}),
    ("rpc-timeout-at-the-limit", ["status", "--rpc-timeout", "3600"], {"rpc_timeout": 3600.0}),
    ("limit-int32-max", ["list", "--limit", "2147483647"], {"limit": 2**31 - 1}),
    ("address-before-command", ["--address", "h:1", "status"], {"address": "h:1"}),
    ("address-after-command", ["status", "--address", "h:1,h:2"], {"address": "h:1,h:2"}),
    ("rpc-timeout", ["get", "x", "--rpc-timeout", "2.5"], {"rpc_timeout": 2.5}),
    (
        "up-defaults",
        ["up"],
        {"azs": 3, "coordinators_per_az": 2, "nodes_per_az": 8, "etcd": "", "no_workload": False, "launch": False, "state_dir": "", "cluster": "", "base_port": 7070},
    ),
    (
        "up-flags",
        ["up", "--azs", "2", "--coordinators-per-az", "1", "--nodes-per-az", "4", "--etcd", "http://h:2379", "--no-workload", "--launch", "--state-dir", "/tmp/s", "--cluster", "c1", "--base-port", "0"],
        {"azs": 2, "coordinators_per_az": 1, "nodes_per_az": 4, "etcd": "http://h:2379", "no_workload": True, "launch": True, "state_dir": "/tmp/s", "cluster": "c1", "base_port": 0},
    ),
]


@pytest.mark.parametrize("argv, expected", [c[1:] for c in PARSES], ids=[c[0] for c in PARSES])
def test_parses(argv: list[str], expected: dict[str, object]) -> None:
    ns = parse(*argv)
    for key, value in expected.items():
        assert getattr(ns, key) == value, key


USAGE_ERRORS: list[tuple[str, list[str]]] = [
    ("no-command", []),
    ("unknown-command", ["launch"]),
    ("submit-needs-file", ["submit"]),
    ("submit-bad-output", ["submit", "g.yaml", "-o", "xml"]),
    ("wait-needs-for", ["wait", "g1"]),
    ("wait-unknown-state", ["wait", "g1", "--for", "done"]),
    ("wait-negative-timeout", ["wait", "g1", "--for", "running", "--timeout", "-1"]),
    ("wait-zero-timeout", ["wait", "g1", "--for", "running", "--timeout", "0"]),
    ("list-unknown-state", ["list", "--state", "bogus"]),
    ("list-negative-limit", ["list", "--limit", "-1"]),
    ("logs-negative-rank", ["logs", "g1", "--rank", "-1"]),
    ("rpc-timeout-not-number", ["status", "--rpc-timeout", "soon"]),
    ("rpc-timeout-huge", ["status", "--rpc-timeout", "1e11"]),
    ("rpc-timeout-over-an-hour", ["status", "--rpc-timeout", "3601"]),
    ("rpc-timeout-nan", ["status", "--rpc-timeout", "nan"]),
    ("limit-over-int32", ["list", "--limit", "99999999999999999999"]),
    ("limit-int32-max-plus-one", ["list", "--limit", "2147483648"]),
    ("unknown-flag", ["list", "--bogus"]),
    ("bad-output", ["get", "g1", "-o", "xml"]),
]


@pytest.mark.parametrize("argv", [c[1] for c in USAGE_ERRORS], ids=[c[0] for c in USAGE_ERRORS])
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == cli.EXIT_INVALID
    out, err = capsys.readouterr()
    # One `error:` line, as every other error: no usage dump.
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert out == ""


BAD_ADDRESSES: list[tuple[str, str, str]] = [
    ("port-too-big", "127.0.0.1:99999", "port must be between 1 and 65535, got 99999"),
    ("port-zero", "127.0.0.1:0", "port must be between 1 and 65535, got 0"),
    ("no-port", "127.0.0.1", "is not host:port"),
    ("second-entry-bad", "127.0.0.1:7070,h:70000", "'h:70000'"),
    ("blank-only", " , ", "no coordinator address"),
]


@pytest.mark.parametrize("address, words", [c[1:] for c in BAD_ADDRESSES], ids=[c[0] for c in BAD_ADDRESSES])
def test_bad_address_exits_2_naming_it_without_connecting(address: str, words: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--address", address, "--rpc-timeout", "30"]) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert err.startswith("error: --address: ") and words in err and err.count("\n") == 1, err
    # The same from the environment, which the message names instead.
    monkeypatch.setenv(cli.ADDRESS_ENV, address)
    assert cli.main(["status", "--rpc-timeout", "30"]) == cli.EXIT_INVALID
    assert capsys.readouterr().err.startswith(f"error: ${cli.ADDRESS_ENV}: ")


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import metadata

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"phalanx {metadata.version('phalanx')}"


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert "submit" in capsys.readouterr().out


def test_address_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.ADDRESS_ENV, raising=False)
    assert cli.resolve_connection(parse("status")).addresses == ("127.0.0.1:7070",)
    monkeypatch.setenv(cli.ADDRESS_ENV, "10.0.0.1:7070,10.0.0.2:7070")
    conn = cli.resolve_connection(parse("status"))
    assert conn.addresses == ("10.0.0.1:7070", "10.0.0.2:7070") and conn.addresses_from == f"${cli.ADDRESS_ENV}"
    # The flag wins over the environment.
    conn = cli.resolve_connection(parse("status", "--address", "h:9"))
    assert conn.addresses == ("h:9",) and conn.addresses_from == "--address"


# --- local validation: nothing is sent ---------------------------------------------------

BAD_SPECS: list[tuple[str, str, str]] = [
    ("negative-members", "name: g\nmembers: -3\nresources: {gpus: 1}\n", "members"),
    ("unknown-field", "name: g\nmembers: 1\nresources: {gpus: 1, cpus: 2}\n", "resources.cpus"),
    ("bad-level", "name: g\nmembers: 1\nresources: {gpus: 1}\ntopology: {required: rack}\n", "topology.required"),
    ("bad-name", "name: G_1\nmembers: 1\nresources: {gpus: 1}\n", "name"),
    ("empty-file", "", "spec"),
    ("not-yaml", "name: [\n", "spec"),
]


@pytest.mark.parametrize("text, field", [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS])
def test_submit_bad_spec_exits_2_without_contacting_a_server(
    text: str, field: str, tmp_path: Path, silent_listener: tuple[socket.socket, str], capsys: pytest.CaptureFixture[str]
) -> None:
    sock, address = silent_listener
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    assert cli.main(["submit", str(path), "--address", address]) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert field in err
    assert "Traceback" not in err
    assert_never_contacted(sock)


def test_submit_missing_file_exits_2(tmp_path: Path, silent_listener: tuple[socket.socket, str], capsys: pytest.CaptureFixture[str]) -> None:
    sock, address = silent_listener
    assert cli.main(["submit", str(tmp_path / "nope.yaml"), "--address", address]) == cli.EXIT_INVALID
    assert "cannot read" in capsys.readouterr().err
    assert_never_contacted(sock)


def test_submit_dry_run_prints_normalised_spec(silent_listener: tuple[socket.socket, str], capsys: pytest.CaptureFixture[str]) -> None:
    sock, address = silent_listener
    assert cli.main(["submit", str(REPO / "examples" / "tiny.yaml"), "--dry-run", "--address", address]) == 0
    out = capsys.readouterr().out
    assert "name: tiny" in out and "members: 8" in out
    assert_never_contacted(sock)


def test_unreachable_cluster_exits_1_with_one_error_line(unused_address: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["get", "g1", "--address", unused_address, "--rpc-timeout", "1"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert unused_address in err
    assert "Traceback" not in err


def test_bad_address_list_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["status", "--address", " , "]) == cli.EXIT_INVALID
    assert "--address" in capsys.readouterr().err


def _phalanx(*argv: str, stdin: object = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "phalanx", *argv], stdin=stdin, capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_submit_of_an_endless_file_or_stdin_ends_with_the_limit(device: str, silent_listener: tuple[socket.socket, str]) -> None:
    """The real entry point: the file, or the same device as stdin, is read
    only up to the limit (the report: 3.8 GB from /dev/zero, /dev/urandom
    on stdin never ended)."""
    from phalanx.spec import MAX_SPEC_BYTES

    sock, address = silent_listener
    for argv, stdin in (([device], None), (["-"], open(device, "rb"))):
        try:
            proc = _phalanx("submit", *argv, "--address", address, stdin=stdin)
        finally:
            if stdin is not None:
                stdin.close()
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
        assert f"limit of {MAX_SPEC_BYTES} bytes" in proc.stderr
    assert_never_contacted(sock)


def test_submit_refuses_duplicate_keys_and_aliases(tmp_path: Path, silent_listener: tuple[socket.socket, str], capsys: pytest.CaptureFixture[str]) -> None:
    sock, address = silent_listener
    dup = tmp_path / "dup.yaml"
    dup.write_text("name: dup1\nmembers: 1\nresources: {gpus: 1}\nname: dup2\n")
    assert cli.main(["submit", str(dup), "--address", address]) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert "duplicate key 'name'" in err and "line 4" in err and err.count("\n") == 1
    alias = tmp_path / "alias.yaml"
    alias.write_text("name: &n a\nmembers: 1\nresources: {gpus: 1}\nqueue: *n\n")
    assert cli.main(["submit", str(alias), "--address", address, "--dry-run"]) == cli.EXIT_INVALID
    assert "aliases" in capsys.readouterr().err
    assert_never_contacted(sock)


def test_console_script_prints_no_traceback(tmp_path: Path, silent_listener: tuple[socket.socket, str]) -> None:
    """The real entry point, in a fresh interpreter."""
    sock, address = silent_listener
    path = tmp_path / "bad.yaml"
    path.write_text("name: g\nmembers: -3\nresources: {gpus: 1}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx", "submit", str(path), "--address", address],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "members" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert_never_contacted(sock)


# --- phalanx up: flags are checked before anything starts ----------------------------------

UP_BAD_FLAGS: list[tuple[str, list[str], str]] = [
    ("zero-azs", ["--azs", "0"], "--azs"),
    ("too-many-azs", ["--azs", "27"], "--azs"),
    ("zero-coordinators", ["--coordinators-per-az", "0"], "--coordinators-per-az"),
    ("zero-nodes", ["--nodes-per-az", "0"], "--nodes-per-az"),
    ("privileged-port", ["--base-port", "80"], "--base-port"),
    ("bad-cluster-name", ["--cluster", "My Cluster"], "--cluster"),
    ("etcd-without-port", ["--etcd", "nohost"], "--etcd: etcd endpoint 'nohost': missing port"),
    ("etcd-one-of-two-bad", ["--etcd", "127.0.0.1:2379,[::1"], "--etcd: etcd endpoint '[::1'"),
]


@pytest.mark.parametrize("argv, flag", [c[1:] for c in UP_BAD_FLAGS], ids=[c[0] for c in UP_BAD_FLAGS])
def test_up_rejects_bad_flags_before_starting_anything(argv: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    assert cli.main(["up", "--state-dir", str(state), *argv]) == cli.EXIT_INVALID
    assert flag in capsys.readouterr().err
    assert not state.exists()


def test_up_refuses_a_state_dir_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "state"
    file.write_text("not a directory\n")
    assert cli.main(["up", "--state-dir", str(file)]) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert err == f"error: --state-dir: {file} exists and is not a directory\n"
    assert file.read_text() == "not a directory\n"


def test_up_config_names_azs_and_normalises_etcd() -> None:
    from phalanx.up.config import UpConfig

    cfg = UpConfig.from_args(parse("up", "--azs", "4", "--etcd", "http://10.0.0.1:2379/, 10.0.0.2:2379", "--insecure"))
    assert cfg.azs == ("az-a", "az-b", "az-c", "az-d")
    assert cfg.etcd == "10.0.0.1:2379,10.0.0.2:2379"
    assert cfg.workload


def test_up_picks_consecutive_ports_and_replaces_taken_ones() -> None:
    from phalanx.up.ports import pick_ports, port_is_free

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        base = taken.getsockname()[1]
        assert not port_is_free(base)
        ports = pick_ports(base, 3)
    assert ports[0] != base  # taken: replaced by a free port
    assert len(set(ports)) == 3 and all(p > 0 for p in ports)
    # base 0: free ports only, all distinct.
    assert len(set(pick_ports(0, 4))) == 4


def test_workload_fits_templates_to_the_cluster() -> None:
    from phalanx.spec import parse_spec
    from phalanx.up.workload import fit_template, load_templates

    templates = {t.label: t for t in load_templates()}
    assert {"tiny", "llama-pretrain", "cross-az", "real-command"} <= set(templates)
    assert templates["cross-az"].cross_az and templates["real-command"].real_command
    # Two 8-GPU nodes: the 4 x 8-GPU gang shrinks to what half the AZ holds.
    data = fit_template(templates["llama-pretrain"], nodes=2, gpus_per_node=8, azs=1, seq=7)
    spec = parse_spec(data)
    assert spec.name == "llama-pretrain-7"
    assert spec.members * spec.resources.gpus <= 8
    assert spec.topology.required is not None  # constraints are kept
    # Big nodes, big cluster: the example's own size is kept.
    spec = parse_spec(fit_template(templates["tiny"], nodes=8, gpus_per_node=8, azs=3, seq=1))
    assert (spec.members, spec.resources.gpus) == (8, 1)


# --- output helpers ------------------------------------------------------------------------

AGES = [(0, "0s"), (59, "59s"), (119, "119s"), (120, "2m"), (7199, "119m"), (7200, "2h"), (3 * 86400, "3d"), (-1, "-"), (float("nan"), "-")]


@pytest.mark.parametrize("seconds, text", AGES, ids=[t for _, t in AGES])
def test_format_age(seconds: float, text: str) -> None:
    assert cli.format_age(seconds) == text


def test_format_table_aligns_columns() -> None:
    table = cli.format_table(["A", "LONG"], [["xxx", "1"], ["y", "22 reason"]]).splitlines()
    assert table[0] == "A    LONG"
    assert table[1] == "xxx  1"
    assert table[2] == "y    22 reason"


def test_format_state_counts_in_lifecycle_order() -> None:
    counts = {"GANG_STATE_SUCCEEDED": 2, "RUNNING": 3, "GANG_STATE_PENDING": 1, "FAILED": 0}
    assert cli.format_state_counts(counts) == "PENDING 1, RUNNING 3, SUCCEEDED 2"


# --- -o json|yaml: what a person (and `phalanx submit`) can reuse -------------------------------


def _gang_pb() -> Any:
    from phalanx.v1 import types_pb2 as pb

    return pb.Gang(
        id="train-0123abcd", state=pb.GANG_STATE_PENDING, span=pb.TOPOLOGY_LEVEL_LEAF, owner_az="az-a",
        submitted_at=1717230467.25, updated_at=1717230470.0, mod_revision=2**40,
        spec=pb.GangSpec(
            name="train", members=2, resources=pb.Resources(gpus=8, rdma_nics=8),
            topology=pb.TopologyConstraint(required=pb.TOPOLOGY_LEVEL_SPINE, preferred=pb.TOPOLOGY_LEVEL_LEAF),
            run=pb.RunSpec(command=["python", "train.py"], env={"EPOCHS": "3"}, duration_s=0.0),
            policy=pb.Policy(admission_timeout_s=600, max_restarts=0, start_timeout_s=300),
        ),
        placement=[pb.MemberPlacement(rank=0, az="az-a", node="n0", gpus=[0, 1])],
    )


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_dump_spells_states_levels_and_times_as_people_do(fmt: str) -> None:
    import datetime
    import json

    import yaml

    data = (yaml.safe_load if fmt == "yaml" else json.loads)(cli.dump(_gang_pb(), fmt))
    assert data["state"] == "PENDING" and data["span"] == "leaf"
    assert data["spec"]["topology"] == {"required": "spine", "preferred": "leaf", "allow_cross_az": False}
    assert data["submitted_at"] == "2024-06-01T08:27:47.250Z"
    assert datetime.datetime.fromisoformat(data["updated_at"].replace("Z", "+00:00")).timestamp() == 1717230470.0
    assert data["mod_revision"] == 2**40  # a number, not protobuf JSON's string
    assert data["placement"] == [{"rank": 0, "az": "az-a", "node": "n0", "gpus": [0, 1], "nics": []}]
    assert "not_before" not in data  # an unset time is left out, not 1970


def test_dumped_spec_is_accepted_by_submit_unchanged(tmp_path: Path, silent_listener: tuple[socket.socket, str], capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from phalanx.spec import load_spec
    from phalanx.wire import spec_from_pb

    gang = _gang_pb()
    spec_text = yaml.safe_dump(yaml.safe_load(cli.dump(gang, "yaml"))["spec"])
    # Zero restarts and a zero duration survive (proto3 would drop them).
    assert load_spec(spec_text) == spec_from_pb(gang.spec)
    path = tmp_path / "again.yaml"
    path.write_text(spec_text)
    sock, address = silent_listener
    assert cli.main(["submit", str(path), "--dry-run", "--address", address]) == 0
    assert "name: train" in capsys.readouterr().out
    assert_never_contacted(sock)


def test_dump_of_other_messages() -> None:
    from phalanx.v1 import gang_pb2 as gpb
    from phalanx.v1 import types_pb2 as pb

    node = cli.message_to_dict(pb.NodeStatus(
        topology=pb.NodeTopology(node="n0", links=[pb.GpuNicLink(gpu=0, nic="mlx5_0", distance=pb.PCIE_DISTANCE_PIX)]),
        last_heartbeat=0.5,
    ))
    assert node["topology"]["links"] == [{"gpu": 0, "nic": "mlx5_0", "distance": "PIX"}]
    assert node["last_heartbeat"] == "1970-01-01T00:00:00.500Z"
    explain = cli.message_to_dict(gpb.ExplainGangResponse(shortfalls=[pb.DomainShortfall(level=pb.TOPOLOGY_LEVEL_NVLINK_DOMAIN)]))
    assert explain["shortfalls"][0]["level"] == "nvlink_domain"
    assert cli.message_to_dict(pb.Gang(state=42))["state"] == 42  # unknown: the number, not a crash


# --- logs: files written by agents with --launch ---------------------------------------------


def test_logs_needs_a_state_dir(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(cli.STATE_DIR_ENV, raising=False)
    assert cli.main(["logs", "g1"]) == cli.EXIT_INVALID
    assert cli.STATE_DIR_ENV in capsys.readouterr().err


def write_member_log(state_dir: Path, gang: str, incarnation: int, rank: int, text: str) -> None:
    path = member_log_path(state_dir, MemberKey(gang, incarnation, rank))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_logs_reads_the_latest_incarnation_across_agent_dirs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The layout `phalanx up --launch` produces: <dir>/<az>/<node>-agent/logs/...
    write_member_log(tmp_path / "az-a" / "n1-agent", "g1", 1, 0, "old rank 0\n")
    write_member_log(tmp_path / "az-a" / "n1-agent", "g1", 2, 0, "new rank 0\n")
    write_member_log(tmp_path / "az-b" / "n7-agent", "g1", 2, 1, "new rank 1\n")
    assert cli.main(["logs", "g1", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "new rank 0" in out and "new rank 1" in out and "old rank 0" not in out

    assert cli.main(["logs", "g1", "--state-dir", str(tmp_path), "--rank", "1"]) == 0
    assert capsys.readouterr().out == "new rank 1\n"

    assert cli.main(["logs", "g1", "--state-dir", str(tmp_path), "--incarnation", "1"]) == 0
    assert capsys.readouterr().out == "old rank 0\n"


def test_logs_env_state_dir_and_missing_gang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(cli.STATE_DIR_ENV, str(tmp_path))
    assert cli.main(["logs", "nothing-here"]) == cli.EXIT_INVALID
    assert "no logs for gang nothing-here" in capsys.readouterr().err


def test_logs_by_gang_name_picks_the_most_recent_gang(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_member_log(tmp_path / "az-a" / "n1-agent", "train-0123abcd", 1, 0, "older gang\n")
    write_member_log(tmp_path / "az-a" / "n2-agent", "train-89abcdef", 1, 0, "newer gang\n")
    older = tmp_path / "az-a" / "n1-agent" / "logs" / "train-0123abcd"
    os.utime(older, (1, 1))
    assert cli.main(["logs", "train", "--state-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "newer gang\n"


# --- logs -f: follow until the members have ended ------------------------------------------

EXIT_MARK = "[phalanx 2024-06-01T08:00:00+0000] exit {key} code=0\n"


class _Output:
    """A child's stdout read straight from the pipe (no buffering in
    between, so select() sees everything that was written)."""

    def __init__(self, proc: subprocess.Popen[bytes]):
        self.fd = proc.stdout.fileno()
        self.text = ""

    def until(self, wanted: str, deadline_s: float = 60.0) -> str:
        import select

        end = time.monotonic() + deadline_s
        while wanted not in self.text:
            left = end - time.monotonic()
            assert left > 0, f"never printed {wanted!r}; got {self.text!r}"
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                chunk = os.read(self.fd, 1 << 16)
                assert chunk, f"stdout closed before {wanted!r}; got {self.text!r}"
                self.text += chunk.decode()
        return self.text


def test_logs_follow_prints_new_output_and_ends_with_the_members(tmp_path: Path) -> None:
    root = tmp_path / "az-a" / "n1-agent"
    write_member_log(root, "g1", 1, 0, "rank 0 starts\n")
    proc = procs.spawn(
        [sys.executable, "-m", "phalanx", "logs", "g1", "-f", "--state-dir", str(tmp_path)],
        die_with_parent=procs.KILL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
    )
    out = _Output(proc)
    try:
        out.until("rank 0 starts")
        # A second member appears after the follow started; both grow.
        write_member_log(tmp_path / "az-b" / "n2-agent", "g1", 1, 1, "rank 1 starts\n")
        out.until("rank 1 starts")
        path0 = member_log_path(root, MemberKey("g1", 1, 0))
        with open(path0, "a") as f:
            f.write("rank 0 step 1\n")
        out.until("rank 0 step 1")
        with open(path0, "a") as f:
            f.write(EXIT_MARK.format(key="g1#1/r0"))
        out.until("exit g1#1/r0")
        assert proc.poll() is None  # rank 1 has not ended yet
        with open(member_log_path(tmp_path / "az-b" / "n2-agent", MemberKey("g1", 1, 1)), "a") as f:
            f.write(EXIT_MARK.format(key="g1#1/r1"))
        assert proc.wait(timeout=60) == 0
        text = out.until("exit g1#1/r1")
        assert "==> g1#1/r1 <==" in text and text.index("rank 0 step 1") > text.index("rank 1 starts")
        assert proc.stderr.read() == b""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_logs_follow_ends_on_ctrl_c(tmp_path: Path) -> None:
    write_member_log(tmp_path / "n1-agent", "g1", 1, 0, "running\n")
    proc = procs.spawn(
        [sys.executable, "-m", "phalanx", "logs", "g1", "-f", "--state-dir", str(tmp_path)],
        die_with_parent=procs.KILL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
    )
    try:
        _Output(proc).until("running")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == cli.EXIT_INTERRUPTED
        assert proc.stderr.read() == b"interrupted\n"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_logs_follow_ends_on_an_exit_record_without_end_mark(tmp_path: Path) -> None:
    """The agent died before it marked the exit: the shim's exit record and
    a log that stopped growing end the follow (clock and sleep injected)."""
    key = MemberKey("g1", 1, 0)
    write_member_log(tmp_path, "g1", 1, 0, "last words\n")
    now = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s
        if len(sleeps) == 2:
            member_exit_path(tmp_path, key).write_text('{"code": 0}')
        assert len(sleeps) < 1000, "follow never ended"

    out = io.StringIO()
    code = cli.follow_logs(lambda: [(key, member_log_path(tmp_path, key))], out=out, clock=lambda: now[0], sleep=sleep)
    assert code == 0 and out.getvalue() == "last words\n"
    assert now[0] >= cli.FOLLOW_SETTLE_S


# --- issue 24: what a newcomer meets --------------------------------------------------------


@pytest.mark.parametrize("argv, prog", [
    (["up", "--log-formt", "json"], "phalanx up"),
    (["policy", "get", "--bogus"], "phalanx policy get"),
    (["list", "--bogus"], "phalanx list"),
])
def test_unknown_flag_names_the_command_whose_help_lists_the_flags(argv: list[str], prog: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"(see {prog} --help)" in err, err


def test_up_takes_log_format_for_its_children(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.up.config import UpConfig

    monkeypatch.delenv("PHALANX_LOG_FORMAT", raising=False)
    assert UpConfig.from_args(parse("up", "--log-format", "json")).log_format == "json"
    assert UpConfig.from_args(parse("up")).log_format is None
    monkeypatch.setenv("PHALANX_LOG_FORMAT", "json")
    assert UpConfig.from_args(parse("up")).log_format == "json"


def test_activation_line_puts_this_install_first_and_exports_config_and_state_dir(tmp_path: Path) -> None:
    from phalanx.up.credentials import ACTIVATION_LINE, activation_line, cli_bin_dir

    assert cli_bin_dir() == Path(sys.executable).parent  # this venv has the phalanx command
    line = activation_line(cli_bin_dir(), tmp_path / "config.yaml", tmp_path)
    assert ACTIVATION_LINE.match(line), line
    # A clean shell given only that line finds this install's phalanx and python3 (with the SDK).
    done = subprocess.run(["bash", "-c", f"{line}\ncommand -v phalanx; python3 -c 'import phalanx.client'; "
                           "echo $PHALANX_CONFIG $PHALANX_STATE_DIR"],
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(Path(sys.executable).parent / "phalanx"), str(tmp_path / "config.yaml"), str(tmp_path)]
    assert activation_line(None, tmp_path / "c.yaml", tmp_path).startswith('export PATH="$PATH" ')


def test_workload_line_names_the_launch_member_budget() -> None:
    from phalanx.up.workload import workload_line

    assert "members" not in workload_line(["a", "b"], 3, launch=False)
    line = workload_line(["a"], 3, launch=True, budget=4)
    assert "up to 3 live gang(s) per AZ" in line and "at most 4 members live in the whole cluster" in line


def test_watch_line_is_stamped_with_the_change_not_the_print() -> None:
    from phalanx.v1 import types_pb2 as pb

    changed = time.mktime((2024, 6, 1, 8, 27, 47, 0, 0, -1))
    assert cli.watch_line(pb.Gang(id="g-1", state=GangState.RUNNING, updated_at=changed)).startswith("08:27:47  g-1  RUNNING")


@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_dump_keeps_non_ascii_text(fmt: str) -> None:
    from phalanx.v1 import types_pb2 as pb

    gang = _gang_pb()
    gang.reason = "needs 2×8 GPUs"
    gang.spec.run.env["NOTE"] = "naïve"
    out = cli.dump(gang, fmt)
    assert "2×8" in out and "naïve" in out and "\\x" not in out and "\\u" not in out, out
    assert "naïve" in cli.describe_full(gang)


def test_submitting_a_whole_get_output_says_to_submit_its_spec(tmp_path: Path, silent_listener: tuple[socket.socket, str], capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "llama.yaml"
    path.write_text(cli.dump(_gang_pb(), "yaml"))
    sock, address = silent_listener
    assert cli.main(["submit", str(path), "--address", address]) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "submit only its `spec:` part" in err and "allowed" not in err, err
    assert_never_contacted(sock)


def test_unknown_fields_list_the_allowed_ones_once() -> None:
    from phalanx.spec import InvalidSpec, load_spec

    with pytest.raises(InvalidSpec) as info:
        load_spec("name: x\nmembers: 1\nresources: {gpus: 1}\nfoo: 1\nbar: 2\nbaz: 3\n")
    assert str(info.value).count("allowed:") == 1, info.value
    assert [e.field for e in info.value.errors] == ["foo", "bar", "baz"]


@pytest.mark.parametrize("where, why", [
    ("unused", "connection refused"),
    ("nosuch.invalid:7070", "its host name does not resolve"),  # .invalid never resolves (RFC 6761)
])
def test_nothing_listening_is_said_at_once_not_after_the_deadline(where: str, why: str, unused_address: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    address = unused_address if where == "unused" else where
    # An hour's deadline: waiting it out would hang the test; knowing the cause ends the call.
    assert cli.main(["status", "--address", f"{address},{address}", "--rpc-timeout", "3600"]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err == (f"error: ClusterStatus: nothing is listening at {address} ({why}; is the cluster up? "
                   "`phalanx config` shows what this command used)\n"), err
