#!/usr/bin/env bash
# Sets up a fresh machine for xcomm and builds it: system packages, Python
# packages (torch pinned: an unpinned torch pulls gigabytes of CUDA), then the
# extension, compiled against the installed torch. Safe to run again.
#
# Knobs (scripts/test.sh uses them to set up a second torch in a venv):
#   PYTHON=...                 the interpreter to set up (default python3)
#   XCOMM_TORCH_VERSION=X.Y.Z  require exactly this torch (default: keep any
#                              installed 2.11-2.14, else install 2.13.0)
#   XCOMM_INSTALL=editable|wheel  `pip install -e .` (default: imports from the
#                              source tree) or a regular install into PYTHON's
#                              site-packages (two torch versions side by side
#                              cannot share the in-tree module)
#   XCOMM_SETUP=all|main       all (default): what every test needs
#                              (requirements-dev.txt, clang-format, catch2,
#                              iproute2); main: only what the main job needs
#                              (requirements-main.txt, the build tools), which
#                              scripts/main.sh asks for
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${XCOMM_TORCH_VERSION:-2.13.0}
EXACT_TORCH=${XCOMM_TORCH_VERSION:+1}
INSTALL=${XCOMM_INSTALL:-editable}
SETUP=${XCOMM_SETUP:-all}
case "$SETUP" in
  all) requirements=requirements-dev.txt ;;
  main) requirements=requirements-main.txt ;;
  *) echo "XCOMM_SETUP must be all or main, not '$SETUP'" >&2; exit 2 ;;
esac

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v ccache >/dev/null || need_apt+=(ccache)
if [ "$SETUP" = all ]; then
  command -v ip >/dev/null || need_apt+=(iproute2)
  command -v clang-format >/dev/null || need_apt+=(clang-format)
  [ -f /usr/lib/cmake/Catch2/Catch2Config.cmake ] || need_apt+=(catch2)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "== apt: ${need_apt[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# Keep an installed torch from the supported range (2.11 to 2.14), or exactly
# XCOMM_TORCH_VERSION when it is set; otherwise install the pinned build.
if ! XCOMM_WANT="${EXACT_TORCH:+$TORCH_VERSION}" "$PYTHON" - <<'PY' 2>/dev/null; then
import os, sys, torch
want = os.environ["XCOMM_WANT"]
if want:
    sys.exit(0 if torch.__version__.split("+")[0] == want else 1)
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (major, minor) >= (2, 11) and (major, minor) < (2, 15) else 1)
PY
  echo "== pip: torch==${TORCH_VERSION}"
  "$PYTHON" -m pip install -q "torch==${TORCH_VERSION}"
fi

# Every later install is constrained to the torch now installed, so no
# dependency can replace it (an unpinned torch pulls gigabytes of CUDA).
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
# (No local label: pip finds no candidate for "==2.14.1+cu130" in the index.)
"$PYTHON" -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' >"$constraints"

echo "== pip: Python dependencies ($requirements)"
"$PYTHON" -m pip install -q -r "$requirements" -c "$constraints"

echo "== build: xcomm (CMake, incremental in build/, $INSTALL install)"
case "$INSTALL" in
  editable) "$PYTHON" -m pip install -q --no-build-isolation --no-deps -e . ;;
  wheel) "$PYTHON" -m pip install -q --no-build-isolation --no-deps --force-reinstall . ;;
  *) echo "XCOMM_INSTALL must be editable or wheel, not '$INSTALL'" >&2; exit 2 ;;
esac
"$PYTHON" -c "import xcomm, torch; print('xcomm', xcomm.__version__, 'on torch', torch.__version__)"
