"""deploy/monitoring/: the Grafana dashboard, the alert rules (Prometheus
rule file and PrometheusRule), the scrape configurations.

Every metric name in a dashboard or rule expression is one the metrics
modules really register (their registries, built here and exposed by
prometheus_client as a scrape would be); tests/integration/test_dashboards.py
checks the same against the /metrics of a real coordinator and agent. The
rest: the files parse and agree with each other and with the manifests."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from phalanx.certs import coordinator_server_name

REPO = Path(__file__).resolve().parents[2]
MON = REPO / "deploy" / "monitoring"
DASHBOARD = MON / "grafana" / "phalanx.json"
ALERTS = MON / "alerts.yaml"
PROMETHEUS = MON / "prometheus.yml"
RULE_CR = MON / "k8s" / "prometheusrule.yaml"
MONITORS = MON / "k8s" / "servicemonitor.yaml"

# A metric name in PromQL: phalanx_..., not a label (followed by = ! or ~
# inside braces) and not a function (followed by "(").
_NAME = re.compile(r"\bphalanx_[a-zA-Z0-9_]*[a-zA-Z0-9]\b(?!\s*[=!~(])")

# What each metric type is exposed as (prometheus_client's text format).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "unknown": ("",),
}


def exposed_names(text: str) -> set[str]:
    """Every series name a scrape of ``text`` can show: each family's names
    by its type (a labelled metric with no child yet has no samples but
    will), and the samples' own names."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


def dashboard_exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every query of the dashboard: panel targets
    (rows' nested panels too) and query variables."""
    def panels(items: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dashboard.get("panels", [])):
        for t in p.get("targets", []):
            yield f"panel {p.get('title')!r} {t.get('refId')}", t["expr"]
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]
            yield f"variable {v['name']}", q["query"] if isinstance(q, dict) else q


def rule_texts(rules: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, text) for each rule's expression and annotations (they name
    metrics for the reader to look at: those must exist too)."""
    for g in rules["groups"]:
        for r in g["rules"]:
            name = r.get("alert") or r.get("record")
            yield f"rule {name} expr", r["expr"]
            for k, v in r.get("annotations", {}).items():
                yield f"rule {name} {k}", v


def referenced(texts: Iterable[tuple[str, str]]) -> dict[str, set[str]]:
    """metric name -> where it is used."""
    out: dict[str, set[str]] = {}
    for where, text in texts:
        for name in _NAME.findall(text):
            out.setdefault(name, set()).add(where)
    return out


def family_names(text: str) -> set[str]:
    """The metrics' own names (a histogram's without _bucket, ...): what an
    annotation may name for a reader; a query must name a series."""
    return {f.name for f in text_string_to_metric_families(text)}


def missing(refs: dict[str, set[str]], text: str) -> list[str]:
    """The references in ``refs`` that the exposition ``text`` does not
    have: a query's must be a series name, an annotation's may also be a
    metric's own name."""
    series, families = exposed_names(text), family_names(text)
    out = []
    for name, where in refs.items():
        for w in sorted(where):
            if name not in series and not (name in families and " expr" not in w and not w.startswith(("panel", "variable"))):
                out.append(f"{name} (in {w})")
    return sorted(out)


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def load_rules() -> dict[str, Any]:
    return yaml.safe_load(ALERTS.read_text())


def all_references() -> dict[str, set[str]]:
    return referenced([*dashboard_exprs(load_dashboard()), *rule_texts(load_rules())])


# --- the names exist ---------------------------------------------------------------


def registries_text() -> str:
    from agent.metrics import AgentMetrics
    from coordinator.metrics import CoordinatorMetrics

    return (generate_latest(CoordinatorMetrics(az="az-a").registry) + generate_latest(AgentMetrics().registry)).decode()


def test_every_metric_the_dashboard_and_rules_name_is_registered() -> None:
    refs = all_references()
    assert len(refs) >= 20, sorted(refs)  # the extraction found the queries
    assert missing(refs, registries_text()) == []


@pytest.mark.parametrize("text, names", [
    ('sum by (az) (rate(phalanx_x_total{az=~"$az", phalanx_az="a"}[5m]))', {"phalanx_x_total"}),
    ("histogram_quantile(0.99, sum by (le) (rate(phalanx_h_seconds_bucket[1m]))) > phalanx_g", {"phalanx_h_seconds_bucket", "phalanx_g"}),
    ("label_values(phalanx_is_leader, az)", {"phalanx_is_leader"}),
    ("phalanx_y{phalanx_cluster!=\"\"} and on (instance) phalanx_z", {"phalanx_y", "phalanx_z"}),
])
def test_names_found_in_promql(text: str, names: set[str]) -> None:
    assert set(referenced([("t", text)])) == names


def test_an_annotation_may_name_a_metric_a_query_only_a_series() -> None:
    text = "# HELP phalanx_h_seconds h\n# TYPE phalanx_h_seconds histogram\n"
    assert missing({"phalanx_h_seconds": {"rule R description"}}, text) == []
    assert missing({"phalanx_h_seconds": {"rule R expr"}}, text) == ["phalanx_h_seconds (in rule R expr)"]
    assert missing({"phalanx_h_seconds": {"panel 'p' A"}}, text) == ["phalanx_h_seconds (in panel 'p' A)"]
    assert missing({"phalanx_nope_total": {"rule R summary"}}, text) == ["phalanx_nope_total (in rule R summary)"]


