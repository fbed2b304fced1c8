#!/usr/bin/env bash
# Build .devcarry/ (git-ignored through .git/info/exclude, not .gitignore) for a
# bare remote machine that gets a copy of the working tree but no pip, no venv
# and no network (scripts/gpu_node_check.sh):
#
#   .devcarry/site/   the third-party packages Phalanx imports, copied from
#                     .venv/lib/python3.11/site-packages. The only compiled
#                     parts are grpc's cygrpc (one build per CPython version:
#                     the venv's cp311 plus, fetched from PyPI, the same grpcio
#                     version for each of EXTRA_PYTHONS, default 3.12 = the
#                     python3 of the device image), protobuf's abi3 _upb (any
#                     CPython >= 3.9) and PyYAML's optional _yaml (cp311 only;
#                     other versions use PyYAML's pure-Python code).
#   .devcarry/bin/    etcd (copy of the local binary; with ETCD_GZ=1 gzipped
#                     as etcd.gz, -13 MiB, and unpacked by gpu_node_check.sh)
#
# Use on the remote, from the repo root:
#   export PATH=$PWD/.devcarry/bin:$PATH PYTHONPATH=$PWD/.devcarry/site:$PWD
#   python3 -m phalanx ... / python3 -m coordinator ... / python3 -m agent ...
# (phalanx/etcd_server.py finds etcd with shutil.which("etcd"), so .devcarry/bin
# must come first on PATH; scripts/gpu_node_check.sh does both itself.)
# Carry the path ".devcarry" with the run.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
SRC=${SITE_PACKAGES:-$REPO/.venv/lib/python3.11/site-packages}
VENV_PY=${VENV_PYTHON:-$REPO/.venv/bin/python}
DEST=$REPO/.devcarry
ETCD_SRC=${ETCD_BINARY:-$(command -v etcd || echo /usr/bin/etcd)}
EXTRA_PYTHONS=${EXTRA_PYTHONS:-3.12}
# Interpreters to prove the carry with (clean environment, no site-packages).
CHECK_PYTHONS=${CHECK_PYTHONS:-"$(for p in /usr/bin/python3 /usr/local/bin/python3 /root/.pyenv/versions/3.12.*/bin/python3; do [ -x "$p" ] && printf '%s ' "$p"; done)"}
LIMIT_MIB=64

[ -d "$SRC" ] || { echo "error: no site-packages at $SRC (run scripts/setup.sh first)" >&2; exit 1; }
[ -x "$ETCD_SRC" ] || { echo "error: no etcd binary at $ETCD_SRC" >&2; exit 1; }

# Keep .devcarry out of git without touching .gitignore.
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qxF '/.devcarry/' "$EXCLUDE" 2>/dev/null || echo '/.devcarry/' >>"$EXCLUDE"

rm -rf "$DEST"
mkdir -p "$DEST/site" "$DEST/bin"

# What the phalanx, coordinator and agent packages import at run time
# (pyproject dependencies: grpcio, grpcio-health-checking, grpcio-reflection,
# protobuf, aetcd, tenacity, PyYAML, nvidia-ml-py) plus their own imports.
# No .dist-info: nothing here reads package metadata at import time (checked below).
ITEMS=(grpc grpc_health grpc_reflection google aetcd tenacity yaml _yaml pynvml.py typing_extensions.py)
for item in "${ITEMS[@]}"; do
    [ -e "$SRC/$item" ] || { echo "error: $SRC/$item missing" >&2; exit 1; }
    cp -a "$SRC/$item" "$DEST/site/"
done
find "$DEST/site" -name __pycache__ -type d -prune -exec rm -rf {} +
find "$DEST/site" -name '*.pyi' -delete
# google/ is a namespace package. If the target interpreter has a *regular*
# google package (an __init__.py) further down sys.path, it would hide our
# google.protobuf; a pkgutil-style __init__ here wins (first on PYTHONPATH)
# and still lets any other google.* portion be found.
[ -e "$DEST/site/google/__init__.py" ] || \
    echo "__path__ = __import__('pkgutil').extend_path(__path__, __name__)  # added by stage_device_carry.sh" >"$DEST/site/google/__init__.py"

