"""Style gate: every C++ file is clang-formatted, every Python file passes ruff.

The versions are pinned by the set-up (Debian's clang-format, ``ruff`` in
requirements-dev.txt), so a formatter upgrade cannot fail this on its own.
Reference: the formatters themselves; each failure lists the files to fix
(``clang-format -i FILE``; ``ruff format`` / ``ruff check --fix``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON_DIRS = ["python", "tests/python", "examples", "xcomm_bench"]


def _tracked(*patterns: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        pytest.skip("not a git checkout: no list of tracked files")
    return out.stdout.split()


def test_cpp_files_are_clang_formatted() -> None:
    clang_format = shutil.which("clang-format")
    assert clang_format, "clang-format is missing: run scripts/setup.sh"
    files = _tracked("*.cpp", "*.hpp", "*.h", "*.cu", "*.cuh")
    assert files
    proc = subprocess.run(
        [clang_format, "--dry-run", "--Werror", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    unformatted = sorted(
        {line.split(":")[0] for line in proc.stderr.splitlines() if ": error:" in line}
    )
    assert proc.returncode == 0, f"run clang-format -i on: {unformatted or proc.stderr[-2000:]}"


def test_python_files_pass_ruff() -> None:
    ruff = [sys.executable, "-m", "ruff"]
    for args in (["check", *PYTHON_DIRS], ["format", "--check", *PYTHON_DIRS]):
        proc = subprocess.run([*ruff, *args], cwd=ROOT, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, f"ruff {args[0]}: {proc.stdout[-3000:]}{proc.stderr[-1000:]}"
