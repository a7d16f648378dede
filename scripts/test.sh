#!/usr/bin/env bash
# Sets everything up, then runs every test, once per supported torch: the C++
# tests (Catch2, via ctest) and the multi-process Python tests (pytest).
# Extra arguments go to every pytest run.
#
#   torch 2.13.0 (CPU build): the interpreter scripts/setup.sh sets up (python3),
#     the same environment `bash scripts/main.sh` uses; the whole suite.
#   torch 2.14.1 (CUDA build, runs on the CPU): its own venv, build/venv-torch2.14.1,
#     xcomm installed into it as a regular package; the whole suite except the
#     parts listed in ONCE_ONLY below, which run on 2.13 only, and but one
#     case of each parametrized test (see run_tests).
#
# The machine has two cores, and compiling is what they would wait on: while
# one torch's tests run, the next torch is set up and built at the lowest CPU
# priority (nice 19), so it takes only the time the tests leave idle and the
# tests keep their timing. Its log is printed when its tests begin. Likewise
# the build against the CUDA torch with no toolkit, which no test uses, runs
# beside that torch's own tests; its log follows them.
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
  tests/python/test_codec_inputs.py  # the same kernels on zero-heavy, tie-heavy, row-sparse inputs
  tests/python/test_shm_setup.py     # the segment's set-up: files and pids, no c10d
  tests/python/test_main_job.py      # the main job's environment is torch 2.13; test_ddp runs on both
  tests/python/test_quickstart.py    # docs/quickstart.md's program, on the main job's environment
  tests/python/test_readme.py        # README's programs, likewise
  tests/python/test_shm.py           # the segment's transport; its collectives: test_collectives
  tests/python/test_auto.py          # auto's model and rounds; the hook API: test_hooks_compression
  tests/python/test_bench_gpu.py     # the GPU benchmark's rows on CPU tensors
  tests/gpu                          # on CPU tensors here; on a GPU: scripts/gpu_check.sh
  xcomm_bench/tests/test_autoswitch.py
  xcomm_bench/tests/test_bench.py
  xcomm_bench/tests/test_cluster.py
  xcomm_bench/tests/test_codecs_bench.py
  xcomm_bench/tests/test_diloco_bench.py
  xcomm_bench/tests/test_engine_bench.py
  xcomm_bench/tests/test_fsdp_bench.py
  xcomm_bench/tests/test_faults.py
  xcomm_bench/tests/test_fuzz.py
  xcomm_bench/tests/test_gpu_bench.py
  xcomm_bench/tests/test_hook_bench.py
  xcomm_bench/tests/test_launch.py
  xcomm_bench/tests/test_time_to_accuracy.py
)

# Each phase is logged with the time since the start, so a slow CI run shows
# where its minutes went.
started=$SECONDS
phase() { printf '== [%d:%02d] %s\n' $(((SECONDS - started) / 60)) $(((SECONDS - started) % 60)) "$*"; }

# Runs "$@" at the lowest CPU priority (see the top): nice 19, in a session of
# its own whose autogroup is niced to 19 as well. Linux (autogroups on, as
# here) shares the CPU between sessions first and applies nice only within
# one, and the client tests start their programs in sessions of their own: a
# build at plain nice 19 in our session had an equal share against them.
lowest_priority() {
  setsid -w bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null; exec nice -n 19 "$@"' bash "$@"
}

interpreter() { # the Python that runs torch $1's tests
  if [ "$1" = "2.13.0" ]; then echo "${PYTHON:-python3}"; else echo "build/venv-torch$1/bin/python"; fi
}

