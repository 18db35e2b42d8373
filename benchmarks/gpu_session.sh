#!/usr/bin/env bash
# lms-launch's own GPU measurements (issues 14 and 32), in one call to the GPU machine they run on: unpack the bundle, then the measurements,
# most telling first. Each stage has a time limit of its own, and everything it writes goes straight
# to OUT, so a call cut off by the session's device budget still brings back every stage it finished.
#
#   bash benchmarks/gpu_session.sh PARTS_DIR [STAGE ...]      # OUT defaults to $OUT (the device tool's)
#
# Stages (default, in this order): unpack variants peaks-resnet50 link tests peaks-unet3d ops-resnet50;
# each asked for by name: env (every part's file starts with what it says, so it is not a default: the
# device tool brings back 8 files), and, in later calls, bench-none bench-lms (the largest ResNet-50
# batch without and with LMS, judged by real runs on the GPU held to 16 GiB).
# joins (benchmarks/join_peaks.py: the allocator's peak where the backward pass joins, against the
# simulator's; about 20 s) asked for by name too.
# Issue 32's session (docs/gpu-bundle.md): peers-start in the first transfer call (PyTorch's peers,
# benchmarks/peers/, run in the background while the bundle's parts arrive; they need no TensorFlow),
# peers-status in the next ones, and in the last: unpack peers-wait shipped bench-none bench-lms.
# LMS_SESSION_DEADLINE (seconds from this script's start, default 570) bounds every stage, so the
# stages end, and their files are written, before the device tool's 600 s limit on one call.
# Files in OUT (the device tool brings back at most 8): session.log (every stage's output, the unpack's
# check included), gpu-*.txt (benchmarks/gpu_measurements.py's parts), runs.tgz (the probes'
# output.log and plan-rank0.json, for a case that failed or ran out of memory), bench-*.tgz.
# LMS_CUDNN=auto|machine|bundled (default auto) is the unpack's --cudnn.
set -u
parts_dir=${1:?usage: gpu_session.sh PARTS_DIR [STAGE ...]}
shift
out=${OUT:?set OUT to the folder the results go to}
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(unpack variants peaks-resnet50 link tests peaks-unet3d ops-resnet50)
into=${LMS_TF_DIR:-/tmp/lms-tf}  # where the unpack stage puts TensorFlow (and env.sh)
runs=/tmp/lms-gpu-runs
peers=/tmp/lms-peers  # the PyTorch peers' output, kept between the transfer calls while the machine is warm
deadline=${LMS_SESSION_DEADLINE:-570}
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
exec > >(tee -a "$out/session.log") 2>&1

# SIGINT, not SIGTERM, at a stage's limit: Python then unwinds, and the bench's probe runner kills the
# probe's process group (the probes run in sessions of their own, which the device tool would not end).
stage() {
    local name=$1 limit=$2
    shift 2
    local left=$((deadline - SECONDS - 10))  # 10 s to write what the stage leaves
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then echo "== $name: skipped, ${left} s left of the session's ${deadline} s"; return 124; fi
    echo "== $name: start $(date -u +%T), limit ${limit} s: $*"
    local started=$SECONDS
    timeout -s INT -k 15 "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - started)) s"
    return $rc
}

measure() {  # TensorFlow from the unpacked bundle (a rerun without the unpack stage finds it there)
    [ -n "${LMS_BUNDLE_ENV:-}" ] || { source "$into/env.sh" && export LMS_BUNDLE_ENV=1; } || return 1
    stage "$1" "$2" python3 benchmarks/gpu_measurements.py "${@:3}" --out "$out"
}

bench() {  # lms-launch bench's folder has more files than the device tool brings back: one archive
    local name=$1 limit=$2
    shift 2
    [ -n "${LMS_BUNDLE_ENV:-}" ] || { source "$into/env.sh" && export LMS_BUNDLE_ENV=1; } || return 1
    stage "$name" "$limit" python3 -m launcher.cli bench max-batch recipes/resnet50.yaml --judge run \
        --device-memory 16GiB --no-floor-bound "$@" --out "/tmp/lms-$name"
    # An interrupted bench writes no tables, but each probe's folder (output.log, plan) is there.
    tar -czf "$out/$name.tgz" -C /tmp --exclude='*.keras' "lms-$name" 2>/dev/null
}

