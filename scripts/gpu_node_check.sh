#!/usr/bin/env bash
# Prove Phalanx's real-hardware paths on one GPU machine and capture fixtures.
#
#   OUT=/some/dir bash scripts/gpu_node_check.sh            # on the GPU machine
#   OUT=/tmp/gpucheck-out GPU_CHECK_DRY_RUN=1 bash scripts/gpu_node_check.sh   # anywhere
#
# Runs from a plain copy of the repo plus .devcarry/ (scripts/stage_device_carry.sh:
# the third-party packages and etcd); nothing is installed. Stages, each logged
# under a header; a failure is recorded and the script goes on where it can:
#
#   a  facts: uname, python, glibc, nvidia-smi (-q, topo -m), infiniband, NVML
#      library, lscpu, numactl; which python can import the carry
#   b  recording: python -m agent.topology.recording $OUT/rec (nvml.json,
#      sysfs.json, nvidia-smi-topo.txt) — a fixture of this machine
#   c  discovery: python -m agent --print-topology on the live machine
#      ($OUT/rec/discovered.json) and again replaying the recordings of b:
#      the two must be identical
#   d  end to end: etcd + one coordinator (AZ a) + one real agent (real
#      discovery, real member processes), secure as by default: etcd with
#      TLS, client certificates and the cluster's etcd users (phalanx.etcd_pki,
#      phalanx.etcd_auth), coordinator/agent/CLI with certificates of the
#      cluster's CA (phalanx.certs); a 1-member gang on all GPUs of the
#      node runs scripts/gpu_member_check.py and must SUCCEED; a gang asking for
#      more GPUs than exist can never fit: it must FAIL at once and
#      `phalanx explain` must say "never fits" and why; everything is stopped
#      and no process may be left.
#   e  fencing on the GPU (before the teardown): a 1-member gang on all GPUs
#      runs gpu_member_check.py --hold (a context and 1 GiB cuMemAlloc+memset
#      on every device, then `GPU_HOLD READY pid=.. devices=..` and sleep);
#      once it is RUNNING and READY, nvidia-smi must show the memory (the
#      member's pid in --query-compute-apps, or else memory.used up by >= 1 GiB
#      per GPU vs. a baseline taken before the gang: containers often hide
#      pids); then the agent is SIGKILLed (not the coordinator) and, polling
#      every 0.2 s for fence_after_s + stop_grace_s + 15 s, the member's
#      process group must vanish with an exit record (rank-0.exit) saying
#      fenced=true, code 120 (its shim fenced it), and memory.used must come
#      back within 128 MiB of the baseline. PASS iff fenced and released; the
#      seconds from SIGKILL to member gone / memory released are printed as
#      measurements. Then the agent is restarted on the same state dir
#      (e-restart) and the gang's end state is printed (cancelled if live).
#
# Output: $OUT/summary.txt (one line per stage: PASS/FAIL/SKIP + reason, then
# OVERALL), $OUT/log.txt (everything), $OUT/rec/{nvml.json,sysfs.json,
# nvidia-smi-topo.txt,discovered.json}, $OUT/logs.tgz (etcd, coordinator,
# agent and member logs, replayed topology, specs) — 7 files at most.
# Exit code 0 iff no stage FAILed.
#
# GPU_CHECK_DRY_RUN=1: for a machine without a GPU. b is skipped; c and d use
# the recorded fixture GPU_CHECK_FIXTURE (default tests/fixtures/topology/hgx-h100)
# through --nvml-recording/--sysfs-recording, and the member command only prints
# CUDA_VISIBLE_DEVICES (GPU_CHECK_MEMBER=real runs gpu_member_check.py anyway,
# e.g. against stub CUDA/NVML libraries on LD_LIBRARY_PATH); in e the member
# only sleeps (--hold --no-cuda) and the GPU-memory checks are skipped, the
# fencing flow itself runs the same.
# Other knobs: GPU_CHECK_PYTHON (interpreter to prefer), GPU_CHECK_BUDGET_S
# (seconds for stages a-e, default 240; a late stage only gets what is left,
# e is skipped with under 60 s left and may overrun by ~60 s once the agent is
# killed; teardown and collection come on top, ~40 s at most: ~5.5 min in the
# worst case, ~30 s when all goes well).

set -u -o pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 1
OUT=${OUT:-/tmp/gpucheck-out}
DRY=${GPU_CHECK_DRY_RUN:-0}
BUDGET=${GPU_CHECK_BUDGET_S:-240}
FIXTURE=${GPU_CHECK_FIXTURE:-tests/fixtures/topology/hgx-h100}
MEMBER_MODE=${GPU_CHECK_MEMBER:-$([ "$DRY" = 1 ] && echo print || echo real)}
NODE=gpu0
AZ=a
RUN_ID=gpucheck-$$-$(date +%s)

mkdir -p "$OUT/rec"
LOG=$OUT/log.txt
SUMMARY=$OUT/summary.txt
: >"$LOG"
: >"$SUMMARY"
# A run killed outright (SIGKILL: no EXIT trap) leaves its work dir; the next
# run removes every one whose owner is gone (pid and start time recorded).
for d in "${TMPDIR:-/tmp}"/gpucheck.*; do
    [ -f "$d/owner" ] || continue
    read -r opid ostart <"$d/owner" 2>/dev/null || continue
    if [ "$(awk '{print $22}' "/proc/$opid/stat" 2>/dev/null)" != "$ostart" ]; then
        rm -rf "$d" && echo "removed $d (work dir of a dead earlier run)" >&2
    fi
done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpucheck.XXXXXX")
echo "$$ $(awk '{print $22}' "/proc/$$/stat")" >"$WORK/owner"
mkdir -p "$WORK/tmp" "$WORK/logs"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!

# The repo is not installed there: everything runs as `python -m` from the
# repo root with the carried packages first; etcd from the carry first.
export PYTHONPATH=$REPO/.devcarry/site:$REPO
export PATH=$REPO/.devcarry/bin:$PATH
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export TMPDIR=$WORK/tmp   # python -m agent --sysfs-recording makes temp dirs there
if [ ! -x "$REPO/.devcarry/bin/etcd" ] && [ -f "$REPO/.devcarry/bin/etcd.gz" ]; then
    mkdir -p "$WORK/bin" && gzip -dc "$REPO/.devcarry/bin/etcd.gz" >"$WORK/bin/etcd" && chmod 755 "$WORK/bin/etcd"
    export PATH=$WORK/bin:$PATH
fi

# NVML/CUDA user-space libraries: where the loader does not already find them
# (a driver mounted under /usr/local/nvidia, say), put their folder on LD_LIBRARY_PATH.
if ! ldconfig -p 2>/dev/null | grep 'libnvidia-ml.so.1 ' >/dev/null; then
    for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/cuda/compat; do
        if [ -e "$d/libnvidia-ml.so.1" ]; then
            case ":${LD_LIBRARY_PATH:-}:" in *":$d:"*) ;; *) export LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; NVLIB_NOTE=" (added $d: libnvidia-ml.so.1 is not in the ldconfig cache)" ;; esac
            break
        fi
    done