# Sets up torch $1 and builds xcomm against it; prints what failed, if anything,
# as lines "torch $1: <what>" on fd 3.
prepare() {
  local v=$1 py setup_env
  py=$(interpreter "$v")
  if [ "$v" = "2.13.0" ]; then
    # The C++ tests are built here only: `pip install .` builds the library alone.
    setup_env=(PYTHON="$py" XCOMM_BUILD_TESTS=ON)
  else
    [ -x "$py" ] || python3 -m venv "build/venv-torch$v"
    setup_env=(PYTHON="$py" XCOMM_TORCH_VERSION="$v" XCOMM_INSTALL=wheel XCOMM_BUILD_TESTS=ON)
  fi
  phase "set up and build, torch $v"
  if ! env "${setup_env[@]}" bash scripts/setup.sh; then
    echo "torch $v: setup" >&3
    return
  fi

  if [ "$v" != "2.13.0" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
    # With a CUDA toolkit, the build above compiled the codecs' CUDA kernels
    # (csrc/compress/cuda): they cannot run here, but they must compile.
    phase "the build against torch $v has its CUDA codec kernels"
    "$py" scripts/smoke.py --expect-cuda-path --expect-cuda-codecs ||
      echo "torch $v: CUDA codec kernels not built" >&3
  fi

  phase "torch $v set up and built"
}

# A pip-installed CUDA torch usually comes without a CUDA toolkit: xcomm must
# build against it all the same (setup.py skips torch's CMake package), then
# import and reduce. Its own build folder; the C++ objects are those of the
# toolkit build (CMakeLists.txt gives them the same flags), so ccache serves
# all but the stand-in for the CUDA kernels. Nothing else uses this build, so
# it runs beside torch $1's tests, at nice 19 (see the top); same fd 3 lines.
build_without_toolkit() {
  local v=$1 py direct
  py=$(interpreter "$v")
  phase "build against torch $v with no CUDA toolkit, then use it"
  direct=$(mktemp -d)
  if env -u CUDA_HOME -u CUDA_PATH XCOMM_NO_CUDA_TOOLKIT=1 "$py" -m pip install -q \
    --no-build-isolation --no-deps --target "$direct" . &&
    PYTHONPATH="$direct" "$py" scripts/smoke.py --expect-cuda-path --expect-no-cuda-codecs; then
    echo "built and ran without a CUDA toolkit"
  else
    echo "torch $v: build without a CUDA toolkit" >&3
  fi
  rm -rf "$direct"
  phase "the build against torch $v with no CUDA toolkit is done"
}

# Runs torch $1's C++ and Python tests; the same failure lines on fd 3.
run_tests() {
  local v=$1 py build_dir select=() paths=(tests/python xcomm_bench/tests tests/clients tests/gpu)
  py=$(interpreter "$v")
  if [ "$v" != "2.13.0" ] && [[ " ${versions[*]} " == *" 2.13.0 "* ]]; then
    for f in "${ONCE_ONLY[@]}"; do
      # A folder named on pytest's command line is collected despite --ignore: drop it there.
      if [[ " ${paths[*]} " == *" $f "* ]]; then
        local kept=()
        for p in "${paths[@]}"; do [ "$p" != "$f" ] && kept+=("$p"); done
        paths=("${kept[@]}")
      else
        select+=("--ignore=$f")
      fi
    done
    # And of each parametrized test, its first case only (conftest.py), unless
    # it is marked every_case: the other cases take our code down the same
    # torch API as the first, which the first torch's run covers case by case.
    select+=(-m "not first_torch_only and not large_world" --one-case-per-test)
    echo "(on torch 2.13.0 only: ${ONCE_ONLY[*]}, tests marked first_torch_only or large_world, and all but the first case of each parametrized test not marked every_case)"
  fi
  build_dir=$("$py" scripts/build_dir.py)

  phase "C++ tests (ctest), torch $v"
  ctest --test-dir "$build_dir" --output-on-failure --timeout 300 || echo "torch $v: ctest" >&3

  phase "Python tests (pytest), torch $v"
  # tests/gpu: on CPU tensors against gloo where no GPU is visible (scripts/gpu_check.sh
  # runs them on a GPU against NCCL).
  XCOMM_GPU_TESTS_ON_CPU=1 "$py" -m pytest "${paths[@]}" \
    --timeout=900 -q --durations=25 --junit-xml="build/pytest-torch$v.xml" \
    "${select[@]}" "${pytest_args[@]}" || echo "torch $v: pytest" >&3
  [ -f "build/pytest-torch$v.xml" ] && "$py" scripts/test_times.py "build/pytest-torch$v.xml"
}

pytest_args=("$@")
mkdir -p build
failures=$(mktemp)
trap 'rm -f "$failures" "$failures".*' EXIT

prepare "${versions[0]}" 3>>"$failures"
for i in "${!versions[@]}"; do
  v=${versions[$i]}
  next=${versions[$((i + 1))]:-}
  if [ -n "$next" ]; then
    # The next torch, built while this one's tests run (see the top).
    # (SECONDS=...: its phases count from this script's start, as ours do.)
    lowest_priority bash -c "$(declare -f phase interpreter prepare); SECONDS=$SECONDS; started=$started; prepare $next" \
      >"$failures.log" 2>&1 3>>"$failures.next" &
    preparing=$!
  fi
  echo "=================== torch $v"
  if grep -q "^torch $v: setup" "$failures"; then
    echo "torch $v: not set up, its tests skipped"
  else
    toolkitless=""
    if [ "$v" != "2.13.0" ]; then # a CUDA build of torch
      lowest_priority bash -c "$(declare -f phase interpreter build_without_toolkit); SECONDS=$SECONDS; started=$started; build_without_toolkit $v" \
        >"$failures.direct.log" 2>&1 3>>"$failures.direct" &
      toolkitless=$!
    fi
    run_tests "$v" 3>>"$failures"
    if [ -n "$toolkitless" ]; then
      wait "$toolkitless"
      echo "----- the build against torch $v with no CUDA toolkit, as logged in the background"
      grep -v "^WARNING: Location 'file:" "$failures.direct.log"
      echo "-----"
      cat "$failures.direct" >>"$failures" 2>/dev/null
      rm -f "$failures.direct" "$failures.direct.log"
    fi
  fi
  if [ -n "$next" ]; then
    phase "waiting for torch $next's set-up and build (started in the background)"
    wait "$preparing"
    echo "----- torch $next's set-up and build, as logged in the background"
    grep -v "^WARNING: Location 'file:" "$failures.log"
    echo "-----"
    cat "$failures.next" >>"$failures" 2>/dev/null
    rm -f "$failures.next" "$failures.log"
  fi
done

phase "done"
if [ -s "$failures" ]; then
  sed 's/^/FAILED: /' "$failures"
  exit 1
fi
echo "all tests passed on torch ${versions[*]}"
