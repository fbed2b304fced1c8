"""Unit tables for agent/metrics.py: exit code classes, bounded labels, and
the gauges read from the agents at scrape time."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent import metrics as am
from agent.metrics import AgentMetrics, exit_class
from agent.core.member_exit import EXIT_SPAWN_FAILED, EXIT_UNKNOWN
from agent.session import TokenRefusal
from agent.shim import EXIT_FENCED


@pytest.mark.parametrize("code, cls", [
    (0, "success"),
    (1, "error"),
    (3, "error"),
    (128, "error"),            # not 128+N of any signal
    (EXIT_FENCED, "fenced"),   # 120: the shim fenced it
    (EXIT_SPAWN_FAILED, "spawn_failed"),
    (EXIT_UNKNOWN, "unknown"),
    (-9, "signal"),            # killed by SIGKILL (Popen's negative code)
    (-15, "signal"),
    (143, "signal"),           # the shell's 128+SIGTERM
    (128 + 64, "signal"),      # SIGRTMAX
    (128 + 65, "error"),       # above any signal: a plain code
    (255, "error"),
])
def test_exit_class(code: int, cls: str) -> None:
    assert exit_class(code) == cls
    assert cls in am.EXIT_CLASSES


def samples(m: AgentMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_every_label_value_is_exported_from_the_start_and_nothing_else() -> None:
    s = samples(AgentMetrics())
    labelled = {
        "phalanx_agent_members_exited_total": ("class", am.EXIT_CLASSES),
        "phalanx_agent_fence_events_total": ("kind", am.FENCE_KINDS),
        "phalanx_agent_token_check_failures_total": ("reason", am.TOKEN_REASONS),
        "phalanx_agent_assignments_refused_total": ("reason", am.REFUSAL_REASONS),
        "phalanx_agent_session_errors_total": ("kind", am.SESSION_ERRORS),
    }
    for name, (label, values) in labelled.items():
        got = sorted(dict(labels)[label] for (n, labels), _ in s.items() if n == name)
        assert got == sorted(values), name
        assert all(v == 0 for (n, _), v in s.items() if n == name)


def test_an_unknown_label_value_never_makes_a_new_series() -> None:
    m = AgentMetrics()
    before = set(samples(m))
    m.refused("no such reason")
    m.fenced("no such kind")
    m.token_refused("no such reason")
    m.session_error("no such kind")
    after = samples(m)
    assert set(after) == before
    assert after[("phalanx_agent_assignments_refused_total", (("reason", "launch_failed"),))] == 1
    # fenced("no such kind") and token_refused(...) each count one token_refused fence
    assert after[("phalanx_agent_fence_events_total", (("kind", "token_refused"),))] == 2
    assert after[("phalanx_agent_token_check_failures_total", (("reason", "unconfirmed"),))] == 1
    assert after[("phalanx_agent_session_errors_total", (("kind", "other"),))] == 1


def test_counters_move_by_their_events() -> None:
    m = AgentMetrics()
    for code in (0, 0, 3, -15):
        m.member_started(0.01)
        m.member_exited(code)
    m.token_refused(am.TOKEN_NOT_LEADER)
    s = samples(m)
    assert s[("phalanx_agent_members_started_total", ())] == 4
    assert s[("phalanx_agent_members_exited_total", (("class", "success"),))] == 2
    assert s[("phalanx_agent_members_exited_total", (("class", "error"),))] == 1
    assert s[("phalanx_agent_members_exited_total", (("class", "signal"),))] == 1
    assert s[("phalanx_agent_fence_events_total", (("kind", "token_refused"),))] == 1
    assert s[("phalanx_agent_token_check_failures_total", (("reason", "not_leader"),))] == 1


def test_gauges_add_up_the_agents_of_a_process() -> None:
    m = AgentMetrics()
    state = {"a": (True, 2), "b": (False, 3)}
    for name in state:
        m.add_agent(lambda n=name: state[n][0], lambda n=name: state[n][1])
    s = samples(m)
    assert s[("phalanx_agent_sessions_connected", ())] == 1
    assert s[("phalanx_agent_members_running", ())] == 5
    state["b"] = (True, 0)
    s = samples(m)
    assert s[("phalanx_agent_sessions_connected", ())] == 2
    assert s[("phalanx_agent_members_running", ())] == 2


def test_two_metrics_objects_do_not_share_counters() -> None:
    a, b = AgentMetrics(), AgentMetrics()
    a.member_started(0.01)
    assert samples(a)[("phalanx_agent_members_started_total", ())] == 1
    assert samples(b)[("phalanx_agent_members_started_total", ())] == 0


def test_a_token_refusal_is_its_message_with_a_bounded_reason() -> None:
    why = TokenRefusal(am.TOKEN_NO_RESERVATION, "no reservation for g in az-a")
    assert why == "no reservation for g in az-a" and why.startswith("no reservation")
    assert f"refused: {why}" == "refused: no reservation for g in az-a"
    assert why.reason in am.TOKEN_REASONS


def test_docs_list_every_agent_metric_with_its_labels() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line.split("|")[3].strip(" `") for line in doc.splitlines()
            if line.startswith("| `phalanx_agent_")}
    for family in AgentMetrics().registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        assert name in rows, f"docs/metrics.md does not list {name}"
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        assert rows[name] == ",".join(sorted(labels)), name


@pytest.mark.parametrize("program", [["agent", "--simulate-members"], ["agent.sim", "--nodes", "1"]])
def test_a_bad_or_taken_metrics_address_is_one_error_line_and_exit_2(program: list[str]) -> None:
    import socket
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = f"127.0.0.1:{held.getsockname()[1]}"
        for listen, error in (
            ("nohost", "error: --metrics-listen: expected HOST:PORT (127.0.0.1:0 picks a free port), got 'nohost'"),
            ("127.0.0.1:99999", "error: --metrics-listen: the port must be 0..65535, got 99999 in '127.0.0.1:99999'"),
            (taken, f"error: --metrics-listen: cannot serve on {taken}: Address already in use"),
        ):
            # Nothing listens at the etcd address: the check comes first.
            p = subprocess.run([sys.executable, "-m", *program, "--az", "az-a", "--etcd", "127.0.0.1:1", "--insecure",
                                "--metrics-listen", listen], capture_output=True, text=True, cwd=repo, timeout=60)
            assert p.returncode == 2, p.stderr
            assert p.stderr.strip().splitlines()[-1] == error
            assert "Traceback" not in p.stderr
