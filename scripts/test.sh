#!/usr/bin/env bash
# The README's second command: set up, then run the whole test suite
# (unit, integration on a real etcd + gRPC, chaos in network namespaces).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
scripts/setup.sh
exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
