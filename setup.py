"""Builds xcomm's C++ core with CMake against the installed torch.

Install with ``pip install --no-build-isolation .`` (or ``-e .``) so CMake
compiles against the torch that is already installed. The CMake build folder
is kept in ``build/cmake-<python>`` so a rebuild after a one-file change only
recompiles that file. Environment knobs:

- ``XCOMM_WITH_CUDA=AUTO|ON|OFF``: compile the CUDA path (default: if torch has CUDA).
- ``XCOMM_BUILD_TYPE=Release|Debug|RelWithDebInfo`` (default Release).
- ``XCOMM_BUILD_TESTS=ON|OFF``: also build the Catch2 tests, the C++ example and the
  emulated-GPU tests (default OFF: ``pip install`` builds the library only;
  ``scripts/test.sh`` turns them on).
"""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import torch.utils

        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        out_dir = target.parent
        if getattr(self, "editable_mode", False) or self.inplace:
            # Editable installs import from the source tree: build straight
            # into it, so `bash scripts/dev-build.sh` alone refreshes it.
            out_dir = ROOT / "python" / "xcomm"
        build_dir = runpy.run_path(str(ROOT / "scripts" / "build_dir.py"))["build_dir"]()
        build_dir.mkdir(parents=True, exist_ok=True)
        generator = ["-G", "Ninja"] if self._has_ninja() else []
        configure = [
            "cmake",
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            *generator,
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DXCOMM_PYTHON_OUTPUT_DIR={out_dir}",
            f"-DXCOMM_PYTHON_EXT_SUFFIX={sysconfig.get_config_var('EXT_SUFFIX')}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('XCOMM_BUILD_TYPE', 'Release')}",
            f"-DXCOMM_WITH_CUDA={os.environ.get('XCOMM_WITH_CUDA', 'AUTO')}",
            f"-DXCOMM_BUILD_TESTS={os.environ.get('XCOMM_BUILD_TESTS', 'OFF')}",
        ]
        configure += self._torch_location_args(torch)
        subprocess.run(configure, check=True)
        jobs = os.environ.get("XCOMM_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.run(["cmake", "--build", str(build_dir), "--parallel", jobs], check=True)
        built = out_dir / target.name
        if built != target:  # setuptools expects the module where it asked for it
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built, target)

    @staticmethod
    def _torch_location_args(torch: object) -> list[str]:
        """How CMake finds torch: for a CUDA build of torch, where the CUDA toolkit is.

        torch's CMake config insists on finding the toolkit whenever torch
        itself is a CUDA build, even for a build of xcomm without its CUDA
        path; it does not look behind an ``nvcc`` on PATH that is a wrapper
        script (as on our machines), so name the toolkit explicitly. With no
        toolkit (a pip-installed CUDA torch), skip torch's CMake package:
        xcomm calls no CUDA API and needs only torch's headers and CPU
        libraries. ``XCOMM_NO_CUDA_TOOLKIT=1`` takes that path even where a
        toolkit exists."""
        if not getattr(torch.version, "cuda", None):  # type: ignore[attr-defined]
            return []
        candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
        if os.environ.get("XCOMM_NO_CUDA_TOOLKIT") == "1":
            candidates = []
        for home in filter(None, candidates):
            if (Path(home) / "bin" / "nvcc").exists() and (Path(home) / "include").is_dir():
                return [
                    f"-DCUDAToolkit_ROOT={home}",
                    f"-DCUDA_TOOLKIT_ROOT_DIR={home}",
                    f"-DCMAKE_CUDA_COMPILER={Path(home) / 'bin' / 'nvcc'}",
                ]
        # No toolkit: xcomm calls no CUDA API, so it needs none. Build against
        # torch's headers and CPU libraries directly (CMakeLists.txt, XCOMM_TORCH_DIR).
        print(
            f"xcomm: torch {torch.__version__} is a CUDA build and no CUDA toolkit was found "  # type: ignore[attr-defined]
            "(CUDA_HOME, CUDA_PATH, /usr/local/cuda); building against torch's own headers "
            "and libraries, which is all xcomm needs"
        )
        return [
            f"-DXCOMM_TORCH_DIR={Path(torch.__file__).parent}",  # type: ignore[attr-defined]
            f"-DXCOMM_TORCH_VERSION={torch.__version__.split('+')[0]}",  # type: ignore[attr-defined]
            f"-DXCOMM_TORCH_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",  # type: ignore[attr-defined]
            "-DXCOMM_TORCH_HAS_CUDA=ON",
        ]

    @staticmethod
    def _has_ninja() -> bool:
        try:
            subprocess.run(["ninja", "--version"], check=True, capture_output=True)
            return True
        except (OSError, subprocess.CalledProcessError):
            return False


setup(ext_modules=[CMakeExtension("xcomm._C")], cmdclass={"build_ext": CMakeBuild})
