"""One-process check that an installed xcomm imports and reduces.

    python scripts/smoke.py [--expect-cuda-path] [--expect-cuda-codecs | --expect-no-cuda-codecs]

Creates a world-size-1 xcomm group, all-reduces a CPU tensor and checks the
result; with ``--expect-cuda-path`` also that the build has its CUDA path
(``xcomm._C.built_with_cuda``); with ``--expect-cuda-codecs`` (or
``--expect-no-cuda-codecs``) that it has (or has not) compiled the codecs'
CUDA kernels (``xcomm._C.cuda_codecs``). Exits non-zero, naming what failed.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist


def main() -> int:
    import xcomm

    print(f"xcomm from {os.path.dirname(xcomm.__file__)}, torch {torch.__version__}")
    if "--expect-cuda-path" in sys.argv and not xcomm._C.built_with_cuda:
        print("smoke: this build has no CUDA path, but torch has CUDA")
        return 1
    kernels = xcomm._C.cuda_codecs
    print(f"CUDA codec kernels: {kernels}")
    if "--expect-cuda-codecs" in sys.argv and not kernels:
        print("smoke: this build has no CUDA codec kernels, but a CUDA toolkit was there")
        return 1
    if "--expect-no-cuda-codecs" in sys.argv and kernels:
        print("smoke: this build has CUDA codec kernels, but no CUDA toolkit was to be used")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(
            "xcomm", init_method="file://" + os.path.join(tmp, "store"), rank=0, world_size=1
        )
        try:
            t = torch.arange(6, dtype=torch.float32)
            dist.all_reduce(t)
            if not torch.equal(t, torch.arange(6, dtype=torch.float32)):
                print(f"smoke: all_reduce over one rank changed the tensor: {t}")
                return 1
        finally:
            dist.destroy_process_group()
    print("smoke: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