# grpc's Python files are the same for every CPython version; only cygrpc is
# built per version. Add the same grpcio release's cygrpc for EXTRA_PYTHONS.
GRPC_VERSION=$("$VENV_PY" -c 'import grpc; print(grpc.__version__)')
for pyver in $EXTRA_PYTHONS; do
    tag=cp${pyver//./}
    dl=$(mktemp -d)
    if "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$dl" "grpcio==$GRPC_VERSION" >"$dl/pip.log" 2>&1; then
        "$VENV_PY" - "$dl" "$DEST/site" "$tag" <<'EOF'
import pathlib, sys, zipfile
dl, site, tag = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
(wheel,) = dl.glob("grpcio-*.whl")
with zipfile.ZipFile(wheel) as z:
    (name,) = [n for n in z.namelist() if n.startswith(f"grpc/_cython/cygrpc.cpython-{tag[2:]}") and n.endswith(".so")]
    target = site / name
    target.write_bytes(z.read(name))
    target.chmod(0o755)
    print(f"added {name} from {wheel.name}")
EOF
    else
        echo "warning: could not fetch grpcio==$GRPC_VERSION for Python $pyver (see below); the carry works on 3.11 only" >&2
        tail -3 "$dl/pip.log" >&2
    fi
    rm -rf "$dl"
done

cp "$ETCD_SRC" "$DEST/bin/etcd"
chmod 755 "$DEST/bin/etcd"
ETCD_VERSION=$("$DEST/bin/etcd" --version 2>/dev/null | sed -n 1p) || true
ETCD_GLIBC=$(objdump -T "$DEST/bin/etcd" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1 | cut -d_ -f2) || true
if [ "${ETCD_GZ:-0}" = 1 ]; then
    # 21 MiB -> ~8 MiB; scripts/gpu_node_check.sh unpacks it into its temp dir.
    gzip -9 "$DEST/bin/etcd"
fi

cat >"$DEST/README" <<EOF
Built by scripts/stage_device_carry.sh on $(date -u +%FT%TZ) from $SRC
compiled modules: $(cd "$DEST/site" && find . -name '*.so' | sort | tr '\n' ' ')
etcd: $ETCD_VERSION (needs glibc >= ${ETCD_GLIBC:-?})$([ "${ETCD_GZ:-0}" = 1 ] && echo ', gzipped: bin/etcd.gz')
EOF

# Proof: each clean interpreter (not the venv; -S: no site-packages at all)
# imports everything the remote runs from the carried site dir plus the repo.
rc=0
for py in $CHECK_PYTHONS; do
    printf 'import check with %s (%s): ' "$py" "$("$py" --version 2>&1)"
    if ! env -i PATH="$DEST/bin:/usr/bin:/bin" PYTHONPATH="$DEST/site:$REPO" PYTHONDONTWRITEBYTECODE=1 \
        "$py" -S -c '
import sys
import phalanx.cli, phalanx.client, phalanx.etcd_server, phalanx.up
import coordinator.__main__, coordinator.server
import agent.__main__, agent.process, agent.shim, agent.topology.recording
import grpc, grpc_health.v1.health, grpc_reflection.v1alpha.reflection, yaml, aetcd, tenacity, pynvml, google.protobuf
from phalanx.etcd_server import etcd_binary
outside = sorted({n.split(".")[0] for n, m in list(sys.modules.items())
                  if any(d in (getattr(m, "__file__", None) or "") for d in ("site-packages", "dist-packages"))})
assert not outside, f"modules loaded from outside the carry: {outside}"
assert sys.argv[2] == "1" or etcd_binary().startswith(sys.argv[1]), etcd_binary()
print("ok: grpc", grpc.__version__, "| protobuf", google.protobuf.__version__, "| yaml", yaml.__version__,
      "(libyaml)" if getattr(yaml, "__with_libyaml__", False) else "(pure Python)", "| etcd", etcd_binary())
' "$DEST/bin" "${ETCD_GZ:-0}"; then
        rc=1
    fi
done
find "$DEST" -name __pycache__ -type d -prune -exec rm -rf {} +
[ "$rc" = 0 ] || { echo "error: import check failed" >&2; exit 1; }

carry_kib=$(du -sk "$DEST" | cut -f1)
tree_kib=$(git ls-files -z | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
untracked_kib=$(git ls-files -z --others --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
total_kib=$((carry_kib + tree_kib + ${untracked_kib:-0}))
echo "sizes: .devcarry $(du -sh "$DEST" | cut -f1) (site $(du -sh "$DEST/site" | cut -f1), bin $(du -sh "$DEST/bin" | cut -f1));" \
     "tracked tree $((tree_kib / 1024)) MiB; untracked non-ignored ${untracked_kib:-0} KiB;" \
     "total $((total_kib / 1024)) MiB of ${LIMIT_MIB} MiB"
if [ "$total_kib" -ge $((LIMIT_MIB * 1024)) ]; then
    echo "error: working tree + carry exceed ${LIMIT_MIB} MiB" >&2
    exit 1
fi
echo "carry: .devcarry"
