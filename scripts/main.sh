#!/usr/bin/env bash
# Sets everything up, then runs the main job: DDP training over xcomm on two
# local ranks (examples/train_ddp.py). Extra arguments go to the script.
set -euo pipefail
cd "$(dirname "$0")/.."
# Only what the job needs: the library (no C++ tests) and its Python packages.
XCOMM_SETUP=main bash scripts/setup.sh
exec "${PYTHON:-python3}" examples/train_ddp.py "$@"
