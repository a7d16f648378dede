#!/usr/bin/env bash
# Sets up a fresh machine for xcomm and builds it: system packages, Python
# packages (torch pinned: an unpinned torch pulls gigabytes of CUDA), then the
# extension, compiled against the installed torch. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${XCOMM_TORCH_VERSION:-2.13.0}

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v ccache >/dev/null || need_apt+=(ccache)
command -v ip >/dev/null || need_apt+=(iproute2)
command -v clang-format >/dev/null || need_apt+=(clang-format)
[ -f /usr/lib/cmake/Catch2/Catch2Config.cmake ] || need_apt+=(catch2)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "== apt: ${need_apt[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# Keep an installed torch from the supported range (2.11 to 2.14); otherwise
# install the pinned CPU build.
if ! "$PYTHON" - <<'PY' 2>/dev/null; then
import sys, torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) and (major, minor) < (2, 15) else 1)
PY
  echo "== pip: torch==${TORCH_VERSION}"
  "$PYTHON" -m pip install -q "torch==${TORCH_VERSION}"
fi

echo "== pip: Python dependencies"
"$PYTHON" -m pip install -q -r requirements-dev.txt

echo "== build: xcomm (CMake, incremental in build/)"
"$PYTHON" -m pip install -q --no-build-isolation --no-deps -e .
"$PYTHON" -c "import xcomm, torch; print('xcomm', xcomm.__version__, 'on torch', torch.__version__)"