peers_start() {  # from a copy: the next transfer call replaces the working tree the script was started from
    local src=/tmp/lms-peers-src  # the script, and the two modules of this repository it reads
    mkdir -p "$peers" "$src/benchmarks/peers" "$src/lms_core" && cp benchmarks/peers/*.py "$src/benchmarks/peers/" &&
        cp benchmarks/reporting.py "$src/benchmarks/" && cp lms_core/__init__.py lms_core/units.py "$src/lms_core/" ||
        return 1
    echo "== peers: started in the background $(date -u +%T), output in $peers"
    setsid nohup python3 "$src/benchmarks/peers/resnet50_torch.py" --out "$peers" --deadline-s "${LMS_PEERS_DEADLINE:-200}" \
        >"$peers/peers.log" 2>&1 < /dev/null &
}

peers_wait() {  # the GPU to TensorFlow alone: wait for the peers, at most $1 s, then end them
    local waited=0
    while [ ! -e "$peers/peers.done" ] && pgrep -f resnet50_torch.py >/dev/null && [ "$waited" -lt "$1" ]; do
        sleep 2; waited=$((waited + 2))
    done
    if pgrep -f resnet50_torch.py >/dev/null; then
        echo "== peers: still running after ${waited} s of waiting; ended (their file says what they finished)"
        pkill -INT -f resnet50_torch.py; sleep 3; pkill -KILL -f resnet50_torch.py
    else
        echo "== peers: done (waited ${waited} s)"
    fi
    tail -n 40 "$peers/peers.log"
    tar -czf "$out/peers.tgz" -C /tmp lms-peers
}

keep_runs() {  # one archive, rewritten after each peaks stage: the device tool brings back 8 files
    [ -d "$runs" ] && tar -czf "$out/runs.tgz" -C "$runs" --ignore-failed-read \
        $(cd "$runs" && find . \( -name output.log -o -name plan-rank0.json \)) 2>/dev/null
}

echo "== gpu_session.sh on $(hostname), $(nproc) cores, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), stages: ${stages[*]}"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
free -g | head -2
for s in "${stages[@]}"; do
    case $s in
        unpack) stage unpack 420 python3 launcher/bundle/unpack.py "$parts_dir" --into "$into" --cudnn "${LMS_CUDNN:-auto}" || {
                    echo "== the bundle's check failed: no measurements (docs/gpu-bundle.md: the cudnn set)"; exit 1; } ;;
        env) measure env 120 env ;;
        variants) measure variants 580 variants --workdir "$runs/variants"; keep_runs ;;
        peaks-resnet50) measure peaks-resnet50 420 peaks --models resnet50 --quick --workdir "$runs/resnet50"; keep_runs ;;
        link) measure link 120 link ;;
        tests) measure tests 300 tests ;;
        ops-resnet50) measure ops-resnet50 300 ops --models resnet50 ;;
        peaks-unet3d) measure peaks-unet3d 420 peaks --models unet3d --quick --workdir "$runs/unet3d"; keep_runs ;;
        shipped) measure shipped 240 variants --models shipped,unswapped --workdir "$runs/shipped"; keep_runs ;;
        bench-none) bench bench-none 150 --configs none --start 192 --min 176 --max 224 --step 8 ;;
        bench-lms) bench bench-lms 580 --configs lms-launch --start 1024 --min 896 --max 1152 --step 128 --run-steps 4 ;;
        joins) { [ -n "${LMS_BUNDLE_ENV:-}" ] || { source "$into/env.sh" && export LMS_BUNDLE_ENV=1; }; } &&
               stage joins 90 python3 benchmarks/join_peaks.py --mib 256 --out "$out/gpu-joins.txt" ;;
        peers-start) peers_start ;;
        peers-status) tail -n 3 "$peers/peers.log" 2>/dev/null || echo "no peers running" ;;
        peers-wait) peers_wait "${LMS_PEERS_WAIT:-30}" ;;
        *) echo "unknown stage $s"; exit 2 ;;
    esac
done
echo "== done $(date -u +%T)"