def test_exposed_names_include_what_a_labelled_metric_will_show() -> None:
    text = ("# HELP phalanx_a_total a\n# TYPE phalanx_a_total counter\n"
            "# HELP phalanx_h_seconds h\n# TYPE phalanx_h_seconds histogram\n")
    names = exposed_names(text)
    assert {"phalanx_a_total", "phalanx_h_seconds_bucket", "phalanx_h_seconds_count"} <= names
    assert "phalanx_h_seconds" not in names and "phalanx_a" not in names


# --- the files ---------------------------------------------------------------------


def _balanced(expr: str) -> bool:
    stack = []
    pairs = {")": "(", "]": "[", "}": "{"}
    quoted = False
    for ch in expr:
        if ch == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack and not quoted


def test_dashboard_is_well_formed() -> None:
    d = load_dashboard()
    assert d["uid"] and d["title"]
    ids = []
    for p in d["panels"]:
        ids.append(p["id"])
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"], f"panel {p['title']!r} has no query"
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "az"} <= names
    for where, expr in dashboard_exprs(d):
        assert _balanced(expr), f"{where}: unbalanced: {expr}"
        # $az is a multi-value variable: only a regex match takes it.
        assert '="$az"' not in expr and "!=\"$az\"" not in expr, f"{where}: use =~ with $az"


def test_alert_rules_are_complete_and_the_operator_copy_is_the_same() -> None:
    rules = load_rules()
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    assert set(alerts) == {"PhalanxAZWithoutLeader", "PhalanxFencedWritesRefused",
                           "PhalanxGangsPendingPastAdmissionTimeout", "PhalanxAgentsFencing",
                           "PhalanxEtcdNearlyFull", "PhalanxEtcdSpaceAlarm"}
    for name, r in alerts.items():
        assert _balanced(r["expr"]), name
        assert r["labels"]["severity"] in ("critical", "warning"), name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
    cr = yaml.safe_load(RULE_CR.read_text())
    assert (cr["apiVersion"], cr["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert cr["spec"] == rules, "k8s/prometheusrule.yaml differs from alerts.yaml"


def _base_cluster() -> str:
    docs = list(yaml.safe_load_all((REPO / "deploy" / "k8s" / "base" / "config.yaml").read_text()))
    (etcd,) = [d for d in docs if d and d["kind"] == "ConfigMap" and d["metadata"]["name"] == "phalanx-etcd"]
    return etcd["data"]["cluster"]


def test_scrape_configs_present_a_client_certificate_and_check_coordinators() -> None:
    cluster = _base_cluster()
    prom = yaml.safe_load(PROMETHEUS.read_text())
    assert prom["rule_files"] == ["alerts.yaml"] and (PROMETHEUS.parent / "alerts.yaml").is_file()
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    for job in jobs.values():
        assert job["scheme"] == "https" and job["tls_config"]["cert_file"] and job["tls_config"]["key_file"]
    coord = jobs["phalanx-coordinators"]["tls_config"]
    assert coord["server_name"] == coordinator_server_name(cluster) and coord["ca_file"]
    assert "insecure_skip_verify" not in coord
    monitors = {m["metadata"]["name"]: m for m in yaml.safe_load_all(MONITORS.read_text())}
    for m in monitors.values():
        (ep,) = m["spec"]["endpoints"]
        assert ep["scheme"] == "https" and ep["port"] == "metrics"
        assert ep["tlsConfig"]["cert"]["secret"]["name"] == ep["tlsConfig"]["keySecret"]["name"] == "phalanx-prometheus-tls"
    tls = monitors["phalanx-coordinators"]["spec"]["endpoints"][0]["tlsConfig"]
    assert tls["serverName"] == coordinator_server_name(cluster) and "insecureSkipVerify" not in tls


def test_kustomization_names_existing_files() -> None:
    k = yaml.safe_load((MON / "kustomization.yaml").read_text())
    for r in k["resources"]:
        assert (MON / r).is_file(), r
    (gen,) = k["configMapGenerator"]
    (entry,) = gen["files"]
    assert (MON / entry.split("=", 1)[1]) == DASHBOARD
    for path in k["resources"]:
        for doc in yaml.safe_load_all((MON / path).read_text()):
            assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"], path


def test_service_monitors_find_the_metrics_ports_of_the_manifests() -> None:
    base = REPO / "deploy" / "k8s" / "base"
    objects = {(d["kind"], d["metadata"]["name"]): d for f in ("coordinator.yaml", "agent.yaml")
               for d in yaml.safe_load_all((base / f).read_text()) if d}
    agent_service = yaml.safe_load((MON / "k8s" / "agent-metrics-service.yaml").read_text())
    services = {"coordinator": objects[("Service", "phalanx-coordinator")], "agent": agent_service}
    pods = {"coordinator": objects[("StatefulSet", "phalanx-coordinator")]["spec"]["template"],
            "agent": objects[("DaemonSet", "phalanx-agent")]["spec"]["template"]}
    monitors = {m["metadata"]["name"]: m for m in yaml.safe_load_all(MONITORS.read_text())}
    for component, monitor in (("coordinator", "phalanx-coordinators"), ("agent", "phalanx-agents")):
        service, pod = services[component], pods[component]
        assert monitors[monitor]["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == "metrics"]
        (container,) = [c for c in pod["spec"]["containers"] if c["name"] == component]
        named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        assert port["targetPort"] == "metrics" and "metrics" in named, component
        # The container listens where its port says (--metrics-listen HOST:PORT).
        (listen,) = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--metrics-listen=")]
        assert listen.rsplit(":", 1)[1] == str(named["metrics"]), component
    # The coordinator ServiceMonitor must not also pick up the agents' Service.
    assert not monitors["phalanx-coordinators"]["spec"]["selector"]["matchLabels"].items() <= agent_service["metadata"]["labels"].items()
