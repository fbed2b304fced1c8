#!/usr/bin/env bash
# Regenerates phalanx/v1/*_pb2*.py(i) from proto/. The output is committed;
# tests/unit/test_generated_stubs.py fails when it is stale.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root}"
py="${PYTHON:-$root/.venv/bin/python}"
mkdir -p "$out/phalanx/v1"
cd "$root/proto"
"$py" -m grpc_tools.protoc -I . \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  phalanx/v1/*.proto
