"""Rewrites a CUDA source for the emulated GPU (tests/cuda_emulation).

Every launch ``kernel<<<grid, block[, shared[, stream]]>>>(args)`` becomes
``::emu::launch(kernel, grid, block[, shared[, stream]])(args)``; nothing else
changes, and a ``#line`` directive keeps compiler messages pointing at the
original file. Usage: ``python emulate_launches.py IN.cu OUT.cpp``.
"""

from __future__ import annotations

import os
import re
import sys

# A kernel name, maybe with template arguments, then the launch configuration.
LAUNCH = re.compile(r"\b([A-Za-z_]\w*(?:<[^<>;{}]*>)?)(\s*)<<<(.*?)>>>", re.DOTALL)


def rewrite(source: str) -> str:
    def launch(m: re.Match[str]) -> str:
        return f"::emu::launch({m.group(1)},{m.group(2)}{m.group(3)})"

    return LAUNCH.sub(launch, source)


def main() -> None:
    src, out = sys.argv[1], sys.argv[2]
    with open(src, encoding="utf-8") as f:
        text = f.read()
    body = rewrite(text)
    if "<<<" in body:
        raise SystemExit(f"{src}: a kernel launch emulate_launches.py could not rewrite")
    # Makefile generators do not create an OUTPUT's folder (Ninja does).
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(f'#line 1 "{src}"\n{body}')


if __name__ == "__main__":
    main()
