#!/usr/bin/env bash
# Builds the CPU image (or, with --gpu, the GPU image) and runs the README's job inside it, on a
# machine that may have no registry and no running Docker daemon:
#   1. uses the running Docker daemon, or starts one (vfs storage, host network only) and stops it at the end;
#   2. makes a Debian bookworm base with debootstrap when it is missing (no registry needed);
#   3. builds docker/Dockerfile.cpu on that base, trusting this host's extra CA certificates (with
#      --gpu, docker/Dockerfile.gpu: on the local base it assembles its CUDA 12 toolkit from Debian's
#      nvcc and PyPI's headers, CUDA_TOOLKIT=unpacked; on a --base it expects one there);
#   4. in the image: `horovodrun --check-build` (TensorFlow, MPI and Gloo must be built in, and NCCL
#      with --gpu), then the README's main job (its first command: 2 local ranks, LMS on; on the CPU
#      with --gpu too), and checks its summary.json.
# Whatever it started (container, daemon) is stopped on every exit path. The build takes about
# 12 minutes on 2 cores; later runs reuse Docker's cache while the sources are unchanged.
#
#   bash scripts/docker-check.sh [--gpu] [--base IMAGE] [--tag NAME] [--out DIR]
#
#   --gpu         the GPU image (docker/Dockerfile.gpu, default tag lms-launch:gpu; its build took 5.5
#                 minutes on 2 cores, most of it TensorFlow's CUDA wheels and Horovod's NCCL build)
#   --base IMAGE  build on IMAGE (e.g. python:3.11-slim-bookworm where a registry is reachable)
#                 instead of the local debootstrap base lms-launch-base:bookworm
#   --tag NAME    the image to build (default lms-launch:cpu, or lms-launch:gpu); the image it replaces is removed
#   --out DIR     where logs and the job's run directory go (default runs/docker-check-<time>)
#
# Exit status: 0 all checks passed; 1 a step or check failed (the message names it and its log);
# 2 bad usage; 77 Docker cannot be used on this machine (no docker, or no daemon can be started).
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly LOCAL_BASE=lms-launch-base:bookworm
readonly DEBIAN_MIRROR=${LMS_DOCKER_DEBIAN_MIRROR:-http://deb.debian.org/debian}
readonly HOST_EXTRA_CA_DIR=/usr/local/share/ca-certificates  # where Debian's update-ca-certificates takes local CAs
readonly IMAGE_CA_DIR="$repo_root/docker/extra-ca-certificates"
readonly DAEMON_START_TIMEOUT_S=60
readonly EXIT_CANNOT_USE_DOCKER=77
# The README's first command; tests/test_docker.py checks that the two agree.
readonly JOB_RECIPE=recipes/unet3d-cpu.yaml
readonly JOB_RANKS=2

base=""
tag=""
out=""
gpu=0
usage() { sed -n '/^#   bash scripts\/docker-check.sh/,/^#   --out/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; }
while (($#)); do
  case $1 in
    --base|--tag|--out)
      if (($# < 2)) || [ -z "$2" ]; then echo "docker-check: $1 needs a value" >&2; usage; exit 2; fi
      case $1 in --base) base=$2 ;; --tag) tag=$2 ;; --out) out=$2 ;; esac
      shift 2 ;;
    --gpu) gpu=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "docker-check: unknown argument '$1'" >&2; usage; exit 2 ;;
  esac
done
if ((gpu)); then flavour=gpu; else flavour=cpu; fi
tag=${tag:-lms-launch:$flavour}
dockerfile=docker/Dockerfile.$flavour
out=${out:-$repo_root/runs/docker-check-$(date +%Y%m%d-%H%M%S)}
if [ -e "$out" ] && [ -n "$(ls -A "$out" 2>/dev/null)" ]; then
  echo "docker-check: --out $out already holds files; give a new directory or remove it" >&2
  exit 2
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)

