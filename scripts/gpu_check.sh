#!/usr/bin/env bash
# The GPU check: on a machine with one GPU and a CUDA torch already installed
# (no network needed), build xcomm, run every CUDA test and the GPU benchmark.
#
#   bash scripts/gpu_check.sh [OUT_DIR]     (default: bench-results/gpu)
#
# Writes to OUT_DIR: env.txt (device, driver, torch, CUDA, NCCL), build.log,
# tests.log (tests/gpu, -v -rA: every collective and DDP with every hook
# on CUDA tensors against NCCL; world size 2 on one GPU where NCCL accepts
# it: NCCL 2.30+ with NCCL_MULTI_RANK_GPU_ENABLE=1, or older NCCL with a
# NCCL_HOSTID per rank, see tests/gpu/test_cuda.py), bench.log + gpu.json + gpu.md (python -m xcomm_bench gpu), profile.log +
# profile.txt (GPU time per kernel of each codec, and of DDP steps with
# each PowerSGD hook, int8 and top-k: --profile): 8 files, as many as the
# GPU machine's tool hands back (no junit.xml: tests.log has every result). Each stage
# has its own time limit; a failed stage does not stop the later ones, and
# the exit status is non-zero if any failed.
#
# XCOMM_GPU_STAGES picks the stages after the build (default
# "tests,bench,profile"), and XCOMM_GPU_SKIP_BUILD=1 reuses the installed
# build: a check cut short by a call's time limit goes on with, e.g.,
#   XCOMM_GPU_SKIP_BUILD=1 XCOMM_GPU_STAGES=bench,profile bash scripts/gpu_check.sh OUT
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NCCL_MULTI_RANK_GPU_ENABLE=1
STAGES=",${XCOMM_GPU_STAGES:-tests,bench,profile},"
failed=()

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" - <<'PY'
import sys, torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible")
PY
  command -v nvcc && nvcc --version | tail -2
} 2>&1 | tee "$OUT/env.txt"

echo "== build (CUDA path on; tests of C++ not built: no Catch2 there)"
# The system compiler, as torch's own extensions are built: the GPU image sets
# CC/CXX to /opt/gcc, whose g++ links libstdc++ statically, and a module with
# its own libstdc++ beside torch's crashed at its first std::ostream use.
unset CC CXX CUDAHOSTCXX
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
  CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
  export CUDA_HOME
fi
if [ "${XCOMM_GPU_SKIP_BUILD:-0}" = 1 ]; then
  echo "(XCOMM_GPU_SKIP_BUILD=1: using the installed xcomm)"
elif ! XCOMM_WITH_CUDA=ON XCOMM_BUILD_TESTS=OFF XCOMM_BUILD_JOBS="$(nproc)" \
  timeout "${XCOMM_GPU_BUILD_S:-240}" "$PY" -m pip install -q --no-build-isolation --no-deps \
  --no-index -e . >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  echo "FAILED: build"
  exit 1
fi
"$PY" -c "import xcomm, torch; from xcomm import _C; print('xcomm built with CUDA:', _C.built_with_cuda, 'torch', torch.__version__)" | tee -a "$OUT/env.txt"

if [[ $STAGES == *,tests,* ]]; then
  echo "== tests/gpu"
  # The whole log to the file first: a `head` in the same pipe would cut it short.
  timeout "${XCOMM_GPU_TEST_S:-300}" "$PY" -m pytest tests/gpu -v -rA --timeout=600 \
    -p no:cacheprovider >"$OUT/tests.log" 2>&1 || failed+=(tests)
  grep -E "FAILED|ERROR|passed|failed|^E " "$OUT/tests.log" | head -120
fi

if [[ $STAGES == *,bench,* ]]; then
  echo "== benchmark"
  timeout "${XCOMM_GPU_BENCH_S:-100}" "$PY" -m xcomm_bench gpu --out "$OUT" >"$OUT/bench.log" 2>&1 ||
    failed+=(benchmark)
  tail -40 "$OUT/bench.log"
fi

if [[ $STAGES == *,profile,* ]]; then
  echo "== kernel profile"
  timeout "${XCOMM_GPU_PROFILE_S:-120}" "$PY" -m xcomm_bench gpu --profile --out "$OUT" \
    >"$OUT/profile.log" 2>&1 || failed+=(profile)
  tail -60 "$OUT/profile.log"
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "gpu check passed"
