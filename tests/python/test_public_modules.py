"""Every public module is reachable as the README writes it, after a plain
``import xcomm`` (issue 44: ``xcomm.diloco.DiLoCo(...)`` raised "module
'xcomm' has no attribute 'diloco'").

Each check runs in a fresh interpreter, where nothing but ``import xcomm``
has imported the package's submodules. Reference: the package's own module
list (``pkgutil``) and the dotted names the README uses.
"""

from __future__ import annotations

import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import xcomm

ROOT = Path(__file__).resolve().parents[2]
#: Modules that need an optional framework: imported by name, never by ``import xcomm``.
OPTIONAL = {"lightning": "pytorch_lightning", "torchft": "torchft"}


def _fresh(code: str) -> dict:
    """Runs ``code`` (which prints one JSON line last) in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _public_modules() -> list[str]:
    return sorted(
        m.name for m in pkgutil.iter_modules(xcomm.__path__) if not m.name.startswith("_")
    )


def test_every_public_module_is_an_attribute_after_import_xcomm() -> None:
    modules = [m for m in _public_modules() if m not in OPTIONAL]
    assert {"diloco", "hooks", "bucketer", "shm", "compat"} <= set(modules), modules
    got = _fresh(
        "import json, sys, xcomm\n"
        f"mods = {modules!r}\n"
        "print(json.dumps({\n"
        "  'missing': [m for m in mods if not hasattr(xcomm, m)],\n"
        "  'diloco': xcomm.diloco.DiLoCo.__name__,\n"
        "  'powersgd': xcomm.hooks.PowerSGDState.__name__,\n"
        f"  'optional_loaded': [m for m in {sorted(OPTIONAL.values())!r} if m in sys.modules],\n"
        "}))"
    )
    assert got["missing"] == [], got
    assert got["diloco"] == "DiLoCo" and got["powersgd"] == "PowerSGDState"
    # import xcomm stays light: no optional framework is imported with it
    assert got["optional_loaded"] == [], got


def test_dotted_names_in_readme_resolve_after_import_xcomm() -> None:
    readme = (ROOT / "README.md").read_text()
    # `xcomm.name.` or `xcomm.name(`: a module or function used as written
    names = sorted(set(re.findall(r"\bxcomm\.([a-z][a-z0-9_]*)(?=[.(])", readme)))
    assert "diloco" in names, names
    plain = [n for n in names if n not in OPTIONAL]
    got = _fresh(
        f"import json, xcomm\nprint(json.dumps([n for n in {plain!r} if not hasattr(xcomm, n)]))"
    )
    assert got == [], f"README names xcomm.{got} but import xcomm does not provide them"


def test_optional_modules_import_by_name() -> None:
    """``from xcomm.lightning import XcommStrategy``, as the README writes it."""
    for module, framework in OPTIONAL.items():
        pytest.importorskip(framework)
        got = _fresh(f"import json, xcomm.{module} as m\nprint(json.dumps(sorted(m.__all__)))")
        assert got, module