started=$SECONDS
step() { printf '\n[docker-check] %s  (%ds)\n' "$*" "$((SECONDS - started))"; }
say() { printf '[docker-check] %s\n' "$*"; }
fail() { printf '[docker-check] FAILED: %s\n' "$*" >&2; exit 1; }
cannot_use_docker() { printf '[docker-check] SKIP: %s\n' "$*" >&2; exit "$EXIT_CANNOT_USE_DOCKER"; }

# --- cleanup: only what this script started ------------------------------------------------------------
dockerd_pid=""
container=""
rootfs_dir=""
copied_certs=()
cleanup() {
  local status=$?
  set +e
  if [ -n "$container" ]; then docker rm -f "$container" >/dev/null 2>&1 && say "removed container $container"; fi
  if ((${#copied_certs[@]})); then rm -f "${copied_certs[@]}"; fi
  # An interrupted debootstrap can leave proc/sys mounted inside its tree: never delete across them.
  if [ -n "$rootfs_dir" ]; then
    awk -v d="$rootfs_dir/" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r | xargs -r umount
    rm -rf --one-file-system "$rootfs_dir"
  fi
  if [ -n "$dockerd_pid" ]; then
    kill -TERM "$dockerd_pid" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$dockerd_pid" 2>/dev/null; then kill -KILL "$dockerd_pid"; say "dockerd ignored SIGTERM for 30 s; killed it"; fi
    say "stopped the dockerd this script started (pid $dockerd_pid)"
  fi
  say "logs in $out"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --- 1. a Docker daemon ----------------------------------------------------------------------------------
step "1/5 Docker daemon"
command -v docker >/dev/null 2>&1 || cannot_use_docker "no 'docker' command; install it with: apt-get install docker.io"
if docker info >/dev/null 2>"$out/docker-info.err"; then
  say "using the running daemon ($(docker info --format '{{.ServerVersion}}, storage {{.Driver}}'))"
else
  command -v dockerd >/dev/null 2>&1 ||
    cannot_use_docker "no running Docker daemon and no 'dockerd' to start one; install it with: apt-get install docker.io"
  [ "$(id -u)" -eq 0 ] ||
    cannot_use_docker "no usable Docker daemon ($(head -n1 "$out/docker-info.err")) and starting one needs root"
  # vfs works on any filesystem (overlayfs may not nest here); no bridge or iptables: builds and
  # containers use the host network, which is all this check needs.
  dockerd --storage-driver=vfs --iptables=false --bridge=none >"$out/dockerd.log" 2>&1 &
  dockerd_pid=$!
  say "started dockerd (pid $dockerd_pid), log $out/dockerd.log"
  for _ in $(seq $((DAEMON_START_TIMEOUT_S * 2))); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || break
    sleep 0.5
  done
  if ! docker info >/dev/null 2>&1; then
    tail -n 5 "$out/dockerd.log" | sed 's/^/    dockerd: /' >&2
    cannot_use_docker "dockerd did not come up within ${DAEMON_START_TIMEOUT_S} s (log: $out/dockerd.log)"
  fi
  say "daemon ready ($(docker info --format '{{.ServerVersion}}, storage {{.Driver}}'))"
fi

# --- 2. the base image ---------------------------------------------------------------------------------
step "2/5 base image"
if [ -n "$base" ]; then
  if docker image inspect "$base" >/dev/null 2>&1; then
    say "building on $base"
  else
    say "docker pull $base"
    # docker build would pull it too, but its error does not name the image.
    docker pull "$base" >"$out/pull.log" 2>&1 ||
      fail "cannot pull the base image $base: $(tail -n1 "$out/pull.log"); omit --base to build on a local Debian base made with debootstrap"
  fi
elif docker image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
  base=$LOCAL_BASE
  say "using $base (made earlier by this script)"
else
  base=$LOCAL_BASE
  if ! command -v debootstrap >/dev/null 2>&1; then
    [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1 ||
      fail "making $base needs debootstrap: install it (apt-get install debootstrap) or pass --base IMAGE"
    say "apt-get install debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >"$out/apt-debootstrap.log" 2>&1 ||
      fail "apt-get install debootstrap failed (log: $out/apt-debootstrap.log)"
  fi
  rootfs_dir=$(mktemp -d /tmp/lms-launch-rootfs.XXXXXX)
  say "debootstrap --variant=minbase bookworm from $DEBIAN_MIRROR (about 30 s)"
  debootstrap --variant=minbase bookworm "$rootfs_dir" "$DEBIAN_MIRROR" >"$out/debootstrap.log" 2>&1 ||
    fail "debootstrap failed (log: $out/debootstrap.log); set LMS_DOCKER_DEBIAN_MIRROR to a reachable mirror or pass --base IMAGE"
  tar -C "$rootfs_dir" -c . | docker import --message "debootstrap --variant=minbase bookworm" - "$base" >/dev/null ||
    fail "docker import of the debootstrap tree failed"
  rm -rf "$rootfs_dir"
  rootfs_dir=""
  say "made $base ($(docker image inspect --format '{{.Size}}' "$base" | numfmt --to=iec))"
fi

# --- 3. the image ------------------------------------------------------------------------------------
build_args=(--build-arg BASE_IMAGE="$base")
if ((gpu)); then
  # Debian's base has no CUDA toolkit: the build assembles one. A --base is taken to carry its own.
  if [ "$base" = "$LOCAL_BASE" ]; then cuda_toolkit=unpacked; else cuda_toolkit=image; fi
  build_args+=(--build-arg CUDA_TOOLKIT="$cuda_toolkit")
  step "3/5 docker build -f $dockerfile -t $tag, CUDA_TOOLKIT=$cuda_toolkit (about 6 minutes the first time)"
else
  step "3/5 docker build -f $dockerfile -t $tag (about 12 minutes the first time)"
fi
# The host's extra CAs (a TLS proxy's) go into the build context for this build only.
shopt -s nullglob
for cert in "$HOST_EXTRA_CA_DIR"/*.crt "$HOST_EXTRA_CA_DIR"/*/*.crt; do
  dest="$IMAGE_CA_DIR/host-$(basename "$cert")"
  [ -e "$dest" ] && continue  # already there (put by the user): not ours to remove
  cp "$cert" "$dest"
  copied_certs+=("$dest")
done
shopt -u nullglob
say "extra CA certificates from $HOST_EXTRA_CA_DIR: ${#copied_certs[@]}"
old_image=$(docker image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
build_started=$SECONDS
# Progress shows Docker's steps and the install scripts' own lines (the legacy builder colours a
# RUN's stderr: the escapes are dropped); everything is in build.log. --force-rm: a failed step's
# container is removed too, not left behind holding a full copy of the image.
set +e
docker build --force-rm --network host "${build_args[@]}" -f "$repo_root/$dockerfile" -t "$tag" "$repo_root" \
  2>&1 | tee "$out/build.log" | sed -u 's/\x1b\[[0-9;]*m//g' | grep --line-buffered -E '^Step |^\[(install|prepare-base|cuda-toolkit)\]' |
  sed -u 's/^/    /'
build_status=${PIPESTATUS[0]}
set -e
if ((build_status != 0)); then
  tail -n 25 "$out/build.log" | sed 's/^/    build: /' >&2
  fail "docker build failed (full log: $out/build.log)"
fi
if ((${#copied_certs[@]})); then rm -f "${copied_certs[@]}"; copied_certs=(); fi
new_image=$(docker image inspect --format '{{.Id}}' "$tag")
say "built $tag in $((SECONDS - build_started)) s ($(docker image inspect --format '{{.Size}}' "$tag" | numfmt --to=iec))"
# vfs keeps every layer as a full copy: drop the image this build replaced unless a container uses it.
if [ -n "$old_image" ] && [ "$old_image" != "$new_image" ]; then
  docker image rm "$old_image" >/dev/null 2>&1 && say "removed the previous $tag ($old_image)"
fi

# --- 4. horovodrun --check-build inside the image --------------------------------------------------------
step "4/5 horovodrun --check-build in $tag"
container=lms-launch-check-$$
# One container for both commands: vfs copies the whole image for every container.
docker run -d --init --name "$container" --network host -v "$out:/check" --entrypoint sleep "$tag" infinity >/dev/null ||
  fail "docker run $tag failed"
if ! docker exec "$container" horovodrun --check-build >"$out/check-build.txt" 2>&1; then
  cat "$out/check-build.txt" >&2
  fail "horovodrun --check-build exited non-zero in $tag"
fi
sed -n '/^Horovod v/,$p' "$out/check-build.txt" | sed 's/^/    /'  # without TensorFlow's start-up log lines
wanted=(TensorFlow MPI Gloo)
((gpu)) && wanted+=(NCCL)
for want in "${wanted[@]}"; do
  grep -q "\[X\] $want" "$out/check-build.txt" || fail "horovodrun --check-build does not list $want as built in ($out/check-build.txt)"
done

# --- 5. the README's job: 2 ranks, LMS on ----------------------------------------------------------------------
job=(lms-launch "$JOB_RECIPE" --run-dir /check/run --no-progress)
step "5/5 ${job[*]} in $tag"
job_started=$SECONDS
set +e
docker exec "$container" "${job[@]}" 2>&1 | tee "$out/job.log" | sed -u 's/^/    /'
job_status=${PIPESTATUS[0]}
set -e
((job_status == 0)) || fail "the job exited with status $job_status (log: $out/job.log)"
say "job finished in $((SECONDS - job_started)) s"

# The summary is checked by the image's own Python: no Python needed on this host.
if ! docker exec -i "$container" python - /check/run "$JOB_RANKS" <<'PY'
import json, math, sys
from pathlib import Path

run, ranks_wanted = Path(sys.argv[1]), int(sys.argv[2])
summary_path = run / "summary.json"
if not summary_path.is_file():
    sys.exit(f"no summary.json in the run directory {run}")
summary = json.loads(summary_path.read_text())
problems = []
ranks = sorted(r["rank"] for r in summary.get("ranks", []))
if ranks != list(range(ranks_wanted)) or summary.get("np") != ranks_wanted:
    problems.append(f"expected ranks 0..{ranks_wanted - 1}, summary has ranks {ranks} and np={summary.get('np')}")
if summary.get("weights_in_sync") is not True:
    problems.append("weights_in_sync is not true: the ranks ended with different weights")
if summary.get("lms_enabled") is not True:
    problems.append("lms_enabled is not true in the summary")
swaps = []
for rank in range(ranks_wanted):
    plan = run / "lms" / f"plan-rank{rank}.json"
    if plan.is_file():
        swaps.append(json.loads(plan.read_text())["swap_count"])
    else:
        problems.append(f"no LMS plan lms/plan-rank{rank}.json")
for r in summary.get("ranks", []):
    if not (math.isfinite(r["final_loss"]) and r["samples_per_sec"] > 0):
        problems.append(f"rank {r['rank']}: final_loss {r['final_loss']}, samples_per_sec {r['samples_per_sec']}")
if problems:
    sys.exit("summary.json: " + "; ".join(problems))
print(f"    summary.json: {len(ranks)} ranks, weights in sync, LMS plans for every rank ({swaps} tensors swapped), "
      f"{summary['total_samples_per_sec']:.2f} samples/s in total, loss "
      + ", ".join(f"{r['initial_loss']:.3f} -> {r['final_loss']:.3f}" for r in summary["ranks"]))
PY
then
  fail "the job's summary does not pass (run directory: $out/run)"
fi

step "all checks passed: $tag builds, has ${wanted[*]}, and runs the README's job"
