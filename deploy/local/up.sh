#!/usr/bin/env bash
# Run the local multi-AZ cluster with the settings in deploy/local/phalanx.env
# (or the env file given as PHALANX_ENV_FILE); extra arguments are passed on to
# `phalanx up`, e.g. `deploy/local/up.sh --no-workload`. Ctrl-C stops it all.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
env_file="${PHALANX_ENV_FILE:-$root/deploy/local/phalanx.env}"
set -a
# shellcheck source=phalanx.env
. "$env_file"
set +a
read -r -a up_args <<<"${PHALANX_UP_ARGS:-}"
exec "$root/scripts/up.sh" "${up_args[@]}" "$@"
