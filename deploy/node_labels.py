"""Write a Kubernetes node's labels to a JSON file (the agent's --labels-file).

The downward API gives a pod its own labels, never its node's, so the agent
pod runs this as an init container: one ``GET /api/v1/nodes/<node>`` with the
pod's ServiceAccount token (RBAC: ``get`` on ``nodes``), then the node's
``metadata.labels`` as a JSON object, written atomically. No dependency beyond
the standard library (deploy/README.md says why not the ``kubernetes``
client); exit code 1 (with the reason on stderr) makes the
kubelet retry the init container with back-off.

    python /opt/phalanx/node_labels.py --node "$NODE_NAME" --out /etc/phalanx/node/labels.json

Labels are read once, at pod start: a relabelled node (e.g. by topograph) is
seen after the agent pod restarts.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Mapping

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def default_api_server() -> str:
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"https://{host}:{port}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="node_labels.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--node", required=True, help="the node's name (downward API spec.nodeName)")
    p.add_argument("--out", required=True, help="where to write the labels (JSON object)")
    p.add_argument("--api-server", default="", help="default: https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT")
    p.add_argument("--token-file", default=f"{SA_DIR}/token")
    p.add_argument("--ca-file", default=f"{SA_DIR}/ca.crt")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds for the API request")
    return p


def labels_from_node(node: Mapping[str, Any]) -> dict[str, str]:
    """The ``metadata.labels`` of a Node object (``{}`` when it has none)."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    if not isinstance(labels, dict):
        raise ValueError(f"node metadata.labels is not an object: {labels!r}")
    return {str(k): str(v) for k, v in labels.items()}


def fetch_node(api_server: str, node: str, token: str, ca_file: str, timeout: float) -> dict[str, Any]:
    url = f"{api_server.rstrip('/')}/api/v1/nodes/{urllib.parse.quote(node, safe='')}"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
    context = ssl.create_default_context(cafile=ca_file) if url.startswith("https:") else None
    with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
        return json.load(response)


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        token = Path(a.token_file).read_text().strip()
        node = fetch_node(a.api_server or default_api_server(), a.node, token, a.ca_file, a.timeout)
        labels = labels_from_node(node)
    except urllib.error.HTTPError as exc:
        hint = " (does the ServiceAccount have RBAC `get` on `nodes`?)" if exc.code in (401, 403) else ""
        print(f"error: GET node {a.node!r}: HTTP {exc.code} {exc.reason}{hint}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"error: reading node {a.node!r}: {exc}", file=sys.stderr)
        return 1
    write_atomically(Path(a.out), json.dumps(labels, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(labels)} labels of node {a.node} to {a.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