fi

FAILED=0
result() {  # STAGE PASS|FAIL|SKIP REASON...
    local stage=$1 status=$2
    shift 2
    [ "$status" = FAIL ] && FAILED=1
    printf '%-13s %-4s %s\n' "$stage" "$status" "$*" >>"$SUMMARY"
    echo ">>> $stage: $status $*"
}
header() { echo; echo "================ [$1] $2   (t=${SECONDS}s)"; }
left() { echo $((BUDGET - SECONDS)); }
# tmo N: N seconds, or what is left of the budget if less (at least 5).
tmo() { local l; l=$(left); [ "$l" -lt "$1" ] && { [ "$l" -lt 5 ] && echo 5 || echo "$l"; } || echo "$1"; }
HAVE_TIMEOUT=$(command -v timeout >/dev/null && echo 1 || echo 0)
to() {  # to SECONDS CMD...: run with a hard limit
    local t=$1
    shift
    if [ "$HAVE_TIMEOUT" = 1 ]; then timeout -k 5 "$t" "$@"; else "$@"; fi
}
show() {  # show SECONDS CMD...: log the command, run it with a limit, log its rc
    local t=$1 rc
    shift
    echo "--- \$ $*"
    to "$t" "$@"
    rc=$?
    [ "$rc" = 0 ] || echo "--- (rc=$rc)"
    return "$rc"
}

# --- processes we start, and their teardown --------------------------------------
ETCD_PID="" COORD_PID="" AGENT_PID="" ETCD_HOLDER=""
# What this script starts dies with it, however it dies (SIGKILL included):
# setpriv (util-linux) sets the kernel's parent-death signal and execs, so a
# PID below is the program's own.
if command -v setpriv >/dev/null 2>&1; then
    DIE_WITH_US=(setpriv --pdeathsig KILL --)
else
    DIE_WITH_US=()
    echo "WARNING: no setpriv (util-linux): a SIGKILL of this script would leave its processes behind" >&2
