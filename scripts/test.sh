#!/usr/bin/env bash
# Sets everything up, then runs every test, once per supported torch: the C++
# tests (Catch2, via ctest) and the multi-process Python tests (pytest).
# Extra arguments go to every pytest run.
#
#   torch 2.13.0 (CPU build): the interpreter scripts/setup.sh sets up (python3),
#     the same environment `bash scripts/main.sh` uses; the whole suite.
#   torch 2.14.1 (CUDA build, runs on the CPU): its own venv, build/venv-torch2.14.1,
#     xcomm installed into it as a regular package; the whole suite except the
#     parts listed in ONCE_ONLY below, which run on 2.13 only.
#
# XCOMM_TEST_TORCH="2.13.0" (or "2.14.1") runs one version only. Both versions
# run even when the first fails; the exit status is non-zero if either did.
set -uo pipefail
cd "$(dirname "$0")/.."

read -r -a versions <<<"${XCOMM_TEST_TORCH:-2.13.0 2.14.1}"

# Run on the first torch only: they test nothing that depends on the torch
# version (style of our own files; tooling built from subprocess calls of
# xcomm_bench whose xcomm calls the rest of the suite already covers on every
# version; the emulated cluster's namespaces and tc), and they are the slowest
# parts that are not. Keep this list short: each entry is a reason to look.
ONCE_ONLY=(
  tests/python/test_style.py
  tests/python/test_harness.py       # the harness itself, on gloo
  tests/python/test_codec_kernels.py # xcomm's kernels against plain arithmetic
  tests/python/test_shm_setup.py     # the segment's set-up: files and pids, no c10d
  tests/python/test_main_job.py      # the main job's environment is torch 2.13; test_ddp runs on both
  tests/python/test_quickstart.py    # docs/quickstart.md's program, on the main job's environment
  xcomm_bench/tests/test_autoswitch.py
  xcomm_bench/tests/test_bench.py
  xcomm_bench/tests/test_cluster.py
  xcomm_bench/tests/test_codecs_bench.py
  xcomm_bench/tests/test_diloco_bench.py
  xcomm_bench/tests/test_engine_bench.py
  xcomm_bench/tests/test_fsdp_bench.py
  xcomm_bench/tests/test_fuzz.py
  xcomm_bench/tests/test_gpu_bench.py
  xcomm_bench/tests/test_launch.py
)

# Each phase is logged with the time since the start, so a slow CI run shows
# where its minutes went.
started=$SECONDS
phase() { printf '== [%d:%02d] %s\n' $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60)) "$*"; }

failed=()
for v in "${versions[@]}"; do
  echo "=================== torch $v"
  select=()
  if [ "$v" = "2.13.0" ]; then
    py=${PYTHON:-python3}
    # The C++ tests are built here only: `pip install .` builds the library alone.
    setup_env=(PYTHON="$py" XCOMM_BUILD_TESTS=ON)
  else
    venv=build/venv-torch$v
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    py=$venv/bin/python
    setup_env=(PYTHON="$py" XCOMM_TORCH_VERSION="$v" XCOMM_INSTALL=wheel XCOMM_BUILD_TESTS=ON)
    if [[ " ${versions[*]} " == *" 2.13.0 "* ]]; then
      for f in "${ONCE_ONLY[@]}"; do select+=("--ignore=$f"); done
      echo "(on torch 2.13.0 only: ${ONCE_ONLY[*]})"
    fi
  fi
  phase "set up and build, torch $v"
  if ! env "${setup_env[@]}" bash scripts/setup.sh; then
    failed+=("torch $v: setup"); continue
  fi
  build_dir=$("$py" scripts/build_dir.py)

  if [ "$v" != "2.13.0" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
    # With a CUDA toolkit, the build above compiled the codecs' CUDA kernels
    # (csrc/compress/cuda): they cannot run here, but they must compile.
    phase "the build against torch $v has its CUDA codec kernels"
    "$py" scripts/smoke.py --expect-cuda-path --expect-cuda-codecs ||
      failed+=("torch $v: CUDA codec kernels not built")
  fi

  if [ "$v" != "2.13.0" ]; then
    # A pip-installed CUDA torch usually comes without a CUDA toolkit: xcomm
    # must build against it all the same (setup.py skips torch's CMake package).
    phase "build against torch $v with no CUDA toolkit, then use it"
    direct=$(mktemp -d)
    if env -u CUDA_HOME -u CUDA_PATH XCOMM_NO_CUDA_TOOLKIT=1 "$py" -m pip install -q \
      --no-build-isolation --no-deps --target "$direct" . &&
      PYTHONPATH="$direct" "$py" scripts/smoke.py --expect-cuda-path --expect-no-cuda-codecs; then
      echo "built and ran without a CUDA toolkit"
    else
      failed+=("torch $v: build without a CUDA toolkit")
    fi
    rm -rf "$direct"
  fi

  phase "C++ tests (ctest), torch $v"
  ctest --test-dir "$build_dir" --output-on-failure --timeout 300 || failed+=("torch $v: ctest")

  phase "Python tests (pytest), torch $v"
  # tests/gpu: on CPU tensors against gloo where no GPU is visible (scripts/gpu_check.sh
  # runs them on a GPU against NCCL).
  XCOMM_GPU_TESTS_ON_CPU=1 "$py" -m pytest tests/python xcomm_bench/tests tests/clients tests/gpu \
    --timeout=900 -q --durations=25 --junit-xml="build/pytest-torch$v.xml" \
    "${select[@]}" "$@" || failed+=("torch $v: pytest")
  [ -f "build/pytest-torch$v.xml" ] && "$py" scripts/test_times.py "build/pytest-torch$v.xml"
done

phase "done"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all tests passed on torch ${versions[*]}"
