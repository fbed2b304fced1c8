#!/usr/bin/env bash
# The README's first command: set up, then run a local multi-AZ cluster with a
# sample workload (Ctrl-C stops everything). `exec`: `phalanx up` itself gets
# the terminal's signals and owns the pipe (`scripts/up.sh | tee up.log`); its
# children die with it however it ends (docs/local-cluster.md).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
scripts/setup.sh
exec .venv/bin/phalanx up "$@"
