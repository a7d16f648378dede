"""Prints (and, imported, returns) the CMake build folder for this Python and torch.

One folder per Python *and* torch version, so building against torch 2.13 and
2.14 side by side (``scripts/test.sh`` does) never mixes objects compiled
against different headers; ccache shares what it can between them.

    python scripts/build_dir.py     # -> build/cmake-py311-torch2.13
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_dir() -> Path:
    import torch

    major, minor = torch.__version__.split(".")[:2]
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    # Built against torch's files directly, not its CMake package (setup.py): other
    # CMake settings, the same C++ flags. A sibling folder, so paths relative to it
    # match and ccache serves one build from the other.
    direct = "-direct" if os.environ.get("XCOMM_NO_CUDA_TOOLKIT") == "1" else ""
    return ROOT / "build" / f"cmake-py{py}-torch{major}.{minor}{direct}"


if __name__ == "__main__":
    print(build_dir().relative_to(ROOT))