fi
stop_pid() {  # stop_pid PID NAME GRACE [group]: SIGTERM, wait, SIGKILL
    local pid=$1 name=$2 grace=$3 group=${4:-} i
    [ -n "$pid" ] || return 0
    kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null; return 0; }
    echo "stopping $name (pid $pid)"
    if [ -n "$group" ]; then kill -TERM -- "-$pid" 2>/dev/null; else kill -TERM "$pid" 2>/dev/null; fi
    for ((i = 0; i < grace * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        # a reaped child disappears; an orphaned one (etcd) may linger as a zombie
        [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" = Z ] && break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]; then
        echo "$name did not stop in ${grace}s: SIGKILL"
        if [ -n "$group" ]; then kill -KILL -- "-$pid" 2>/dev/null; else kill -KILL "$pid" 2>/dev/null; fi
    fi
    wait "$pid" 2>/dev/null
    return 0
}
# Every process we start carries GPUCHECK_RUN=$RUN_ID in its environment, and
# so do the members the agent starts (they inherit the agent's environment).
# Their fencing shims do not (docs/launcher.md: a shim's environment is built
# from scratch); each names this run's work dir on its command line (--lease).
run_pids() {
    local p
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        [ "$p" = "$$" ] && continue
        { { tr '\0' '\n' <"/proc/$p/environ"; } 2>/dev/null | grep -x "GPUCHECK_RUN=$RUN_ID" >/dev/null || \
            { tr '\0' ' ' <"/proc/$p/cmdline"; } 2>/dev/null | grep -F -- "--lease $WORK/" >/dev/null; } && \
            [ "$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)" != Z ] && echo "$p"
    done
}
TORN_DOWN=0
teardown() {
    [ "$TORN_DOWN" = 1 ] && return 0
    TORN_DOWN=1
    header teardown "stop agent (stops its members), coordinator, etcd"
    stop_pid "$AGENT_PID" agent 15
    stop_pid "$COORD_PID" coordinator 10
    stop_pid "$ETCD_PID" etcd 10 group
    stop_pid "$ETCD_HOLDER" etcd-holder 5
    local left_over
    left_over=$(run_pids | tr '\n' ' ')
    if [ -n "$left_over" ]; then
        echo "left over after teardown:"
        for p in $left_over; do echo "  $p: $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-200)"; done
        for p in $left_over; do kill -KILL "$p" 2>/dev/null; done
        sleep 0.5
        [ "$STARTED_ANY" = 1 ] && result d-teardown FAIL "processes left after SIGTERM, killed: $left_over"
    elif [ "$STARTED_ANY" = 1 ]; then
        result d-teardown PASS "agent, coordinator, etcd and members all gone"
    fi
    left_over=$(run_pids | tr '\n' ' ')
    [ -z "$left_over" ] || echo "WARNING: still alive after SIGKILL: $left_over"
}
STARTED_ANY=0
finish() {
    local rc=$?
    trap - EXIT INT TERM
    teardown
    header collect "logs into $OUT/logs.tgz"
    [ -d "$WORK/agent-state/logs" ] && cp -r "$WORK/agent-state/logs" "$WORK/logs/members"
    [ -f "$WORK/agent-state/members.json" ] && cp "$WORK/agent-state/members.json" "$WORK/logs/"
    cp "$WORK"/*.json "$WORK"/*.txt "$WORK/logs/" 2>/dev/null
    tar -C "$WORK" -czf "$OUT/logs.tgz" logs 2>/dev/null && tar -tzf "$OUT/logs.tgz" | sed 's/^/  /'
    rm -rf "$WORK"
    echo
    if [ "$FAILED" = 0 ]; then echo "OVERALL       PASS" >>"$SUMMARY"; else echo "OVERALL       FAIL" >>"$SUMMARY"; fi
    echo "================ summary (t=${SECONDS}s, $OUT)"
    cat "$SUMMARY"
    ls -la "$OUT" "$OUT/rec"
    exec >&- 2>&-
    wait "$TEE_PID" 2>/dev/null
    [ "$FAILED" = 0 ] && exit 0 || exit 1
}
trap finish EXIT
trap 'echo "interrupted"; FAILED=1; exit 1' INT TERM

echo "gpu_node_check: repo $REPO, OUT $OUT, dry run $DRY, budget ${BUDGET}s, run $RUN_ID, started $(date -u +%FT%TZ)"

# ================================================================= a. facts
header a "facts"
show 10 uname -a
show 10 sh -c 'cat /etc/os-release 2>/dev/null | head -4; ldd --version 2>&1 | head -1; nproc; free -g 2>/dev/null | head -2'
show 10 sh -c 'command -v python3; python3 --version; python3 -c "import sys; print(sys.executable, sys.prefix)"'
SMI_OK=0
if command -v nvidia-smi >/dev/null; then
    show "$(tmo 30)" nvidia-smi && SMI_OK=1
    show "$(tmo 30)" sh -c 'nvidia-smi -q | head -80'
    show "$(tmo 30)" nvidia-smi topo -m
    show "$(tmo 20)" nvidia-smi -L
else
    echo "--- nvidia-smi: not on PATH"
fi
show 10 sh -c 'ls -la /dev/nvidia* 2>&1 | head -20'
show 10 sh -c 'ls -la /sys/class/infiniband/ 2>&1'
show 10 sh -c 'ldconfig -p | grep -i -e libnvidia-ml -e libcuda'
echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}${NVLIB_NOTE:-}"
show 10 sh -c 'lscpu | head -20'
if command -v numactl >/dev/null; then show 10 numactl -H; else echo "--- numactl: not installed"; fi
show 10 sh -c "ls -la '$REPO/.devcarry' '$REPO/.devcarry/bin' 2>&1; cat '$REPO/.devcarry/README' 2>&1; du -sh '$REPO/.devcarry' 2>&1"
show 10 sh -c 'command -v etcd && etcd --version'
if [ "$SMI_OK" = 1 ]; then
    result a-facts PASS "nvidia-smi: $(to 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | paste -sd';' -)"
elif [ "$DRY" = 1 ]; then
    result a-facts SKIP "dry run: no nvidia-smi expected ($(command -v nvidia-smi >/dev/null && echo 'nvidia-smi failed' || echo 'not installed'))"
else
    result a-facts FAIL "nvidia-smi $(command -v nvidia-smi >/dev/null && echo failed || echo 'not found')"
fi

# Which interpreter: the first that imports the whole carry (grpc's compiled
# part exists for CPython 3.11 and 3.12 only).
header a "python with the carried packages"
PY="" PY_PLAIN=""
for cand in ${GPU_CHECK_PYTHON:-} python3 python3.12 python3.11 /usr/bin/python3 /usr/local/bin/python3; do
    c=$(command -v "$cand" 2>/dev/null) || continue
    [ -z "$PY_PLAIN" ] && PY_PLAIN=$c
    echo "--- $c: $("$c" --version 2>&1)"
    if out=$(to 60 "$c" -c 'import grpc, aetcd, yaml, pynvml, google.protobuf, phalanx.cli, coordinator.server, agent.session, agent.process; print("grpc", grpc.__version__, grpc.__file__); print("protobuf", google.protobuf.__version__, google.protobuf.__file__)' 2>&1); then
        echo "$out"
        PY=$c
        break
    fi
    echo "$out" | tail -3
done
if [ -n "$PY" ]; then
    result a-python PASS "$PY ($("$PY" --version 2>&1)) imports phalanx + carried grpc/aetcd"
else
    result a-python FAIL "no interpreter imports the carry (carried grpc is built for CPython 3.11 and 3.12; found: ${PY_PLAIN:-no python3})"
fi
PYR=${PY:-$PY_PLAIN}   # for stdlib-only steps (recording needs only pynvml, carried as pure Python)

# ================================================================= b. recording
header b "recording: python -m agent.topology.recording $OUT/rec"
if [ "$DRY" = 1 ]; then
    result b-recording SKIP "dry run (no GPU here); c and d replay $FIXTURE"
    REC=$FIXTURE
elif [ -z "$PYR" ]; then
    result b-recording FAIL "no python3"
    REC=$OUT/rec
else
    REC=$OUT/rec
    show "$(tmo 120)" "$PYR" -m agent.topology.recording "$OUT/rec" --description "phalanx gpu_node_check on $(uname -n) $(date -u +%F): $(to 20 nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
    rc=$?
    ls -la "$OUT/rec"
    if [ "$rc" = 0 ] && [ -s "$OUT/rec/nvml.json" ] && [ -s "$OUT/rec/sysfs.json" ]; then
        info=$("$PYR" -c '
import json, sys
n = json.load(open(sys.argv[1])); s = json.load(open(sys.argv[2]))
gpus = [d for d in s["devices"] if "rdma" not in d]; nics = [d for d in s["devices"] if "rdma" in d]
print("init_error=%s" % n["init_error"] if n.get("init_error") else "%d NVML GPUs (driver %s: %s), sysfs: %d GPU functions, %d RDMA devices"
      % (len(n["devices"]), n.get("driver_version"), ", ".join(sorted({str(d.get("name")) for d in n["devices"]})), len(gpus), len(nics)))
' "$OUT/rec/nvml.json" "$OUT/rec/sysfs.json" 2>&1)
        if grep -q '"devices": \[\]' "$OUT/rec/nvml.json" || [[ $info == *init_error* ]]; then
            result b-recording FAIL "NVML recorded no GPU: $info"
        else
            result b-recording PASS "$info; nvidia-smi-topo.txt $([ -s "$OUT/rec/nvidia-smi-topo.txt" ] && echo captured || echo MISSING)"
        fi
    else
        result b-recording FAIL "recorder rc=$rc (see log)"
    fi
fi

# ================================================================= c. discovery
header c "discovery: live vs. replayed recordings"
NGPUS=0
summarize_topo() {
    "$PYR" -c '
import json, sys
t = json.load(open(sys.argv[1]))
g = t.get("gpus", [])
print("%d GPUs [%s], %d NVLink islands, %d NICs, sources %s" % (len(g), ", ".join(sorted({x.get("model", "?") for x in g})),
      len({x.get("nvlink_island") for x in g}), len(t.get("nics", [])), ",".join(t.get("sources", []))))
' "$1" 2>&1
}
print_topology() {  # print_topology OUTFILE ARGS...: python -m agent --print-topology
    local outfile=$1
    shift
    echo "--- \$ $PYR -m agent --az $AZ --etcd 127.0.0.1:1 --node $NODE --print-topology $*"
    to "$(tmo 90)" "$PYR" -m agent --az "$AZ" --etcd 127.0.0.1:1 --node "$NODE" --print-topology "$@" >"$outfile" 2>"$WORK/print-topology.err"
    local rc=$?
    cat "$WORK/print-topology.err"
    return "$rc"
}
SMI_FILE=""
if [ -z "$PYR" ]; then
    result c-discovery FAIL "no python3"
    result c-replay SKIP "no python3"
else
    if [ "$DRY" = 1 ]; then
        # "live" = the fixture's recordings, the way a fixture-fed agent sees them
        SMI_FILE=$FIXTURE/nvidia-smi-topo.txt
        live_args=(--nvml-recording "$FIXTURE/nvml.json" --sysfs-recording "$FIXTURE/sysfs.json")
    else
        live_args=()
        if to "$(tmo 30)" nvidia-smi topo -m >"$WORK/nvidia-smi-topo-live.txt" 2>/dev/null && [ -s "$WORK/nvidia-smi-topo-live.txt" ]; then
            SMI_FILE=$WORK/nvidia-smi-topo-live.txt
        fi
    fi
    [ -n "$SMI_FILE" ] && live_args+=(--nvidia-smi-topo "$SMI_FILE")
    if print_topology "$OUT/rec/discovered.json" "${live_args[@]}" && [ -s "$OUT/rec/discovered.json" ]; then
        NGPUS=$("$PYR" -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["gpus"]))' "$OUT/rec/discovered.json")
        head -c 1500 "$OUT/rec/discovered.json"; echo " ..."
        what=$(summarize_topo "$OUT/rec/discovered.json")
        if [ "$NGPUS" -gt 0 ]; then result c-discovery PASS "$what"; else result c-discovery FAIL "no GPU discovered: $what"; fi
    else
        result c-discovery FAIL "python -m agent --print-topology failed: $(tail -1 "$WORK/print-topology.err")"
        rm -f "$OUT/rec/discovered.json"
    fi
    # the same nvidia-smi input as the live run: the recorded matrix if there is one
    replay_smi=$REC/nvidia-smi-topo.txt
    [ -s "$replay_smi" ] || replay_smi=$SMI_FILE
    replay_args=(--nvml-recording "$REC/nvml.json" --sysfs-recording "$REC/sysfs.json")
    [ -n "$SMI_FILE" ] && [ -n "$replay_smi" ] && replay_args+=(--nvidia-smi-topo "$replay_smi")
    if [ ! -s "$REC/nvml.json" ] || [ ! -s "$REC/sysfs.json" ]; then
        result c-replay SKIP "no recordings to replay"
    elif ! print_topology "$WORK/replayed.json" "${replay_args[@]}"; then
        result c-replay FAIL "replay failed: $(tail -1 "$WORK/print-topology.err")"
    elif [ ! -s "$OUT/rec/discovered.json" ]; then
        result c-replay FAIL "replay ran ($(summarize_topo "$WORK/replayed.json")) but there is no live result to compare"
    elif diff -u "$OUT/rec/discovered.json" "$WORK/replayed.json" >"$WORK/replay.diff"; then
        result c-replay PASS "replaying nvml.json+sysfs.json gives the identical topology ($NGPUS GPUs)"
    else
        echo "--- live vs replayed differ:"
        head -100 "$WORK/replay.diff"
        result c-replay FAIL "replayed topology differs from live ($(grep -c '^[-+][^-+]' "$WORK/replay.diff") lines, diff in log)"
    fi
fi

# ================================================================= d. end to end
header d "end to end: etcd + coordinator + real agent + gangs"
STARTED_ANY=0
wait_line() {  # wait_line FILE PATTERN SECONDS PID: wait for a line, or the process to die
    local file=$1 pattern=$2 secs=$3 pid=$4 i
    for ((i = 0; i < secs * 10; i++)); do
        grep -q "$pattern" "$file" 2>/dev/null && return 0
        kill -0 "$pid" 2>/dev/null || { grep -q "$pattern" "$file" 2>/dev/null; return $?; }
        sleep 0.1
    done
    return 1
}
px() { to "$(tmo "${PX_TIMEOUT:-30}")" "$PY" -m phalanx --address "$ADDR" --tls-dir "$WORK/client" --rpc-timeout 10 "$@"; }

# submit_one_member_gang NAME ENV CMD...: write $WORK/NAME.json (1 member on
# all $NGPUS GPUs, no restart; ENV is "" or KEY=VALUE for the member), show
# it on stderr (the log), submit it, print the gang id (empty on failure).
submit_one_member_gang() {
    local name=$1 env=$2; shift 2
    "$PY" - "$WORK/$name.json" "$name" "$NGPUS" "$env" "$@" <<'EOF'
import json, sys
path, name, gpus, env, cmd = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:]
run = {"command": cmd}
if env:
    key, _, value = env.partition("=")
    run["env"] = {key: value}
spec = {"name": name, "members": 1, "resources": {"gpus": gpus}, "run": run,
        "policy": {"admission_timeout_s": 60, "max_restarts": 0, "start_timeout_s": 60}}
open(path, "w").write(json.dumps(spec, indent=1) + "\n")
EOF
    cat "$WORK/$name.json" >&2
    echo "--- \$ phalanx submit $name.json" >&2
    px submit "$WORK/$name.json"
}
pxshow() { echo "--- \$ phalanx $*"; px "$@"; local rc=$?; [ "$rc" = 0 ] || echo "--- (rc=$rc)"; return "$rc"; }

d_skip=""
CLUSTER_READY=0
[ -z "$PY" ] && d_skip="no python imports the carried packages (grpc is built for CPython 3.11/3.12 only; see a-python)"
[ -z "$d_skip" ] && [ "$NGPUS" -le 0 ] && d_skip="discovery found no GPU (stage c)"
[ -z "$d_skip" ] && ! to 10 etcd --version >/dev/null 2>&1 && d_skip="etcd does not run here: $(etcd --version 2>&1 | tail -1)"
[ -z "$d_skip" ] && [ "$(left)" -lt 90 ] && d_skip="only $(left)s of the ${BUDGET}s budget left"
if [ -n "$d_skip" ]; then
    result d-cluster SKIP "$d_skip"
    result d-gang SKIP "$d_skip"
    result d-explain SKIP "$d_skip"
else
    STARTED_ANY=1
    timings=fast
    # Secure as a deployment (the default): etcd with TLS, client
    # certificates and the cluster's least-privilege etcd users; coordinator,
    # agent and CLI with certificates of the cluster's gRPC CA.
    CLUSTER=local   # the coordinator's and the agent's default --cluster
    # etcd through the project's own helper (same flags as phalanx up and the tests)
    echo "--- starting etcd (TLS, client-cert auth, etcd auth; PKI in $WORK/etcd-pki; gRPC CA in $WORK/pki)"
    # The holder is etcd's parent for the whole run (etcd dies with it, by the
    # parent-death signal), and the holder dies with this script: SIGKILL of
    # the script (a test's timeout) leaves no etcd behind. It also makes the
    # credentials (in this one interpreter: each start costs seconds on a
    # loaded machine), as `phalanx certs` and `phalanx certs etcd-*` would:
    # the cluster's gRPC CA with the coordinator's, the agent's and an admin
    # client certificate ($WORK/client, for the CLI); the etcd CA with the
    # coordinator's etcd user, whose role it provisions (the agent has none:
    # it reads through the coordinator, as by default).
    "${DIE_WITH_US[@]}" env GPUCHECK_RUN="$RUN_ID" "$PY" - "$WORK/etcd" "$WORK/logs/etcd.log" "$WORK/etcd.info" \
        "$WORK/etcd-pki" "$CLUSTER" "$WORK/pki" "$NODE" "$WORK/client" >"$WORK/logs/etcd-holder.log" 2>&1 <<'EOF' &
import asyncio, datetime, os, shutil, sys, time
from pathlib import Path
from phalanx import certs, etcd_auth, etcd_pki
from phalanx.etcd_server import EtcdServer
now = datetime.datetime.now(datetime.timezone.utc)
pki, cluster, grpc_pki, node, client = sys.argv[4], sys.argv[5], Path(sys.argv[6]), sys.argv[7], Path(sys.argv[8])
certs.init_ca(grpc_pki, cluster, now=now)
certs.issue(grpc_pki, "coordinator", "a-c0", now=now)
certs.issue(grpc_pki, "agent", node, node=node, now=now)
client.mkdir(mode=0o700)
shutil.copy(grpc_pki / "ca.crt", client / "ca.crt")
certs.issue(grpc_pki, "admin", "gpucheck", now=now, out=(client / "client.crt", client / "client.key"))
etcd_pki.init(pki, now=now)
s = EtcdServer(data_dir=sys.argv[1], name="gpucheck", log_path=sys.argv[2], tls_dir=pki).start()
try:
    s.wait_ready(30)
    asyncio.run(etcd_auth.provision([s.endpoint], s.root_tls, cluster))
    etcd_pki.issue_client(pki, etcd_pki.user_for(cluster, "coordinator"), now=now)
    info = f"{s.proc.pid} {s.endpoint}"
except Exception as exc:
    info = f"NOT-READY {exc!r}"
    s.stop()
with open(sys.argv[3] + ".tmp", "w") as f:
    f.write(info + "\n")
os.replace(sys.argv[3] + ".tmp", sys.argv[3])
while s.proc.poll() is None:
    time.sleep(0.1)
EOF
    ETCD_HOLDER=$!
    for ((i = 0; i < 400; i++)); do
        [ -s "$WORK/etcd.info" ] && break
        kill -0 "$ETCD_HOLDER" 2>/dev/null || break
        sleep 0.1
    done
    etcd_info=$(cat "$WORK/etcd.info" 2>/dev/null || echo "NOT-READY etcd holder ended: $(tail -2 "$WORK/logs/etcd-holder.log" 2>/dev/null)")
    echo "$etcd_info"
    ETCD_PID=$(echo "$etcd_info" | head -1 | awk '{print $1}')
    EP=$(echo "$etcd_info" | head -1 | awk '{print $2}')
    if [ -z "$EP" ] || [[ $etcd_info == *NOT-READY* ]]; then
        result d-cluster FAIL "etcd did not start: $(echo "$etcd_info" | tail -1); $(tail -3 "$WORK/logs/etcd.log" 2>/dev/null)"
    else
        echo "etcd ready at $EP (pid $ETCD_PID)"
        echo "--- starting coordinator a-c0"
        "${DIE_WITH_US[@]}" env GPUCHECK_RUN="$RUN_ID" "$PY" -m coordinator --az "$AZ" --id a-c0 --etcd "$EP" --listen 127.0.0.1:0 \
            --tls-dir "$WORK/pki" --etcd-tls-dir "$WORK/etcd-pki/phalanx-$CLUSTER-coordinator" \
            --timings "$timings" >"$WORK/logs/coordinator.out" 2>"$WORK/logs/coordinator.log" &
        COORD_PID=$!
        if ! wait_line "$WORK/logs/coordinator.out" PHALANX_COORDINATOR_READY "$(tmo 40)" "$COORD_PID"; then
            result d-cluster FAIL "coordinator not ready: $(tail -3 "$WORK/logs/coordinator.log")"
        else
            ADDR=$(grep -o 'address=[^ ]*' "$WORK/logs/coordinator.out" | head -1 | cut -d= -f2)
            echo "coordinator ready at $ADDR (pid $COORD_PID)"
            mkdir -p "$WORK/agent-state"
            # The check's members are its own python (under the repo, maybe in a
            # 0700 home) and need the GPUs: the CLI's owner (admin/gpucheck) runs
            # them as root, explicitly allowed; any other owner as nobody.
            printf 'default: nobody\nowners:\n  admin/gpucheck: root\nallow_root: [admin/gpucheck]\n' >"$WORK/run-as.yaml"
            # No etcd for the agent: it reads through the coordinator (the default).
            agent_args=(--az "$AZ" --coordinators "$ADDR" --node "$NODE" --state-dir "$WORK/agent-state"
                --timings "$timings" --tls-dir "$WORK/pki" --run-as "$WORK/run-as.yaml")
            if [ "$DRY" = 1 ]; then
                agent_args+=(--nvml-recording "$FIXTURE/nvml.json" --sysfs-recording "$FIXTURE/sysfs.json")
            fi
            [ -n "$SMI_FILE" ] && agent_args+=(--nvidia-smi-topo "$SMI_FILE")
            echo "--- starting agent: python -m agent ${agent_args[*]}"
            "${DIE_WITH_US[@]}" env GPUCHECK_RUN="$RUN_ID" "$PY" -m agent "${agent_args[@]}" >"$WORK/logs/agent.out" 2>"$WORK/logs/agent.log" &
            AGENT_PID=$!
            ready=0
            if wait_line "$WORK/logs/agent.out" PHALANX_AGENT_READY "$(tmo 90)" "$AGENT_PID"; then
                cat "$WORK/logs/agent.out"
                # registered and ready, with all GPUs?
                for ((i = 0; i < $(tmo 30) * 2; i++)); do
                    n=$(px nodes -o json 2>/dev/null | "$PY" -c '
import json, sys
for n in json.load(sys.stdin):
    t = n.get("topology", {})
    if t.get("node") == sys.argv[1] and n.get("ready"):
        print(len(t.get("gpus", [])))
' "$NODE" 2>/dev/null)
                    [ -n "$n" ] && { ready=1; break; }
                    sleep 0.5
                done
            fi
            if [ "$ready" != 1 ]; then
                pxshow nodes
                result d-cluster FAIL "agent not ready/registered: $(tail -3 "$WORK/logs/agent.log")"
            else
                pxshow status
                pxshow nodes
                pxshow topology
                CLUSTER_READY=1
                if [ "$n" = "$NGPUS" ]; then
                    result d-cluster PASS "etcd $EP, coordinator $ADDR, agent $NODE ready with $n GPUs"
                else
                    result d-cluster FAIL "agent registered $n GPUs, discovery found $NGPUS"
                fi

                # --- gang 1: one member on all GPUs of the node
                header d "gang gpu-check: 1 member x $NGPUS GPUs"
                if [ "$MEMBER_MODE" = real ]; then
                    member_cmd=("$PY" "$REPO/scripts/gpu_member_check.py")
                else
                    member_cmd=("$PY" -c 'import os; print(os.environ.get("CUDA_VISIBLE_DEVICES"))')
                fi
                GANG=$(submit_one_member_gang gpu-check "GPU_CHECK_TOPOLOGY=$OUT/rec/discovered.json" "${member_cmd[@]}")
                echo "$GANG"
                if [ -z "$GANG" ]; then
                    result d-gang FAIL "submit failed"
                else
                    PX_TIMEOUT=150 pxshow wait "$GANG" --for SUCCEEDED --timeout "$(tmo 120)"
                    wrc=$?
                    pxshow get "$GANG"
                    echo "--- \$ phalanx logs $GANG --state-dir <agent state>"
                    px logs "$GANG" --state-dir "$WORK/agent-state" >"$WORK/member.txt" 2>&1
                    cat "$WORK/member.txt"
                    placed=$(px get "$GANG" -o json 2>/dev/null | "$PY" -c '
import json, sys
g = json.load(sys.stdin)
print(";".join("rank%s@%s gpus=%s" % (m.get("rank", 0), m.get("node"), ",".join(map(str, m.get("gpus", [])))) for m in g.get("placement", [])))' 2>/dev/null)
                    if [ "$wrc" = 0 ]; then
                        extra=""
                        if [ "$MEMBER_MODE" = real ]; then
                            grep -q "GPU_MEMBER_CHECK PASS" "$WORK/member.txt" && extra="member check PASS" || { extra="but no GPU_MEMBER_CHECK PASS line in the member log"; }
                        else
                            cvd=$(grep -v '^\[phalanx' "$WORK/member.txt" | tail -1)
                            want=$(seq -s, 0 $((NGPUS - 1)))
                            [ "$cvd" = "$want" ] && extra="member printed CUDA_VISIBLE_DEVICES=$cvd" || extra="but member printed CUDA_VISIBLE_DEVICES=$cvd, expected $want"
                        fi
                        case $extra in
                            but*) result d-gang FAIL "gang $GANG SUCCEEDED ($placed) $extra" ;;
                            *) result d-gang PASS "gang $GANG SUCCEEDED ($placed); $extra" ;;
                        esac
                    else
                        pxshow explain "$GANG"
                        result d-gang FAIL "gang $GANG did not succeed: $(px get "$GANG" 2>&1 | grep -E '^(state|reason):' | paste -sd' ' -); member: $(grep -E 'GPU_MEMBER_CHECK|FAIL|exit' "$WORK/member.txt" | tail -3 | cut -c1-300 | paste -sd'|' -)"
                    fi
                fi

                # --- gang 2: more GPUs than the node has
                header d "gang too-big: 2 members x $NGPUS GPUs (the node has $NGPUS)"
                "$PY" -c '
import json, sys
json.dump({"name": "too-big", "members": 2, "resources": {"gpus": int(sys.argv[2])},
           "run": {"command": ["true"]}, "policy": {"admission_timeout_s": 600}}, open(sys.argv[1], "w"))
' "$WORK/gang-too-big.json" "$NGPUS"
                echo "--- \$ phalanx submit gang-too-big.json"
                BIG=$(px submit "$WORK/gang-too-big.json")
                echo "$BIG"
                if [ -z "$BIG" ]; then
                    result d-explain FAIL "submit of too-big failed"
                else
                    pxshow wait "$BIG" --for FAILED --timeout 30
                    wrc=$?
                    pxshow get "$BIG"
                    px explain "$BIG" >"$WORK/explain.txt" 2>&1
                    erc=$?
                    echo "--- \$ phalanx explain $BIG"
                    cat "$WORK/explain.txt"
                    pxshow explain "$BIG" -o json >/dev/null
                    pxshow list
                    why=$(grep -m1 -o 'never fits.*' "$WORK/explain.txt" | cut -c1-300)
                    if [ "$wrc" = 0 ] && [ "$erc" = 0 ] && [[ $(sed -n 1p "$WORK/explain.txt") == *FAILED* ]] && [ -n "$why" ]; then
                        result d-explain PASS "too-big FAILED at once: $why"
                    else
                        result d-explain FAIL "wait rc=$wrc explain rc=$erc: $(head -2 "$WORK/explain.txt" | paste -sd' ' - | cut -c1-300)"
                    fi
                fi
            fi
        fi
    fi
fi
# ================================================================= e. fencing on the GPU
header e "fencing on the GPU: SIGKILL the agent under a gang that holds GPU memory"
e_skip=""
[ "$CLUSTER_READY" = 1 ] || e_skip="no running cluster (stage d)"
[ -z "$e_skip" ] && [ "$(left)" -lt 60 ] && e_skip="only $(left)s of the ${BUDGET}s budget left"
if [ -n "$e_skip" ]; then
    result e-fence-gpu SKIP "$e_skip"
else
    # GPU memory through nvidia-smi only where the member really allocates
    E_GPU=0
    [ "$DRY" != 1 ] && [ "$MEMBER_MODE" = real ] && E_GPU=1
    read -r FENCE_AFTER STOP_GRACE <<<"$("$PY" -c '
import sys
from phalanx.timings import Timings
t = getattr(Timings, sys.argv[1])()
print(t.fence_after_s, t.stop_grace_s)' "${timings:-fast}")"
    E_BOUND=$("$PY" -c 'import sys; print(float(sys.argv[1]) + float(sys.argv[2]) + 15)' "$FENCE_AFTER" "$STOP_GRACE")
    HOLD_S=120 HOLD_MIB=1024
    echo "timings ${timings:-fast}: fence_after_s=$FENCE_AFTER stop_grace_s=$STOP_GRACE -> poll bound ${E_BOUND}s after the SIGKILL"
    if [ "$MEMBER_MODE" = real ]; then
        hold_cmd=("$PY" "$REPO/scripts/gpu_member_check.py" --hold "$HOLD_S" --hold-mib "$HOLD_MIB")
    else
        hold_cmd=("$PY" "$REPO/scripts/gpu_member_check.py" --hold "$HOLD_S" --no-cuda)
    fi
    : >"$WORK/e-mem-baseline.txt"
    if [ "$E_GPU" = 1 ]; then
        echo "--- baseline before the gang"
        show "$(tmo 20)" nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader
        to "$(tmo 20)" nvidia-smi --query-gpu=uuid,memory.used --format=csv,noheader,nounits >"$WORK/e-mem-baseline.txt"
        echo "--- \$ nvidia-smi --query-gpu=uuid,memory.used --format=csv,noheader,nounits"
        cat "$WORK/e-mem-baseline.txt"
    fi
    HOLD=$(submit_one_member_gang gpu-hold "" "${hold_cmd[@]}")
    echo "$HOLD"
    hold_log="" ready_line=""
    if [ -z "$HOLD" ]; then
        result e-fence-gpu FAIL "submit of gpu-hold failed"
    else
        PX_TIMEOUT=90 pxshow wait "$HOLD" --for RUNNING --timeout "$(tmo 60)"
        n_polls=$(($(tmo 60) * 5))
        for ((i = 0; i < n_polls; i++)); do
            hold_log=$(ls "$WORK/agent-state/logs/$HOLD"/*/rank-0.log 2>/dev/null | tail -1)
            if [ -n "$hold_log" ]; then
                ready_line=$(grep -m1 '^GPU_HOLD READY' "$hold_log")
                [ -n "$ready_line" ] && break
                grep -q '^GPU_HOLD FAIL' "$hold_log" && break
                [ -e "${hold_log%.log}.exit" ] && break
            fi
            sleep 0.2
        done
        pxshow get "$HOLD"
        echo "--- member log ${hold_log:-<none>}"
        [ -n "$hold_log" ] && cat "$hold_log"
    fi
    if [ -n "$HOLD" ] && [ -z "$ready_line" ]; then
        result e-fence-gpu FAIL "gang $HOLD: no GPU_HOLD READY line: $(px get "$HOLD" 2>&1 | grep -E '^(state|reason):' | paste -sd' ' -); member: $(grep -E 'GPU_HOLD|FAIL|exit' "$hold_log" 2>/dev/null | tail -3 | cut -c1-300 | paste -sd'|' -)"
    elif [ -n "$HOLD" ]; then
        MPID=$(echo "$ready_line" | sed -n 's/.* pid=\([0-9]*\).*/\1/p')
        HOLD_DEVS=$(echo "$ready_line" | sed -n 's/.* devices=\([^ ]*\).*/\1/p')
        echo "member pid $MPID holds ${HOLD_DEVS}; agent pid $AGENT_PID"
        # One program: the last look before, the SIGKILL, and the polling after,
        # so that every time is measured from the same instant.
        to 80 "$PY" - "$AGENT_PID" "$MPID" "${hold_log%.log}.exit" "$E_BOUND" "$E_GPU" "$WORK/e-mem-baseline.txt" \
            "$HOLD_MIB" "$WORK/agent-state/fence-lease" "$HOLD_DEVS" "$FENCE_AFTER" "$STOP_GRACE" >"$WORK/e-monitor.txt" 2>&1 <<'EOF'
import json, os, signal, subprocess, sys, threading, time

agent_pid, mpid, exit_file, bound = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
gpu, base_file, hold_mib, lease_file = sys.argv[5] == "1", sys.argv[6], int(sys.argv[7]), sys.argv[8]
devs = [d for d in sys.argv[9].split(",") if d]
fence_after, grace = float(sys.argv[10]), float(sys.argv[11])
NEAR_MIB = 128   # "back near the baseline"


def say(*a):
    print(*a, flush=True)


def verdict(status, text):
    say(f"E_VERDICT {status} {text}")
    sys.exit(0)


def stat(pid):  # (state, pgrp) or None
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return rest[0], int(rest[2])
    except (OSError, IndexError, ValueError):
        return None


def group(pgid):  # live (non-zombie) processes of the group
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = stat(int(d))
            if st and st[1] == pgid and st[0] != "Z":
                out.append(int(d))
    return out


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def smi(query, units=False):
    fmt = "--format=csv,noheader,nounits" if not units else "--format=csv,noheader"
    try:
        r = subprocess.run(["nvidia-smi", query, fmt], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    return (r.stdout if r.returncode == 0 else None), (r.stdout + r.stderr).strip()


def parse_mem(text):  # {uuid: MiB}
    out = {}
    for line in (text or "").splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2:
            try:
                out[parts[0]] = int(float(parts[1]))
            except ValueError:
                pass
    return out


def apps():  # [(pid, used, uuid)], raw text
    text, raw = smi("--query-compute-apps=pid,used_memory,gpu_uuid", units=True)
    rows = []
    for line in (text or "").splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            rows.append((int(parts[0]), parts[1], parts[2]))
    return rows, raw


def read_lease():
    try:
        return float(open(lease_file).read().strip())
    except (OSError, ValueError):
        return None


st = stat(mpid)
if st is None:
    verdict("FAIL", f"member pid {mpid} is gone before the agent was killed")
pgid = st[1]
say(f"member pid {mpid} (state {st[0]}), process group {pgid}: {cmdline(pgid)}")
for p in group(pgid):
    say(f"  group member {p}: {cmdline(p)}")
if "shim.py" not in cmdline(pgid) and "agent.shim" not in cmdline(pgid):
    say(f"WARNING: the group leader {pgid} does not look like agent/shim.py")

base, pid_mode, mem_up, held = {}, False, False, ""
if gpu:
    base = parse_mem(open(base_file).read())
    rows, raw = apps()
    say("--- before the SIGKILL: nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader")
    say(raw or "(no compute apps listed)")
    text, raw = smi("--query-gpu=uuid,memory.used")
    now = parse_mem(text)
    say("--- before the SIGKILL: nvidia-smi --query-gpu=uuid,memory.used (MiB; baseline -> now)")
    for u in devs:
        say(f"  {u}: {base.get(u)} -> {now.get(u)}")
    listed = {u for p, _, u in rows if p == mpid}
    pid_mode = bool(devs) and set(devs) <= listed
    mem_up = bool(devs) and all(u in base and u in now and now[u] - base[u] >= hold_mib for u in devs)
    say(f"member pid {mpid} listed by nvidia-smi on {len(listed)}/{len(devs)} of its devices; "
        f"memory.used up by >= {hold_mib} MiB on all: {mem_up}")
    if not (pid_mode or mem_up):
        held = "not visible"
    else:
        held = "pid listed by nvidia-smi" if pid_mode else "memory.used rise (pid not listed by nvidia-smi)"
    if not devs or any(u not in base for u in devs):
        say(f"WARNING: devices {devs} vs nvidia-smi baseline {sorted(base)}")

lease = read_lease()
t0 = time.monotonic()
try:
    os.kill(agent_pid, signal.SIGKILL)
except OSError as exc:
    verdict("FAIL", f"cannot SIGKILL the agent {agent_pid}: {exc}")
lease_age = None if lease is None else t0 - lease
say(f"SIGKILL agent pid {agent_pid} at mono {t0:.3f}; lease age then "
    + ("none" if lease_age is None else f"{lease_age:.2f}s") + f" (fence at age > {fence_after}s)")

t_released, samples, stop = None, [], threading.Event()


def watch_gpu():
    global t_released
    while not stop.is_set():
        text, _ = smi("--query-gpu=uuid,memory.used")
        m = parse_mem(text)
        gone_pid = True
        if pid_mode:
            rows, _ = apps()
            gone_pid = all(p != mpid for p, _, _ in rows)
        t = time.monotonic() - t0
        samples.append((round(t, 2), [m.get(u) for u in devs]))
        if m and all(u in m and u in base and m[u] - base[u] < NEAR_MIB for u in devs) and gone_pid:
            t_released = t  # when the query that saw it returned: an upper bound
            return
        stop.wait(0.2)


thread = None
if gpu:
    thread = threading.Thread(target=watch_gpu, daemon=True)
    thread.start()
t_member, t_gone, rec, t_rec = None, None, None, None
while time.monotonic() - t0 < bound:
    t = time.monotonic() - t0
    st = stat(mpid)  # once: the member may vanish between two reads
    if t_member is None and (st is None or st[0] == "Z"):
        t_member = t
    if t_gone is None and not group(pgid):
        t_gone = t
    if rec is None and os.path.exists(exit_file):
        try:
            rec = json.load(open(exit_file))
            t_rec = t
        except (OSError, ValueError):
            pass
    if t_gone is not None and rec is not None and (thread is None or not thread.is_alive()):
        break
    time.sleep(0.2)
stop.set()
if thread is not None:
    thread.join(12)
if gpu:
    say("memory.used samples after the SIGKILL (s, MiB per device): "
        + " ".join(f"{t}:{'/'.join(map(str, m))}" for t, m in (samples if len(samples) <= 12 else samples[:10]))
        + ("" if len(samples) <= 12 else " ... " + " ".join(f"{t}:{'/'.join(map(str, m))}" for t, m in samples[-2:])
           + f" ({len(samples)} samples)"))
    rows, raw = apps()
    say("--- after: nvidia-smi --query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader")
    say(raw or "(no compute apps listed)")
say(f"exit record {exit_file}: {json.dumps(rec)}")
left = group(pgid)
if left:
    say(f"still alive in group {pgid} after {bound}s: " + "; ".join(f"{p} {cmdline(p)}" for p in left))

fmt = lambda t: "-" if t is None else f"{t:.2f}s"
shim_t = None
if rec and isinstance(rec.get("ended_mono"), (int, float)):
    shim_t = rec["ended_mono"] - t0
measured = (f"SIGKILL->member gone {fmt(t_gone)} (member pid exited {fmt(t_member)}, shim's exit record ended_mono "
            f"{fmt(shim_t)}; lease age at kill {fmt(lease_age)}, fence_after {fence_after:g}s + grace {grace:g}s)")
problems = []
if rec is None:
    problems.append(f"no exit record within {bound:g}s")
elif not (rec.get("fenced") is True and rec.get("code") == 120):
    problems.append(f"exit record not fenced/120: fenced={rec.get('fenced')} code={rec.get('code')}")
elif rec.get("pid") != pgid:
    problems.append(f"exit record pid {rec.get('pid')} != shim pid {pgid}")
if t_gone is None:
    problems.append(f"member's process group {pgid} still alive after {bound:g}s")
if gpu:
    if held == "not visible":
        problems.append(f"the held memory was not visible before the kill (no pid in compute apps, memory.used not up by {hold_mib} MiB)")
    if t_released is None:
        problems.append(f"GPU memory not back within {NEAR_MIB} MiB of the baseline after {bound:g}s")
    gpu_text = (f"GPU memory ({hold_mib} MiB x {len(devs)} GPU, seen via {held}) released after {fmt(t_released)}")
else:
    gpu_text = "GPU memory checks skipped (dry run: the member only sleeps, no CUDA)"
if rec is not None and rec.get("fenced") is True:
    head = f"member fenced by its shim (exit record code={rec.get('code')} fenced=true)"
else:
    head = "member NOT fenced by its shim"
text = f"{head}; {measured}; {gpu_text}"
verdict("FAIL" if problems else "PASS", text + ("" if not problems else " -- " + "; ".join(problems)))
EOF
        cat "$WORK/e-monitor.txt"
        echo "--- member log after the kill"
        cat "$hold_log"
        v=$(grep '^E_VERDICT ' "$WORK/e-monitor.txt" | tail -1)
        if [ -z "$v" ]; then
            result e-fence-gpu FAIL "monitor gave no verdict: $(tail -2 "$WORK/e-monitor.txt" | paste -sd'|' -)"
        else
            v=${v#E_VERDICT }
            result e-fence-gpu "${v%% *}" "gang $HOLD, agent SIGKILLed: ${v#* }"
        fi
    fi
    if [ -n "$ready_line" ] && kill -0 "$AGENT_PID" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$AGENT_PID/stat" 2>/dev/null)" != Z ]; then
        echo "the agent (pid $AGENT_PID) was not killed: no restart"
        pxshow cancel "$HOLD" --reason "gpu_node_check stage e failed"
    elif [ -n "$ready_line" ]; then
        wait "$AGENT_PID" 2>/dev/null
        echo "killed agent (pid $AGENT_PID) reaped: status $?"
        AGENT_PID=""
        # the agent again, same state dir, so that teardown works as before
        header e "restart the agent (same state dir) and let the gang end"
        echo "--- starting agent again: python -m agent ${agent_args[*]}"
        "${DIE_WITH_US[@]}" env GPUCHECK_RUN="$RUN_ID" "$PY" -m agent "${agent_args[@]}" >"$WORK/logs/agent2.out" 2>"$WORK/logs/agent2.log" &
        AGENT_PID=$!
        if wait_line "$WORK/logs/agent2.out" PHALANX_AGENT_READY "$(tmo 60)" "$AGENT_PID"; then
            agent2="agent restarted (pid $AGENT_PID)"
            cat "$WORK/logs/agent2.out"
        else
            agent2="agent restart NOT ready: $(tail -2 "$WORK/logs/agent2.log" | paste -sd'|' - | cut -c1-200)"
        fi
        echo "$agent2"
        grep -i -E 'vanish|exit record|adopt' "$WORK/logs/agent2.log" | head -5
        PX_TIMEOUT=45 pxshow wait "$HOLD" --for FAILED,SUCCEEDED,CANCELLED --timeout "$(tmo 30)"
        pxshow get "$HOLD"
        fin=$(px get "$HOLD" 2>&1 | grep -E '^(state|reason):' | sed 's/  */ /g' | paste -sd' ' -)
        case $fin in
            "state: FAILED"* | "state: SUCCEEDED"* | "state: CANCELLED"*) ended=1 ;;
            *) ended=0 ;;
        esac
        if [ "$ended" = 0 ]; then
            pxshow cancel "$HOLD" --reason "gpu_node_check stage e done"
            pxshow wait "$HOLD" --for CANCELLED,FAILED,SUCCEEDED --timeout "$(tmo 15)"
            fin="$fin -> $(px get "$HOLD" 2>&1 | grep -E '^state:' | sed 's/  */ /g')"
        fi
        if [[ $agent2 == "agent restarted"* ]]; then
            result e-restart PASS "$agent2; gang $HOLD $([ "$ended" = 1 ] && echo ended || echo 'still live, cancelled'): $fin"
        else
            result e-restart FAIL "$agent2; gang $HOLD: $fin"
        fi
    fi
    if [ -n "$HOLD" ] && [ -z "$ready_line" ]; then
        pxshow cancel "$HOLD" --reason "gpu_node_check stage e failed"
    fi
fi
exit 0   # the EXIT trap tears down, collects and writes the summary
