#!/usr/bin/env bash
# Sets everything up, then runs every test: the C++ tests (Catch2, via ctest)
# and the multi-process Python tests (pytest). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PYTHON=${PYTHON:-python3}
build_dir=$("$PYTHON" -c 'import sys; print(f"build/cmake-py{sys.version_info.major}{sys.version_info.minor}")')

echo "== C++ tests (ctest)"
ctest --test-dir "$build_dir" --output-on-failure --timeout 300

echo "== Python tests (pytest)"
"$PYTHON" -m pytest tests/python xcomm_bench/tests tests/clients --timeout=900 -q "$@"
