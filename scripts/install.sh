#!/usr/bin/env bash
# Installs everything lms-launch needs into .venv/ at the repository root, and only what is missing:
# running it twice does no work the second time. The README's two commands, CI and both Docker images
# run this same script, so "it works on a fresh machine" is tested on every CI run.
#
# Environment knobs:
#   LMS_LAUNCH_GPU=1|0     force the CUDA build of TensorFlow (and NCCL in Horovod) on or off;
#                          default: on when nvidia-smi lists a GPU.
#   LMS_LAUNCH_PYTHON=...  the interpreter that creates the venv (default: python3.11, else python3).
#   LMS_LAUNCH_WHEELS=...  where the locally built Horovod wheel is cached
#                          (default: ~/.cache/lms-launch/wheels).
set -euo pipefail

# Versions are pinned on purpose: Horovod 0.28.1 is the last Horovod release and it does not build
# against TensorFlow 2.19 or newer (xla_builder.h moved, highwayhash include path changed).
TF_VERSION=2.18.1
HOROVOD_VERSION=0.28.1

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$repo_root/.venv"
wheel_cache=${LMS_LAUNCH_WHEELS:-$HOME/.cache/lms-launch/wheels}

say() { printf '[install] %s\n' "$*" >&2; }

# --- system packages ------------------------------------------------------------------------------
# Installed with apt-get only when this script runs as root (a fresh machine, a Docker build); it never
# calls sudo. Without root it names what is missing and what each is for, and goes on with what can be
# done: one rank, `lms-launch plan` and `lms-launch bench` need neither Horovod nor MPI.
declare -A purpose=(
  [g++]="compiles Horovod, which more than one rank needs"
  [make]="compiles Horovod, which more than one rank needs"
  [cmake]="Horovod's build (pip's cmake in .venv stands in)"
  [libopenmpi-dev]="Open MPI's headers: Horovod with MPI, for --backend mpi (Gloo, the default, needs none)"
  [openmpi-bin]="mpirun, for --backend mpi"
  [openssh-server]="an sshd per test host in tests/test_multihost.py (skipped without it)"
  [iproute2]="the network namespaces of tests/test_multihost.py"
  [slurmctld]="tests/test_slurm.py's real Slurm (it starts its own daemons, with its own configuration, and stops them)"
  [slurmd]="tests/test_slurm.py's real Slurm"
  [slurm-client]="sbatch, srun and squeue for tests/test_slurm.py"
  [munge]="Slurm's authentication, for tests/test_slurm.py"
)
apt_missing=()
for pkg in cmake g++ make libopenmpi-dev openmpi-bin openssh-server iproute2 slurmctld slurmd slurm-client munge; do
  dpkg -s "$pkg" >/dev/null 2>&1 || apt_missing+=("$pkg")
