"""``--one-case-per-test`` (conftest.py): what the second torch's run keeps.

Checked on a small test file collected in a fresh pytest with the project's
conftest.py: of each parametrized test the first case that its marks leave
selected, every case of a test marked ``every_case``, and every test that is
not parametrized.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SAMPLE = """
import pytest

@pytest.mark.parametrize("x", [1, 2, 3])
def test_plain(x):
    pass

@pytest.mark.parametrize("x", [pytest.param(1, marks=pytest.mark.skipme), 2, 3])
def test_first_case_deselected(x):
    pass

@pytest.mark.every_case
@pytest.mark.parametrize("x", ["a", "b"])
def test_kept_whole(x):
    pass

def test_single():
    pass
"""


def _collected(tmp_path: Path, *options: str) -> list[str]:
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    skipme: a test mark\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            *options,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [line.split("::", 1)[1] for line in proc.stdout.splitlines() if "::" in line]


def test_one_case_per_test_keeps_the_first_selected_case_and_every_case_tests(
    tmp_path: Path,
) -> None:
    got = _collected(tmp_path, "-m", "not skipme", "--one-case-per-test")
    assert got == [
        "test_plain[1]",
        "test_first_case_deselected[2]",  # its first case was deselected by -m
        "test_kept_whole[a]",
        "test_kept_whole[b]",
        "test_single",
    ]


def test_without_the_option_every_case_is_collected(tmp_path: Path) -> None:
    assert len(_collected(tmp_path)) == 3 + 3 + 2 + 1
