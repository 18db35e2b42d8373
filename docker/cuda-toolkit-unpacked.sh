#!/usr/bin/env bash
# Assembles a CUDA 12 toolkit that can build Horovod's NCCL operations, from packages unpacked, not
# installed, where NVIDIA's CUDA images and apt repository cannot be reached (the route measured in
# ../shared/DESIGN.md, 2026-11-24):
#   - the compiler: Debian trixie's non-free `nvidia-cuda-toolkit` 12.4.131 (nvcc, cicc, ptxas,
#     fatbinary, nvlink, cudafe++, libdevice), downloaded with a private apt state and `dpkg -x`, so
#     nothing of trixie is installed on the (bookworm) system; its binaries need only glibc and run
#     on bookworm with gcc 12;
#   - CCCL 2.3.2, the libcu++, CUB and Thrust headers CUDA 12.4 ships, from the same release's
#     libcu++-dev, libcub-dev and libthrust-dev (PyPI's nvidia-cuda-cccl-cu12 12.4 wheels lack
#     libcu++'s nv/ headers, which cuda_fp16.h includes: 12.4.127 is yanked as broken);
#   - the runtime headers and library: PyPI's CUDA 12.4 wheels (nvidia-cuda-runtime-cu12, the crt
#     headers of nvidia-cuda-nvcc-cu12), unzipped (a wheel is a zip);
#   - an nvcc.profile that points nvcc at this folder, and two stand-ins the CUDA build of CMake
#     asks for: libcudart_static.a as a linker script that links the shared libcudart.so.12, and an
#     empty libcudadevrt.a (Horovod's kernels need no device linking).
# NCCL itself (header and library) comes from TensorFlow's nvidia-nccl-cu12 wheel: scripts/install.sh
# finds it there. The result is for building; TensorFlow runs on its own CUDA wheels.
#
#   bash docker/cuda-toolkit-unpacked.sh /opt/cuda-12.4
#   HOROVOD_CUDA_HOME=/opt/cuda-12.4 LMS_LAUNCH_GPU=1 bash scripts/install.sh
#
# Safe to run twice: a folder whose nvcc already reports CUDA 12.4 is left as it is.
set -euo pipefail

DEST=${1:?usage: cuda-toolkit-unpacked.sh DEST (a new or empty folder, e.g. /opt/cuda-12.4)}
DEBS=(nvidia-cuda-toolkit libcu++-dev libcub-dev libthrust-dev)
WHEELS=(nvidia-cuda-runtime-cu12==12.4.127 nvidia-cuda-nvcc-cu12==12.4.131)
say() { echo "[cuda-toolkit] $*"; }

if [ -x "$DEST/bin/nvcc" ] && "$DEST/bin/nvcc" --version 2>/dev/null | grep -q "release 12.4"; then
  say "$DEST already holds CUDA 12.4's nvcc"
  exit 0
fi
if [ -e "$DEST" ] && [ -n "$(ls -A "$DEST" 2>/dev/null)" ]; then
  say "error: $DEST exists and is not empty; give a new or empty folder"
  exit 2
