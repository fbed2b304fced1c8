#!/usr/bin/env bash
# Idempotent set-up on a fresh Debian machine: every program the code and the
# tests start (the table below), then a virtual environment in .venv with
# Phalanx installed editable. Run it again at any time: it installs only what
# is missing and reinstalls Phalanx only when pyproject.toml changed.
#
#   scripts/setup.sh                  programs + .venv
#   scripts/setup.sh --programs-only  programs only (e.g. for a CI image)
#
# Installing needs root (apt-get); without root it says what is missing and
# exits 1, and with everything present it needs no root at all.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

programs_only=0
case "${1:-}" in
  "") ;;
  --programs-only) programs_only=1 ;;
  *) echo "setup: error: unknown argument ${1}; usage: scripts/setup.sh [--programs-only]" >&2; exit 2 ;;
esac

# program        Debian package  [optional: why nothing here installs it]
# One line per program the code or the tests start. The same table is in
# phalanx/programs.py (require() names the package of a missing program);
# tests/unit/test_setup_programs.py finds the programs in the code and fails
# when one is missing here or the two tables differ.
programs="
etcd             etcd-server
etcdctl          etcd-client
ip               iproute2
iptables         iptables
iptables-save    iptables
sleep            coreutils
true             coreutils
bash             bash
sh               dash
cc               gcc
git              git
nvidia-smi       nvidia-smi      optional: ships with the NVIDIA driver on a GPU node; without it the agent reads the topology from NVML and sysfs
"

need_apt=()
missing=()
while read -r prog pkg rest; do
  [ -n "$prog" ] || continue
  case "$rest" in optional:*) continue ;; esac
  command -v "$prog" >/dev/null 2>&1 && continue
  missing+=("$prog ($pkg)")
  case " ${need_apt[*]-} " in *" $pkg "*) ;; *) need_apt+=("$pkg") ;; esac
done <<<"$programs"

if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: error: missing programs: ${missing[*]}; run scripts/setup.sh as root, or install the Debian packages ${need_apt[*]}" >&2
    exit 1
  fi
  echo "setup: installing ${need_apt[*]} (apt) for ${missing[*]}" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  for entry in "${missing[@]}"; do
    prog="${entry%% *}"
    if ! command -v "$prog" >/dev/null 2>&1; then
      echo "setup: error: installed ${need_apt[*]} but $entry is still not on PATH" >&2
      exit 1
    fi
  done
fi
# The Debian package enables a system etcd service; Phalanx starts its own.
if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet etcd 2>/dev/null; then
  systemctl disable --now etcd >/dev/null 2>&1 || true
fi
[ "$programs_only" -eq 0 ] || exit 0

py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv ($py -m venv)" >&2
  "$py" -m venv .venv
fi
stamp=.venv/.phalanx-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # Not silent: the first install downloads and builds for a while (~20 s).
  echo "setup: installing Phalanx and its dependencies into .venv (pip; about 20 s the first time)" >&2
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | grep -v "is ignored" >&2 || true
  .venv/bin/python -c "import grpc, aetcd, yaml, pytest, prometheus_client, rich" # fail here, not later
  touch "$stamp"
  echo "setup: .venv ready; its bin/ holds phalanx and the python that has it (\`phalanx up\` prints the PATH line)" >&2
fi