done
if ((${#apt_missing[@]})); then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "apt-get install ${apt_missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${apt_missing[@]}" >/dev/null
  else
    why="not root"
    [ "$(id -u)" -eq 0 ] && why="no apt-get here"
    say "system packages not installed ($why; this script never calls sudo):"
    for pkg in "${apt_missing[@]}"; do say "  $pkg: ${purpose[$pkg]}"; done
    say "  as root: apt-get install ${apt_missing[*]}; on a cluster, load a compiler and Open MPI as modules"
    say "going on with what needs none of them"
  fi
fi

# --- Python environment ---------------------------------------------------------------------------
python_bin=${LMS_LAUNCH_PYTHON:-}
if [ -z "$python_bin" ]; then
  python_bin=$(command -v python3.11 || command -v python3)
fi
if ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
  say "creating $venv with $python_bin"
  "$python_bin" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip setuptools wheel
fi
py="$venv/bin/python"
pip=("$py" -m pip install -q --disable-pip-version-check)

installed_version() { # prints the installed version of a distribution, or nothing
  "$py" - "$1" <<'PY'
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    pass
PY
}

# --- TensorFlow -----------------------------------------------------------------------------------
want_gpu=${LMS_LAUNCH_GPU:-}
if [ -z "$want_gpu" ]; then
  want_gpu=0
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then want_gpu=1; fi
fi
if [ "$want_gpu" = 1 ]; then tf_dist=tensorflow; tf_spec="tensorflow[and-cuda]==$TF_VERSION"
else tf_dist=tensorflow-cpu; tf_spec="tensorflow-cpu==$TF_VERSION"; fi
if [ "$(installed_version "$tf_dist")" != "$TF_VERSION" ]; then
  say "pip install $tf_spec (a few minutes on first install)"
  "${pip[@]}" "$tf_spec"
fi

# --- Horovod, built from source against that TensorFlow ----------------------------------------------
# The variant names what the wheel was compiled with, so a CPU wheel is never reused for a GPU build.
have_mpi=0
command -v mpicxx >/dev/null 2>&1 && have_mpi=1
variant="tf$TF_VERSION-gpu$want_gpu-mpi$have_mpi"
hvd_build_env=(HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1)
[ "$have_mpi" = 1 ] && hvd_build_env+=(HOROVOD_WITH_MPI=1) || hvd_build_env+=(HOROVOD_WITHOUT_MPI=1)
[ "$want_gpu" = 1 ] && hvd_build_env+=(HOROVOD_GPU_OPERATIONS=NCCL)
# Horovod's NCCL build compiles CUDA kernels: it needs the CUDA 12 toolkit's nvcc (TensorFlow 2.18's
# wheels are CUDA 12.5) and NCCL's header. PyPI cannot stand in: nvidia-cuda-nvcc-cu12 ships ptxas
# but no nvcc. Checked here, with one clear message, instead of failing deep inside CMake.
check_nccl_build_tools() {
  local cuda_home=${HOROVOD_CUDA_HOME:-} nvcc="" release="" dir
  if [ -n "$cuda_home" ]; then nvcc="$cuda_home/bin/nvcc"
  elif command -v nvcc >/dev/null 2>&1; then nvcc=$(command -v nvcc)
  elif [ -x /usr/local/cuda/bin/nvcc ]; then nvcc=/usr/local/cuda/bin/nvcc; fi
  [ -n "$nvcc" ] && [ -x "$nvcc" ] && release=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
  if [ -z "$release" ]; then
    say "error: building Horovod with NCCL (LMS_LAUNCH_GPU=1) needs the CUDA 12 toolkit's nvcc, and none was" \
        "found (HOROVOD_CUDA_HOME, PATH, /usr/local/cuda/bin). Install CUDA 12.5, or assemble one without NVIDIA's" \
        "repositories with 'bash docker/cuda-toolkit-unpacked.sh /opt/cuda-12.4' and set HOROVOD_CUDA_HOME=/opt/cuda-12.4;" \
        "PyPI's nvidia-cuda-nvcc-cu12 has no nvcc."
    exit 1
  fi
  if [ "${release%%.*}" != 12 ]; then
    say "error: $nvcc is CUDA $release, but TensorFlow $TF_VERSION runs on CUDA 12; point HOROVOD_CUDA_HOME at a CUDA 12 toolkit"
    exit 1
  fi
  for dir in "${HOROVOD_NCCL_INCLUDE:-}" "${HOROVOD_NCCL_HOME:+$HOROVOD_NCCL_HOME/include}" \
             "$(dirname "$(dirname "$nvcc")")/include" /usr/include /usr/local/include; do
    if [ -n "$dir" ] && [ -f "$dir/nccl.h" ]; then say "NCCL build: nvcc $release ($nvcc), $dir/nccl.h"; return; fi
  done
  # Else the NCCL that tensorflow[and-cuda] brings (the nvidia-nccl-cu12 wheel: header and shared
  # library), linked shared; the linker looks for the unversioned libnccl.so, which the wheel lacks.
  local wheel_nccl
  wheel_nccl=$("$py" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
  if [ -n "$wheel_nccl" ] && [ -f "$wheel_nccl/include/nccl.h" ] && [ -f "$wheel_nccl/lib/libnccl.so.2" ]; then
    [ -e "$wheel_nccl/lib/libnccl.so" ] || ln -s libnccl.so.2 "$wheel_nccl/lib/libnccl.so"
    hvd_build_env+=(HOROVOD_NCCL_HOME="$wheel_nccl" HOROVOD_NCCL_LINK=SHARED)
    say "NCCL build: nvcc $release ($nvcc), $wheel_nccl/include/nccl.h (TensorFlow's nvidia-nccl-cu12 wheel, linked shared)"
    return
  fi
  say "error: building Horovod with NCCL needs nccl.h: install libnccl-dev (NVIDIA's CUDA apt repository) or set HOROVOD_NCCL_HOME"
  exit 1
}
horovod_missing=""  # why Horovod is not built, when it is not
if [ "$(installed_version horovod)" != "$HOROVOD_VERSION" ] || \
   ! "$py" -c 'import horovod.tensorflow' >/dev/null 2>&1; then
  mkdir -p "$wheel_cache/$variant"
  have_wheel=0
  ls "$wheel_cache/$variant"/horovod-"$HOROVOD_VERSION"-*.whl >/dev/null 2>&1 && have_wheel=1
  for tool in g++ make; do
    if [ "$have_wheel" = 0 ] && ! command -v "$tool" >/dev/null 2>&1; then
      horovod_missing="${horovod_missing:+$horovod_missing and }$tool"
    fi
  done
fi
if [ -n "$horovod_missing" ]; then
  say "Horovod $HOROVOD_VERSION not built: its build needs $horovod_missing (see above). One rank, 'lms-launch plan'" \
      "and 'lms-launch bench' work without it; run this script again once they are there"
elif [ "$(installed_version horovod)" != "$HOROVOD_VERSION" ] || \
     ! "$py" -c 'import horovod.tensorflow' >/dev/null 2>&1; then
  if ! ls "$wheel_cache/$variant"/horovod-"$HOROVOD_VERSION"-*.whl >/dev/null 2>&1; then
    [ "$want_gpu" = 1 ] && check_nccl_build_tools
    say "building Horovod $HOROVOD_VERSION from source ($variant; about 3-5 minutes on 2 cores)"
    # Horovod's setup.py imports TensorFlow to find its headers: no build isolation. --no-cache-dir:
    # pip's own wheel cache is keyed by the sdist alone and would hand a CPU build to a GPU install;
    # the variant-keyed cache above is the one that may reuse a build.
    # cmake<4: CMake 4 refuses the cmake_minimum_required(<3.5) of Horovod's bundled gloo, and the
    # venv's cmake is the one used whenever .venv/bin comes first on PATH (activated venv, Docker images).
    "${pip[@]}" "cmake>=3.13,<4" packaging cffi psutil cloudpickle pyyaml
    env "${hvd_build_env[@]}" MAKEFLAGS="-j$(nproc)" "$py" -m pip wheel -q --no-deps --no-cache-dir \
      --no-build-isolation --no-binary horovod "horovod==$HOROVOD_VERSION" -w "$wheel_cache/$variant"
  fi
  "${pip[@]}" "$wheel_cache/$variant"/horovod-"$HOROVOD_VERSION"-*.whl
fi

# --- lms-launch itself (editable) ----------------------------------------------------------------------
stamp="$venv/.lms-launch-install"
want_stamp="$(sha256sum "$repo_root/pyproject.toml" | cut -d' ' -f1) gpu=$want_gpu"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want_stamp" ]; then
  say "pip install -e $repo_root[dev]"
  "${pip[@]}" -e "$repo_root[dev]"
  echo "$want_stamp" >"$stamp"
fi
if [ -n "$horovod_missing" ]; then
  say "ready for one rank: $tf_dist $(installed_version "$tf_dist"), lms-launch in $venv (no Horovod: several ranks need it)"
else
  say "ready: $("$venv/bin/horovodrun" --version 2>/dev/null | tail -n1 | sed 's/^/horovod /') tensorflow $(installed_version "$tf_dist")"
fi