fi
# g++: nvcc's host compiler, for the check at the end (and Horovod's build after it); ar: binutils.
for tool in apt-get dpkg python3 g++ ar; do
  command -v "$tool" >/dev/null 2>&1 || { say "error: needs $tool (apt-get install dpkg python3 python3-venv g++)"; exit 1; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
staging="$work/toolkit"  # assembled and checked here, then copied into DEST: nothing half-made lands there

# --- the compiler, from trixie, unpacked ------------------------------------------------------------
apt_state="$work/apt"
mkdir -p "$apt_state/lists/partial" "$apt_state/cache/archives/partial" "$work/deb"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main non-free" \
  >"$apt_state/sources.list"
apt_options=(-o Dir::Etc::SourceList="$apt_state/sources.list" -o Dir::Etc::SourceParts=/dev/null
             -o Dir::State::Lists="$apt_state/lists" -o Dir::Cache="$apt_state/cache" -o APT::Sandbox::User=root)
say "downloading ${DEBS[*]} from Debian trixie (not installed: unpacked with dpkg -x)"
apt-get "${apt_options[@]}" -qq update
(cd "$work/deb" && apt-get "${apt_options[@]}" -qq download "${DEBS[@]}")
for deb in "$work/deb"/*.deb; do dpkg -x "$deb" "$work/unpacked"; done
from="$work/unpacked/usr"
mkdir -p "$staging/bin/crt" "$staging/nvvm/libdevice" "$staging/include" "$staging/lib64"
cp -a "$from/lib/nvidia-cuda-toolkit/bin/nvcc" "$from/lib/nvidia-cuda-toolkit/bin/cicc" "$staging/bin/"
cp -a "$from/lib/nvidia-cuda-toolkit/bin/crt/." "$staging/bin/crt/"
for tool in ptxas fatbinary nvlink cudafe++ bin2c nvprune cuobjdump nvdisasm cu++filt; do
  cp -a "$from/bin/$tool" "$staging/bin/"
done
cp -a "$from/lib/nvidia-cuda-toolkit/libdevice/." "$staging/nvvm/libdevice/"
# The Debian package is not pinned (trixie may take a new revision); the wheels below are CUDA 12.4's.
compiler=$("$staging/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
if [ "$compiler" != 12.4 ]; then
  say "error: Debian trixie's nvidia-cuda-toolkit is CUDA ${compiler:-unknown} now, not 12.4; pin the wheels" \
      "in WHEELS to that release"
  exit 1
fi
for headers in cuda nv cub thrust; do cp -a "$from/include/$headers" "$staging/include/"; done

# --- headers and the runtime, from PyPI's wheels -------------------------------------------------------
say "downloading ${WHEELS[*]}"
pip=(python3 -m pip)
if ! python3 -m pip --version >/dev/null 2>&1; then  # a bare Debian python3: pip from a throwaway venv
  python3 -m venv "$work/venv"
  pip=("$work/venv/bin/python" -m pip)
fi
"${pip[@]}" download -q --disable-pip-version-check --no-deps -d "$work/wheels" "${WHEELS[@]}"
for wheel in "$work/wheels"/*.whl; do python3 -m zipfile -e "$wheel" "$work/wheels/unzipped"; done
for part in cuda_runtime cuda_nvcc; do
  cp -a "$work/wheels/unzipped/nvidia/$part/include/." "$staging/include/"
done
cp -a "$work/wheels/unzipped/nvidia/cuda_runtime/lib/libcudart.so.12" "$staging/lib64/"
ln -s libcudart.so.12 "$staging/lib64/libcudart.so"
echo "INPUT(libcudart.so.12)" >"$staging/lib64/libcudart_static.a"
ar rc "$staging/lib64/libcudadevrt.a"  # nvlink says it skips this empty archive: expected

# nvcc reads the nvcc.profile beside it: where its tools, libdevice, headers and libraries are.
cat >"$staging/bin/nvcc.profile" <<'PROFILE'
TOP                = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH   += $(TOP)/lib64:
PATH              += $(_HERE_):
INCLUDES          += "-I$(TOP)/include" $(_SPACE_)
LIBRARIES          =+ $(_SPACE_) "-L$(TOP)/lib64"
CUDAFE_FLAGS      +=
PTXAS_FLAGS       +=
PROFILE

# --- check: a kernel with the headers Horovod's kernels include compiles and links with the runtime ---
cat >"$work/check.cu" <<'CU'
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cub/cub.cuh>
__global__ void scale(__half* x, float a, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] = __float2half(__half2float(x[i]) * a); }
int main() { __half* x = nullptr; cudaMalloc(&x, 4); scale<<<1, 1>>>(x, 2.0f, 1); return cudaFree(x) == cudaSuccess ? 0 : 1; }
CU
"$staging/bin/nvcc" -arch=sm_80 -o "$work/check" "$work/check.cu"

mkdir -p "$DEST"
cp -a "$staging/." "$DEST/"
say "CUDA $compiler toolkit in $DEST (nvcc compiled and linked a kernel for sm_80); build with HOROVOD_CUDA_HOME=$DEST"
