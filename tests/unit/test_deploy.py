"""deploy/: the Kubernetes manifests, the image and the local cluster config
agree with the code they start — without a cluster, kubectl or kustomize.

Every container's arguments go through the real parsers (``kubelet``'s
``$(VAR)`` expansion is done here from the container's env, the downward API
and the ConfigMaps), the timings ConfigMap through ``timings_from_mapping``,
and each overlay's strategic-merge patches are applied with the few merge
keys they use (containers and env by name), which is checked too.

Credentials: real certificates (``phalanx.certs``, ``phalanx.etcd_pki``) are
packed into Secrets by ``deploy/secrets.py``, "mounted" into a directory per
pod as the kubelet would (Secret keys, ``items``, emptyDirs shared by the
pod's containers), the agent pod's init step copies its node's files for
real, and every ``--tls-dir`` / ``--etcd-tls-dir`` is then checked by the
processes' own start-up checks.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import logging
import re
import shlex
import ssl
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

import agent.__main__ as agent_main
from phalanx import certs as phalanx_certs
from phalanx import etcd_pki
from phalanx import tls as phalanx_tls
import coordinator.__main__ as coordinator_main
from coordinator.config import CoordinatorConfig
from phalanx.timings import Timings, timings_from_mapping
from phalanx.store import parse_endpoints

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
BASE = K8S / "base"
OVERLAYS = sorted(p for p in (K8S / "overlays").iterdir() if p.is_dir())
GRPC_PORT = 7070
METRICS_PORTS = {"coordinator": 9090, "agent": 9101}  # --metrics-listen, scraped by deploy/monitoring
PLACEHOLDER = "SET-BY-OVERLAY"

# What the API server / kubelet would fill in through the downward API.
FIELD_VALUES = {
    "metadata.name": "phalanx-coordinator-az-a-0",
    "metadata.namespace": "phalanx",
    "status.podIP": "10.42.3.17",
    "spec.nodeName": "gpu-017",
}
IMAGE_ENTRYPOINT = ["python", "-m"]  # deploy/Dockerfile


def load_docs(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def yaml_files() -> list[Path]:
    return sorted(K8S.rglob("*.yaml")) + sorted(K8S.rglob("*.yml"))


def base_objects() -> dict[tuple[str, str], dict[str, Any]]:
    kust = load_docs(BASE / "kustomization.yaml")[0]
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for rel in kust["resources"]:
        for doc in load_docs(BASE / rel):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in objects, f"duplicate {key} in base"
            objects[key] = doc
    return objects


def configmaps(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {name: doc.get("data", {}) for (kind, name), doc in objects.items() if kind == "ConfigMap"}


# --- strategic merge, restricted to what the overlays use ----------------------------

# Lists merged by a key (as the API's patchMergeKey says); any other list is
# replaced whole, like nodeSelectorTerms (atomic in the API).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name", "volumeMounts": "mountPath"}


def strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        mk = MERGE_KEYS[key]
        out = [copy.deepcopy(x) for x in base]
        for item in patch:
            for i, existing in enumerate(out):
                if existing[mk] == item[mk]:
                    out[i] = strategic_merge(existing, item)
                    break
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def overlay_objects(overlay: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """The base with this overlay's patches applied (names keep the base's)."""
    objects = copy.deepcopy(base_objects())
    kust = load_docs(overlay / "kustomization.yaml")[0]
    for entry in kust["patches"]:
        (patch,) = load_docs(overlay / entry["path"])
        key = (patch["kind"], patch["metadata"]["name"])
        assert key in objects, f"{overlay.name}/{entry['path']} patches {key}, which is not in the base"
        objects[key] = strategic_merge(objects[key], patch)
    return objects


# --- what kubelet does with a container ----------------------------------------------

def container_env(container: dict[str, Any], cms: dict[str, dict[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
            continue
        src = e["valueFrom"]
        if "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            assert path in FIELD_VALUES, f"{container['name']}: env {e['name']} uses unexpected fieldRef {path}"
            env[e["name"]] = FIELD_VALUES[path]
        elif "configMapKeyRef" in src:
            ref = src["configMapKeyRef"]
            assert ref["name"] in cms, f"{container['name']}: env {e['name']} names missing ConfigMap {ref['name']}"
            assert ref["key"] in cms[ref["name"]], f"ConfigMap {ref['name']} has no key {ref['key']}"
            env[e["name"]] = cms[ref["name"]][ref["key"]]
        else:
            raise AssertionError(f"{container['name']}: env {e['name']}: unsupported valueFrom {src}")
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """kubelet's $(VAR) expansion; an undefined $(VAR) would reach the process
    verbatim, which is always a mistake here."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        assert name in env, f"$({name}) is not defined in the container's env"
        return env[name]

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)


