#!/usr/bin/env bash
# Compiles (syntax only, no link) every C++ file of xcomm against the headers
# of other torch releases, to keep one source building on torch 2.11 to 2.14.
# Downloads each pinned torch wheel without its dependencies (~550 MB each)
# into build/torch-headers/ and installs nothing.
#   bash scripts/check_torch_versions.sh [2.11.0 2.14.0 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.11.0 2.12.0 2.14.0)
pyinc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
pyver=$(python3 -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')
status=0
for v in "${versions[@]}"; do
  dir=build/torch-headers/$v
  if [ ! -d "$dir/torch/include" ]; then
    mkdir -p "$dir"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
      --platform manylinux_2_28_x86_64 -d "$dir" "torch==$v"
    (cd "$dir" && unzip -q -o torch-*.whl 'torch/include/*' && rm -f torch-*.whl)
  fi
  inc=$dir/torch/include
  minor=${v#2.}; minor=${minor%%.*}
  std=c++17; [ "$minor" -ge 14 ] && std=c++20
  failed=0
  for f in $(find csrc tests/cpp examples/cpp -name '*.cpp'); do
    for cuda in "" "-DXCOMM_WITH_CUDA=1"; do
      if ! g++ -std=$std -fsyntax-only -D_GLIBCXX_USE_CXX11_ABI=1 $cuda -Icsrc -I"$inc" \
          -I"$inc/torch/csrc/api/include" -I"$pyinc" "$f"; then
        echo "torch $v: $f does not compile ($std $cuda)"; failed=1
      fi
    done
  done
  [ $failed -eq 0 ] && echo "torch $v: every file compiles ($std)" || status=1
done
exit $status
