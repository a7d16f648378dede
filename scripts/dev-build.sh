#!/usr/bin/env bash
# Incremental rebuild for development, after scripts/setup.sh (or
# `pip install --no-build-isolation -e .`) configured the build folder once
# (build/cmake-py<XY>-torch<X.Y>, from scripts/build_dir.py).
# Rebuilds the C++ core, the Python module (in place, python/xcomm/) and the
# C++ tests; a lock keeps concurrent rebuilds from colliding.
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir=$("${PYTHON:-python3}" scripts/build_dir.py)
exec flock /tmp/xcomm-build.lock cmake --build "$build_dir" --parallel 2