def argv(container: dict[str, Any], cms: dict[str, dict[str, str]]) -> list[str]:
    env = container_env(container, cms)
    command = container.get("command", IMAGE_ENTRYPOINT)
    return [expand(str(x), env) for x in [*command, *container.get("args", [])]]


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def only(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (item,) = [x for x in items if x["name"] == name]
    return item


def zone_values(spec: dict[str, Any]) -> list[str]:
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == 1, "one zone term (terms are ORed: more would let pods leave the AZ)"
    (expr,) = [e for e in terms[0]["matchExpressions"] if e["key"] == "topology.kubernetes.io/zone"]
    assert expr["operator"] == "In"
    return expr["values"]


@pytest.fixture
def keep_logging() -> Iterator[None]:
    """coordinator.__main__.parse_args configures logging: undo it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in root.handlers[:]:
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


def load_node_labels_script():
    spec = importlib.util.spec_from_file_location("phalanx_deploy_node_labels", DEPLOY / "node_labels.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def contexts() -> list[tuple[str, dict[tuple[str, str], dict[str, Any]]]]:
    return [("base", base_objects())] + [(o.name, overlay_objects(o)) for o in OVERLAYS]


CONTEXT_IDS = ["base"] + [o.name for o in OVERLAYS]


# --- the files --------------------------------------------------------------------------

@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_parses(path: Path) -> None:
    docs = load_docs(path)
    assert docs, f"{path} holds no document"
    for doc in docs:
        assert isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"), f"{path}: not a Kubernetes object"
        if doc["kind"] != "Kustomization":
            assert doc["metadata"]["name"], f"{path}: object without a name"


@pytest.mark.parametrize("kdir", [BASE, *OVERLAYS], ids=lambda p: str(p.relative_to(K8S)))
def test_kustomizations_name_existing_files(kdir: Path) -> None:
    (kust,) = load_docs(kdir / "kustomization.yaml")
    for rel in kust.get("resources", []):
        assert (kdir / rel).exists(), f"{kdir.name}: resource {rel} does not exist"
    for entry in kust.get("patches", []):
        assert (kdir / entry["path"]).is_file(), f"{kdir.name}: patch {entry['path']} does not exist"


def test_base_is_in_the_phalanx_namespace_and_uses_one_image() -> None:
    (kust,) = load_docs(BASE / "kustomization.yaml")
    assert kust["namespace"] == "phalanx"
    (ns,) = load_docs(K8S / "namespace.yaml")
    assert (ns["kind"], ns["metadata"]["name"]) == ("Namespace", "phalanx")
    image_names = {i["name"] for i in kust.get("images", [])}
    for (kind, name), obj in base_objects().items():
        if kind in ("StatefulSet", "DaemonSet", "Job"):
            spec = pod_spec(obj)
            for c in spec.get("initContainers", []) + spec["containers"]:
                assert c["image"] in image_names, f"{name}/{c['name']}: image {c['image']} is not set by kustomization images"


def test_overlays_only_use_merges_this_test_understands() -> None:
    """The overlays' patches touch the AZ only: env (merged by name) and the
    zone term (replaced whole). Anything more needs kustomize to check."""
    for overlay in OVERLAYS:
        (kust,) = load_docs(overlay / "kustomization.yaml")
        assert kust["resources"] == ["../../base"]
        assert set(kust) <= {"apiVersion", "kind", "resources", "nameSuffix", "labels", "patches", "images"}
        for entry in kust["patches"]:
            assert set(entry) == {"path"}, "patches with targets/ops are not modelled here"
            (patch,) = load_docs(overlay / entry["path"])
            spec = patch["spec"]["template"]["spec"]
            assert set(spec) <= {"affinity", "containers"}
            assert set(spec["affinity"]) == {"nodeAffinity"}
            for c in spec["containers"]:
                assert set(c) == {"name", "env"}


# --- configuration ---------------------------------------------------------------------------

def test_timings_configmap_is_valid() -> None:
    data = configmaps(base_objects())["phalanx-timings"]
    timings = timings_from_mapping(json.loads(data["timings.json"]))
    assert isinstance(timings, Timings)


def test_etcd_configmap_is_usable_by_the_store() -> None:
    data = configmaps(base_objects())["phalanx-etcd"]
    assert re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", data["cluster"]), "cluster must be a DNS label"
    endpoints = parse_endpoints(data["endpoints"])  # the Store's own parser: raises on a bad entry
    assert len(endpoints) >= 3, "the example spreads etcd members over the three AZs"


# --- coordinator ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,objects", contexts(), ids=CONTEXT_IDS)
def test_coordinator_args_parse(
    name: str, objects: dict, keep_logging: None, secrets: dict[str, dict[str, bytes]], tmp_path: Path
) -> None:
    cms = configmaps(objects)
    deploy = objects[("StatefulSet", "phalanx-coordinator")]
    spec = pod_spec(deploy)
    container = only(spec["containers"], "coordinator")
    full = argv(container, cms)
    assert full[:3] == ["python", "-m", "coordinator"]
    pod = Pod(tmp_path, spec, secrets)
    # The etcd files are checked by the parser, the gRPC ones as the server
    # loads them at start-up (its own certificate, named by its --id).
    config, tls, _, etcd_tls = coordinator_main.parse_everything(pod.remap(full[3:], container))
    assert isinstance(config, CoordinatorConfig)
    assert tls is not None and etcd_tls is not None
    loaded = phalanx_tls.load(tls, cluster=config.cluster, use="server", now=datetime.datetime.now(datetime.timezone.utc))
    assert loaded.identity.role == "coordinator" and loaded.identity.name == config.coordinator_id
    env = container_env(container, cms)
    assert config.az == env["PHALANX_AZ"]
    assert config.coordinator_id == FIELD_VALUES["metadata.name"]
    assert config.cluster == cms["phalanx-etcd"]["cluster"]
    assert ",".join(config.etcd) == cms["phalanx-etcd"]["endpoints"]
    assert config.timings == timings_from_mapping(json.loads(cms["phalanx-timings"]["timings.json"]))
    # Listens on the served port; publishes the pod IP (downward API) in etcd.
    assert config.listen.rsplit(":", 1)[1] == str(GRPC_PORT)
    assert config.advertise == f"{FIELD_VALUES['status.podIP']}:{GRPC_PORT}"
    # /metrics on the port the container and the Service name "metrics".
    assert config.metrics_listen == f"0.0.0.0:{METRICS_PORTS['coordinator']}"
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]


def test_coordinator_probes_and_service_use_the_served_port() -> None:
    objects = base_objects()
    deploy = objects[("StatefulSet", "phalanx-coordinator")]
    container = only(pod_spec(deploy)["containers"], "coordinator")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": GRPC_PORT, "metrics": METRICS_PORTS["coordinator"]}
    for probe in ("readinessProbe", "livenessProbe"):
        # A TCP probe: the kubelet's gRPC probe dials plaintext without a
        # client certificate, which the TLS-only server refuses.
        assert set(container[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"tcpSocket"}, probe
        assert container[probe]["tcpSocket"]["port"] in (GRPC_PORT, "grpc"), probe
    service = objects[("Service", "phalanx-coordinator")]
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert set(by_name) == {"grpc", "metrics"}
    port = by_name["grpc"]
    assert port["port"] == GRPC_PORT and port["targetPort"] in ("grpc", GRPC_PORT)
    assert by_name["metrics"]["targetPort"] == "metrics"
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    pdb = objects[("PodDisruptionBudget", "phalanx-coordinator")]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # A StatefulSet's pods are named <name>-<ordinal>: the --id and the
    # certificate name are known before the pod exists.
    assert deploy["spec"]["serviceName"] == service["metadata"]["name"]


def test_coordinator_replicas_spread_over_nodes() -> None:
    deploy = base_objects()[("StatefulSet", "phalanx-coordinator")]
    assert deploy["spec"]["replicas"] == 2
    spec = pod_spec(deploy)
    (term,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    assert spec["serviceAccountName"] == "phalanx-coordinator"


# --- agent ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,objects", contexts(), ids=CONTEXT_IDS)
def test_agent_args_parse(name: str, objects: dict, secrets: dict[str, dict[str, bytes]], tmp_path: Path) -> None:
    cms = configmaps(objects)
    ds = objects[("DaemonSet", "phalanx-agent")]
    spec = pod_spec(ds)
    container = only(spec["containers"], "agent")
    full = argv(container, cms)
    assert full[:3] == ["python", "-m", "agent"]
    a = agent_main.build_parser().parse_args(full[3:])
    # Credentials: the init step copies this node's files, then the agent's
    # own start-up checks pass on what it finds.
    pod = Pod(tmp_path, spec, secrets)
    pod.run_init(only(spec["initContainers"], "agent-tls"), cms)
    creds = agent_main.build_parser().parse_args(pod.remap(full[3:], container))
    assert agent_main.required_flags_error(creds) is None
    files = agent_main.tls_files(creds)
    assert files is not None and sorted(p.name for p in Path(creds.tls_dir).iterdir()) == sorted(
        p.name for p in files.paths()
    ), "the agent container holds its own node's certificate and nothing else"
    # No etcd endpoint and no etcd credential: it reads through its AZ's
    # coordinator Service (the overlay's suffixed name, the Service's port).
    assert not a.etcd and not a.etcd_tls_dir and agent_main.etcd_tls_files(creds) is None
    assert not any("etcd" in str(m["mountPath"]) for m in container.get("volumeMounts", [])), container
    env = container_env(container, cms)
    assert a.az == env["PHALANX_AZ"]
    assert a.coordinators == env["PHALANX_COORDINATORS"]
    if name != "base":
        kust = load_docs(K8S / "overlays" / name / "kustomization.yaml")[0]
        service = objects[("Service", "phalanx-coordinator")]
        port = only(service["spec"]["ports"], "grpc")["port"]
        assert a.coordinators == f"phalanx-coordinator{kust['nameSuffix']}:{port}"
    assert a.node == FIELD_VALUES["spec.nodeName"]
    assert a.cluster == cms["phalanx-etcd"]["cluster"]
    timings_from_mapping(json.loads(a.timings))
    assert not a.simulate_members and not a.nvml_recording and not a.sysfs_recording
    # /metrics on the node's address (host network: the pod IP), the
    # container port the headless metrics Service of deploy/monitoring names.
    assert a.metrics_listen == f"{FIELD_VALUES['status.podIP']}:{METRICS_PORTS['agent']}"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": METRICS_PORTS["agent"]}

    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}

    def volume_at(path: str) -> tuple[dict, dict]:
        for mount_path, m in mounts.items():
            if path == mount_path or path.startswith(mount_path.rstrip("/") + "/"):
                return m, volumes[m["name"]]
        raise AssertionError(f"{path} is on no volume of the agent container")

    # sysfs: the host's /sys, read-only.
    m, v = volume_at(a.sysfs_root)
    assert v["hostPath"]["path"] == "/sys" and m.get("readOnly") is True and a.sysfs_root == m["mountPath"]
    # State (members.json, member logs) survives the container.
    _, v = volume_at(a.state_dir)
    assert "hostPath" in v
    # Labels: written by the init container into the volume the agent reads.
    init = only(spec["initContainers"], "node-labels")
    labels_mount, v = volume_at(a.labels_file)
    assert "emptyDir" in v
    init_mount = {m["name"]: m for m in init["volumeMounts"]}[labels_mount["name"]]
    assert init_mount["mountPath"] == labels_mount["mountPath"] and not init_mount.get("readOnly")
    init_argv = argv(init, cms)
    assert init_argv[:2] == ["python", "/opt/phalanx/node_labels.py"]
    init_args = load_node_labels_script().build_parser().parse_args(init_argv[2:])
    assert init_args.node == FIELD_VALUES["spec.nodeName"]
    assert init_args.out == a.labels_file


def test_agent_pod_runs_on_gpu_nodes_with_the_nvidia_runtime() -> None:
    objects = base_objects()
    ds = objects[("DaemonSet", "phalanx-agent")]
    spec = pod_spec(ds)
    assert spec["runtimeClassName"] == "nvidia"
    assert not spec.get("hostPID"), "the agent needs no host PID namespace"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    if spec.get("hostNetwork"):
        assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    env = {e["name"]: e.get("value") for e in only(spec["containers"], "agent")["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    # Agent shutdown stops members (SIGTERM, then SIGKILL after stop_grace_s).
    timings = timings_from_mapping(json.loads(configmaps(objects)["phalanx-timings"]["timings.json"]))
    assert spec["terminationGracePeriodSeconds"] > timings.stop_grace_s + 5
    assert ds["spec"]["updateStrategy"]["type"] == "OnDelete"
    assert "limits" not in only(spec["containers"], "agent").get("resources", {}), "members share the agent's cgroup"


def test_agent_api_access_is_get_nodes_for_the_init_container_only() -> None:
    objects = base_objects()
    spec = pod_spec(objects[("DaemonSet", "phalanx-agent")])
    sa = spec["serviceAccountName"]
    assert ("ServiceAccount", sa) in objects
    (binding,) = [o for (k, _), o in objects.items() if k == "ClusterRoleBinding"]
    assert {"kind": "ServiceAccount", "name": sa, "namespace": "phalanx"} in binding["subjects"]
    role = objects[("ClusterRole", binding["roleRef"]["name"])]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    # No automounted token: members (users' code) run in the agent container.
    assert spec["automountServiceAccountToken"] is False
    token_volumes = {v["name"] for v in spec["volumes"]
                     if any("serviceAccountToken" in s for s in v.get("projected", {}).get("sources", []))}
    assert token_volumes
    for c in spec["containers"]:
        assert not {m["name"] for m in c.get("volumeMounts", [])} & token_volumes, f"{c['name']} sees the API token"
    init = only(spec["initContainers"], "node-labels")
    (mount,) = [m for m in init["volumeMounts"] if m["name"] in token_volumes]
    script = load_node_labels_script()
    assert mount["mountPath"] == script.SA_DIR


# --- credentials: Secrets, mounts, the init step, the etcd-auth Job -------------------------------



def load_secrets_script():
    spec = importlib.util.spec_from_file_location("phalanx_deploy_secrets", DEPLOY / "secrets.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cluster_of_config() -> str:
    return configmaps(base_objects())["phalanx-etcd"]["cluster"]


def coordinator_pod_names() -> list[str]:
    """What each overlay's StatefulSet names its pods: <name><suffix>-<ordinal>."""
    sts = base_objects()[("StatefulSet", "phalanx-coordinator")]
    names = []
    for overlay in OVERLAYS:
        (kust,) = load_docs(overlay / "kustomization.yaml")
        names += [f"{sts['metadata']['name']}{kust['nameSuffix']}-{i}" for i in range(sts["spec"]["replicas"])]
    return names


def make_pki(root: Path) -> tuple[Path, Path]:
    """The files an operator makes with ``phalanx certs`` (deploy/README.md)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    cluster = cluster_of_config()
    pki, etcd = root / "pki", root / "etcd-pki"
    phalanx_certs.init_ca(pki, cluster, now=now)
    for pod in coordinator_pod_names():
        phalanx_certs.issue(pki, "coordinator", pod, now=now)
    for node in (FIELD_VALUES["spec.nodeName"], "gpu-018"):
        phalanx_certs.issue(pki, "agent", node, node=node, now=now)
    etcd_pki.init(etcd, now=now)
    for user in (etcd_pki.ROOT_USER, etcd_pki.user_for(cluster, "coordinator")):
        etcd_pki.issue_client(etcd, user, now=now)
    return pki, etcd


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    """Secret name -> files, as deploy/secrets.py writes them for kubectl apply."""
    import base64

    root = tmp_path_factory.mktemp("deploy-pki")
    pki, etcd = make_pki(root)
    out = root / "secrets.yaml"
    rc = load_secrets_script().main(["--pki", str(pki), "--etcd-pki", str(etcd), "--cluster", cluster_of_config(),
                                     "--out", str(out)])
    assert rc == 0
    assert out.stat().st_mode & 0o077 == 0, "the file holds private keys"
    got = {}
    for doc in load_docs(out):
        assert doc["kind"] == "Secret" and doc["metadata"]["namespace"] == "phalanx"
        got[doc["metadata"]["name"]] = {k: base64.b64decode(v) for k, v in doc["data"].items()}
    return got


class Pod:
    """A pod's volumes as files under ``root``, as the kubelet mounts them:
    a Secret volume holds its keys (only ``items``, under their paths, when
    given; a missing key fails the pod), an emptyDir is one directory that
    every container of the pod mounting it shares."""

    def __init__(self, root: Path, spec: dict[str, Any], secrets: dict[str, dict[str, bytes]]) -> None:
        self.root = root
        self.volumes: dict[str, Path] = {}
        for v in spec["volumes"]:
            d = root / "volumes" / v["name"]
            if "secret" in v:
                name = v["secret"]["secretName"]
                assert name in secrets, f"volume {v['name']}: Secret {name} is not one deploy/secrets.py makes"
                data = secrets[name]
                items = v["secret"].get("items") or [{"key": k, "path": k} for k in data]
                d.mkdir(parents=True)
                for item in items:
                    assert item["key"] in data, f"volume {v['name']}: Secret {name} has no key {item['key']}"
                    (d / item["path"]).write_bytes(data[item["key"]])
                    (d / item["path"]).chmod(v["secret"].get("defaultMode", 0o644))
                self.volumes[v["name"]] = d
            elif "emptyDir" in v:
                d.mkdir(parents=True)
                self.volumes[v["name"]] = d

    def path(self, container: dict[str, Any], path: str) -> Path:
        """Where ``path`` in ``container`` lands: a file of one of its mounts."""
        for m in container.get("volumeMounts", []):
            mp = m["mountPath"].rstrip("/")
            if (path == mp or path.startswith(mp + "/")) and m["name"] in self.volumes:
                return self.volumes[m["name"]] / path[len(mp):].lstrip("/")
        raise AssertionError(f"{container['name']}: {path} is on no Secret or emptyDir volume it mounts")

    def remap(self, args: list[str], container: dict[str, Any]) -> list[str]:
        """``--tls-dir`` / ``--etcd-tls-dir`` pointed at where their mounts landed."""
        out = []
        for arg in args:
            flag, eq, value = arg.partition("=")
            if eq and flag in ("--tls-dir", "--etcd-tls-dir"):
                arg = f"{flag}={self.path(container, value)}"
            out.append(arg)
        return out

    def run_init(self, init: dict[str, Any], cms: dict[str, dict[str, str]]) -> None:
        """Run an init container's shell script for real, its paths remapped."""
        import subprocess

        env = container_env(init, cms)
        for name in ("SRC", "DST"):
            env[name] = str(self.path(init, env[name]))
        command = [expand(str(x), env) for x in init["command"]]
        assert command[:2] == ["/bin/sh", "-c"]
        done = subprocess.run([*command, *init["args"]], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, done.stderr


def test_secrets_hold_no_ca_key_and_every_coordinator_pod_has_its_certificate(
    secrets: dict[str, dict[str, bytes]]
) -> None:
    mod = load_secrets_script()
    assert set(secrets) == {mod.COORDINATOR_TLS, mod.AGENT_TLS, mod.ETCD_COORDINATOR, mod.ETCD_ROOT}
    for name, data in secrets.items():
        assert not any(k.endswith("ca.key") for k in data), f"{name} holds a CA key"
        assert not any(b"PRIVATE KEY" in v for k, v in data.items() if k == "ca.crt")
    for pod in coordinator_pod_names():
        assert {f"coordinator-{pod}.crt", f"coordinator-{pod}.key"} <= set(secrets[mod.COORDINATOR_TLS]), pod
    # Each etcd Secret is the user it says.
    for secret, user in ((mod.ETCD_COORDINATOR, etcd_pki.user_for(cluster_of_config(), "coordinator")),
                         (mod.ETCD_ROOT, etcd_pki.ROOT_USER)):
        from cryptography import x509

        assert etcd_pki.user_of(x509.load_pem_x509_certificate(secrets[secret]["client.crt"])) == user


def test_secrets_script_names_a_missing_file_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pki, etcd = make_pki(tmp_path)
    user = etcd_pki.user_for(cluster_of_config(), "coordinator")
    (etcd / user / "client.key").unlink()
    out = tmp_path / "secrets.yaml"
    rc = load_secrets_script().main(["--pki", str(pki), "--etcd-pki", str(etcd), "--cluster", cluster_of_config(),
                                     "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert err.startswith("error: ") and str(etcd / user / "client.key") in err and "etcd-user" in err


def test_other_nodes_keys_reach_only_the_init_step_and_the_root_key_only_the_job() -> None:
    """Members run in the agent container: it must not see every node's key
    (they could register as another node), nor any container but the
    etcd-auth Job etcd's root key."""
    mod = load_secrets_script()
    objects = base_objects()

    def secrets_seen(spec: dict[str, Any], container: dict[str, Any]) -> set[str]:
        by_volume = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        return {by_volume[m["name"]] for m in container.get("volumeMounts", []) if m["name"] in by_volume}

    seen: dict[str, set[str]] = {}
    for (kind, name), obj in objects.items():
        if kind in ("StatefulSet", "DaemonSet", "Job"):
            spec = pod_spec(obj)
            for c in spec.get("initContainers", []) + spec["containers"]:
                seen[f"{name}/{c['name']}"] = secrets_seen(spec, c)
    assert seen["phalanx-agent/agent"] == set(), "the agent container mounts no Secret (no etcd user)"
    assert seen["phalanx-agent/agent-tls"] == {mod.AGENT_TLS}
    assert seen["phalanx-coordinator/coordinator"] == {mod.COORDINATOR_TLS, mod.ETCD_COORDINATOR}
    assert [k for k, v in seen.items() if mod.ETCD_ROOT in v] == ["phalanx-etcd-auth/etcd-auth"]
    assert [k for k, v in seen.items() if mod.AGENT_TLS in v] == ["phalanx-agent/agent-tls"]
    # The copy lives in memory, never on the node's disk.
    spec = pod_spec(objects[("DaemonSet", "phalanx-agent")])
    assert only(spec["volumes"], "agent-tls")["emptyDir"]["medium"] == "Memory"


def test_agent_init_step_refuses_a_node_without_a_certificate(
    secrets: dict[str, dict[str, bytes]], tmp_path: Path
) -> None:
    import subprocess

    objects = base_objects()
    cms = configmaps(objects)
    spec = pod_spec(objects[("DaemonSet", "phalanx-agent")])
    init = only(spec["initContainers"], "agent-tls")
    pod = Pod(tmp_path, spec, secrets)
    env = {**container_env(init, cms), "NODE_NAME": "gpu-999"}
    env["SRC"], env["DST"] = str(pod.path(init, env["SRC"])), str(pod.path(init, env["DST"]))
    done = subprocess.run([*init["command"], *init["args"]], env={"PATH": "/usr/bin:/bin", **env},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "agent-gpu-999.crt" in done.stderr, done.stderr


@pytest.mark.parametrize("name,objects", contexts(), ids=CONTEXT_IDS)
def test_etcd_auth_job_runs_phalanx_etcd_auth_as_root(
    name: str, objects: dict, secrets: dict[str, dict[str, bytes]], tmp_path: Path
) -> None:
    import phalanx.cli as cli

    cms = configmaps(objects)
    job = objects[("Job", "phalanx-etcd-auth")]
    spec = pod_spec(job)
    assert spec["restartPolicy"] == "OnFailure" and spec["automountServiceAccountToken"] is False
    container = only(spec["containers"], "etcd-auth")
    full = argv(container, cms)
    assert full[:4] == ["python", "-m", "phalanx", "etcd-auth"]
    pod = Pod(tmp_path, spec, secrets)
    a = cli.build_parser().parse_args(pod.remap(full[3:], container))
    assert a.cluster == cms["phalanx-etcd"]["cluster"] and a.etcd == cms["phalanx-etcd"]["endpoints"]
    assert not a.remove
    now = datetime.datetime.now(datetime.timezone.utc)
    assert etcd_pki.check_client(etcd_pki.files(a.etcd_tls_dir), now=now)[3] == etcd_pki.ROOT_USER


# --- overlays -------------------------------------------------------------------------------------

def test_each_overlay_names_a_distinct_az() -> None:
    assert [o.name for o in OVERLAYS] == ["az-a", "az-b", "az-c"]
    azs, zones, suffixes = set(), set(), set()
    for overlay in OVERLAYS:
        (kust,) = load_docs(overlay / "kustomization.yaml")
        assert kust["nameSuffix"] == f"-{overlay.name}"
        # The AZ label goes into the selectors too: one AZ's Service, PDB and
        # anti-affinity must not select another AZ's pods.
        (label,) = kust["labels"]
        assert label["includeSelectors"] is True and label["pairs"] == {"phalanx.dev/az": overlay.name}
        objects = overlay_objects(overlay)
        seen_az, seen_zone = set(), set()
        for key, container in (
            (("StatefulSet", "phalanx-coordinator"), "coordinator"),
            (("DaemonSet", "phalanx-agent"), "agent"),
        ):
            spec = pod_spec(objects[key])
            env = {e["name"]: e.get("value") for e in only(spec["containers"], container)["env"]}
            seen_az.add(env["PHALANX_AZ"])
            seen_zone.update(zone_values(spec))
        # Coordinators and agents of one overlay: the same AZ and zone.
        assert len(seen_az) == 1 and len(seen_zone) == 1, (overlay.name, seen_az, seen_zone)
        assert PLACEHOLDER not in seen_az | seen_zone
        azs |= seen_az
        zones |= seen_zone
        suffixes.add(kust["nameSuffix"])
    assert len(azs) == len(zones) == len(suffixes) == len(OVERLAYS)


def test_base_alone_schedules_nowhere() -> None:
    """The base's AZ is a placeholder no node's zone matches."""
    objects = base_objects()
    for key in (("StatefulSet", "phalanx-coordinator"), ("DaemonSet", "phalanx-agent")):
        assert zone_values(pod_spec(objects[key])) == [PLACEHOLDER]


# --- the node-labels init step --------------------------------------------------------------------

TLS = ROOT / "tests" / "fixtures" / "tls"  # a test CA and a server certificate for 127.0.0.1 (README there)
NODE = {"metadata": {"name": "gpu-017", "labels": {
    "topology.kubernetes.io/zone": "us-east-1a", "network.topology.nvidia.com/leaf": "leaf-3"}}}


class NodesApi:
    """A local HTTPS server speaking the one call of the nodes API the script makes:
    ``GET /api/v1/nodes/<name>`` with a bearer token (403 for another token, 404 for another node)."""

    def __init__(self, nodes: dict[str, dict[str, Any]], token: str) -> None:
        self.seen: list[tuple[str, str]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                auth = self.headers.get("Authorization", "")
                api.seen.append((self.path, auth))
                name = self.path.removeprefix("/api/v1/nodes/")
                if auth != f"Bearer {token}":
                    code, body = 403, {"kind": "Status", "reason": "Forbidden"}
                elif self.path.startswith("/api/v1/nodes/") and name in nodes:
                    code, body = 200, nodes[name]
                else:
                    code, body = 404, {"kind": "Status", "reason": "NotFound"}
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(TLS / "server.crt", TLS / "server.key")
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "NodesApi":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def run_node_labels(api: NodesApi, tmp_path: Path, node: str, *, token: str = "secret-token",
                    ca: Path = TLS / "ca.crt") -> tuple[int, Path]:
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    out = tmp_path / "node" / f"{node}.json"
    rc = load_node_labels_script().main(["--node", node, "--out", str(out), "--api-server", api.url,
                                         "--token-file", str(token_file), "--ca-file", str(ca)])
    return rc, out


def test_node_labels_script_writes_what_the_agent_reads(tmp_path: Path) -> None:
    with NodesApi({"gpu-017": NODE}, "secret-token") as api:
        rc, out = run_node_labels(api, tmp_path, "gpu-017")
    assert rc == 0
    assert api.seen == [("/api/v1/nodes/gpu-017", "Bearer secret-token")]
    assert agent_main.parse_labels("", str(out)) == NODE["metadata"]["labels"]
    assert load_node_labels_script().labels_from_node({"metadata": {}}) == {}


def test_node_labels_script_fails_without_writing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A non-zero exit makes the kubelet retry the init container; no file is left for the agent."""
    with NodesApi({"gpu-017": NODE}, "secret-token") as api:
        rc, out = run_node_labels(api, tmp_path, "gpu-404")  # no such node
        assert rc == 1 and not out.exists()
        assert "error: GET node 'gpu-404': HTTP 404" in capsys.readouterr().err
        rc, out = run_node_labels(api, tmp_path, "gpu-017", token="stale")  # RBAC / token problem
        assert rc == 1 and not out.exists()
        assert "HTTP 403 Forbidden (does the ServiceAccount have RBAC `get` on `nodes`?)" in capsys.readouterr().err
        # A server whose certificate the CA file does not vouch for: refused, nothing sent.
        before = len(api.seen)
        rc, out = run_node_labels(api, tmp_path, "gpu-017", ca=TLS / "server.crt")
        assert rc == 1 and not out.exists()
        assert "CERTIFICATE_VERIFY_FAILED" in capsys.readouterr().err
        assert len(api.seen) == before


# --- image ---------------------------------------------------------------------------------------

def test_dockerfile_installs_every_package_and_runs_python_m() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    (entry,) = [ln for ln in lines if ln.startswith("ENTRYPOINT")]
    assert json.loads(entry.removeprefix("ENTRYPOINT").strip()) == IMAGE_ENTRYPOINT
    assert any(re.search(r"\bpip install \.", ln) for ln in lines)
    copied = {ln.split()[1] for ln in lines if ln.startswith("COPY")}
    for src in copied:
        assert (ROOT / src).exists(), f"COPY {src}: no such path in the repository"
    # Every top-level package pyproject.toml installs is in the build context.
    include = re.search(r'include = \[([^\]]*)\]', (ROOT / "pyproject.toml").read_text())
    assert include is not None
    for pattern in re.findall(r'"([^"]+)"', include.group(1)):
        assert pattern.rstrip("*") in copied, f"package {pattern} is not copied into the image"
    # The init container's script is where the manifest runs it from.
    assert "COPY deploy/node_labels.py /opt/phalanx/node_labels.py" in lines


# --- local cluster ----------------------------------------------------------------------------------

def read_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f"{path.name}: not KEY=VALUE: {line!r}"
        (env[key],) = shlex.split(value) or [""]
    return env


def test_local_env_file_is_accepted_by_phalanx_up() -> None:
    from phalanx.up.config import UpConfig
    from phalanx.up_args import add_arguments

    env = read_env_file(DEPLOY / "local" / "phalanx.env")
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = UpConfig.from_args(p.parse_args(shlex.split(env["PHALANX_UP_ARGS"])))
    assert len(cfg.azs) >= 1
    timings = env.get("PHALANX_TIMINGS", "")
    if timings and timings != "fast":
        timings_from_mapping(json.loads(timings))
    assert isinstance(logging.getLevelName(env.get("PHALANX_LOG_LEVEL", "INFO").upper()), int)
