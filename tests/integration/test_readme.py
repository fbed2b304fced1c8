"""The README's command sequence runs as written, in its order, against a
cluster started by ``phalanx up`` (simulated agents, TLS and etcd auth on, as
in the README).

Each line of the README's "Submitting a gang" shell block is run by bash, with
``PHALANX_CONFIG`` set as ``phalanx up`` printed it and nothing else (no
address, TLS dir or plaintext switch in the environment); every line must
exit 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from phalanx.etcd_server import EtcdServer
from phalanx.up import UpProcess
from tests.conftest import etcdctl
from tests.pki import EtcdPki, unprovision

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    m = re.search(r"```sh\n(export PHALANX_CONFIG=.*?)```", text, re.S)
    assert m, "README has no shell block starting with export PHALANX_CONFIG="
    lines = [ln for ln in m.group(1).splitlines() if ln.strip()]
    assert lines[0].startswith("export PHALANX_CONFIG=")
    return lines[1:]


def test_readme_commands_run_in_order(etcd_server: EtcdServer, etcd_pki: EtcdPki, tmp_path: Path) -> None:
    commands = readme_commands()
    assert any(c.startswith("phalanx submit examples/llama-pretrain.yaml") for c in commands)
    cluster = "readme" + uuid.uuid4().hex[:8]
    up = UpProcess([
        "--no-workload", "--etcd", etcd_server.endpoint, "--etcd-pki", str(etcd_pki.dir), "--cluster", cluster,
        "--azs", "1", "--coordinators-per-az", "1", "--nodes-per-az", "4", "--spines", "1",
        "--base-port", "0", "--state-dir", str(tmp_path / "up"),
    ])
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(REPO / "examples")
    # HOME too: no ~/.config/phalanx/config.yaml of the machine's may answer instead.
    base = dict(os.environ, HOME=str(tmp_path), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    try:
        up.start()
        env = up.client_env(base)
        assert up.config is not None and env["PHALANX_CONFIG"] == str(up.config)
        assert not {"PHALANX_ADDRESS", "PHALANX_TLS_DIR", "PHALANX_INSECURE"} & set(env)
        # The nodes must be ready before the first submit can be placed; the
        # README's `wait --for RUNNING --timeout 120` covers that.
        outputs = []
        for command in commands:
            done = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                                  timeout=240)
            outputs.append(f"$ {command}\n{done.stdout}{done.stderr}")
            assert done.returncode == 0, "\n".join(outputs)
        print("\n".join(outputs))
        watched = next(o for o in outputs if o.startswith("$ phalanx watch llama-pretrain"))
        assert "SUCCEEDED" in watched.splitlines()[-1], watched
        saved = (work / "llama.yaml").read_text()
        assert "state: RUNNING" in saved and "spec:" in saved, saved
        cancelled = next(o for o in outputs if "phalanx cancel tiny" in o)
        assert "CANCELLED" in cancelled or "CANCELLING" in cancelled, cancelled
        # Over TLS, as the admin certificate up issued: the gang records it.
        gang = subprocess.run(["bash", "-c", "phalanx get llama-pretrain"], cwd=work, env=env, capture_output=True,
                              text=True, timeout=60)
        assert "submitted by: admin/" in gang.stdout, gang.stdout
        # The same commands without the config: refused, not silently plaintext.
        bare = subprocess.run(["bash", "-c", f"phalanx --address {up.address} status"], cwd=work, env=base,
                              capture_output=True, text=True, timeout=60)
        assert bare.returncode != 0 and "--insecure" in bare.stderr, bare.stderr
    finally:
        code = up.stop()
        prefix = f"/phalanx/{cluster}/"
        etcdctl(etcd_server.endpoint, "del", "--prefix", prefix)
        unprovision(etcd_server.endpoint, etcd_pki, cluster)
    assert code == 0, "\n".join(up.lines[-40:])
