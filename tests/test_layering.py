"""The package's imports run one way and form no cycle (scripts/check_imports.py), and the
checker catches what it is there to catch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_imports.py"


def check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_drafttree_imports_have_no_cycle_and_run_down_the_layers():
    r = check()
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no cycles" in r.stdout


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        f = root / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return root / "pkg"


LAYERS = "pkg,pkg.top;pkg.low"


def test_a_clean_package_passes(tmp_path):
    pkg = write(tmp_path, {"pkg/__init__.py": "", "pkg/top.py": "from pkg.low import a\n",
                           "pkg/low/__init__.py": "", "pkg/low/a.py": "from . import b\n", "pkg/low/b.py": ""})
    r = check(str(pkg), "--layers", LAYERS)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_cycle_through_a_function_level_import_is_caught(tmp_path):
    pkg = write(tmp_path, {
        "pkg/__init__.py": "", "pkg/top.py": "", "pkg/low/__init__.py": "",
        "pkg/low/a.py": "def f():\n    from pkg.low import b\n    return b\n",   # `b` is a submodule
        "pkg/low/b.py": "from .a import f\n",                                      # relative
    })
    r = check(str(pkg), "--layers", LAYERS)
    assert r.returncode == 1
    assert "import cycle: pkg.low.a -> pkg.low.b -> pkg.low.a" in r.stdout, r.stdout
    assert "upward" not in r.stdout


def test_an_upward_import_is_caught_and_type_checking_imports_are_exempt(tmp_path):
    pkg = write(tmp_path, {
        "pkg/__init__.py": "", "pkg/top.py": "X = 1\n", "pkg/low/__init__.py": "",
        "pkg/low/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.top import X\n",
        "pkg/low/b.py": "import os\n\n\nclass C:\n    def m(self):\n        from pkg import top\n",
    })
    r = check(str(pkg), "--layers", LAYERS)
    assert r.returncode == 1
    lines = [s for s in r.stdout.splitlines() if s.startswith("upward import")]
    assert len(lines) == 1 and lines[0].startswith("upward import: pkg.low.b "), r.stdout
    assert "imports pkg.top " in lines[0] and lines[0].endswith("pkg/low/b.py:6"), lines[0]


def test_a_module_outside_every_layer_is_caught(tmp_path):
    pkg = write(tmp_path, {"pkg/__init__.py": "", "pkg/top.py": "", "pkg/low/__init__.py": "",
                           "pkg/extra.py": ""})
    r = check(str(pkg), "--layers", LAYERS)
    assert r.returncode == 1 and "not in any layer: pkg.extra" in r.stdout, r.stdout


def test_imports_between_apart_packages_are_caught(tmp_path):
    """Entries of one apart group import neither each other nor each other's modules, even in one
    layer; each may import within itself and below, and a package outside the group may import
    them all."""
    pkg = write(tmp_path, {
        "pkg/__init__.py": "", "pkg/cli.py": "from pkg.a import x\nfrom pkg.b import y\n",
        "pkg/a/__init__.py": "", "pkg/a/x.py": "from pkg.a import z\nfrom pkg.low import c\n", "pkg/a/z.py": "",
        "pkg/b/__init__.py": "", "pkg/b/y.py": "def f():\n    from pkg.a.x import g\n",
        "pkg/low/__init__.py": "", "pkg/low/c.py": "",
    })
    layers = "pkg,pkg.cli;pkg.a,pkg.b;pkg.low"
    assert check(str(pkg), "--layers", layers).returncode == 0    # apart only when told
    r = check(str(pkg), "--layers", layers, "--apart", "pkg.a,pkg.b")
    assert r.returncode == 1
    assert r.stdout.splitlines() == ["import between apart packages: pkg.b.y (pkg.b) imports pkg.a.x (pkg.a) at "
                                     "pkg/b/y.py:2; pkg.a, pkg.b import none of each other"], r.stdout
