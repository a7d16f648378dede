#!/usr/bin/env bash
# Incremental rebuild for development, after scripts/setup.sh (or
# `pip install --no-build-isolation -e .`) configured build/cmake-pyXY once.
# Rebuilds the C++ core, the Python module (in place, python/xcomm/) and the
# C++ tests; a lock keeps concurrent rebuilds from colliding.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=$(python3 -c 'import sys; print(f"build/cmake-py{sys.version_info.major}{sys.version_info.minor}")')
exec flock /tmp/xcomm-build.lock cmake --build "$build_dir" --parallel 2
