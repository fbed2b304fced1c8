#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian machine: the etcd server (Debian package
# etcd-server, when no etcd binary is on PATH), network tools for the chaos
# suite, and a virtual environment in .venv with Phalanx installed editable.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

need_apt=()
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v iptables >/dev/null 2>&1 || need_apt+=(iptables)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing ${need_apt[*]}; run as root or install them" >&2
    exit 1
  fi
  echo "setup: installing ${need_apt[*]} (apt)" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
# The Debian package enables a system etcd service; Phalanx starts its own.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet etcd 2>/dev/null; then
  systemctl disable --now etcd >/dev/null 2>&1 || true
fi

py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
stamp=.venv/.phalanx-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v "is ignored" >&2 || true
  .venv/bin/python -c "import grpc, aetcd, yaml, pytest" # fail here, not later
  touch "$stamp"
fi
