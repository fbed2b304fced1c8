#!/usr/bin/env bash
# The README's first command: set up, then run a local multi-AZ cluster with a
# sample workload (Ctrl-C stops everything).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
scripts/setup.sh
exec .venv/bin/phalanx up "$@"
