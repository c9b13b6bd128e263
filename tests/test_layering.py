"""The package's imports run one way and form no cycle (scripts/check_imports.py), and the
checker catches what it is there to catch. Around the package, imports run one way too: nothing
outside tests/ imports `tests`, and no module of tests/ imports a test module."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_imports.py"


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


# -- around the package: tests/ is a leaf, and its test modules stand alone ---------------------------

def imported(f: Path, root: Path) -> list[tuple[tuple[str, ...], int]]:
    """The imports anywhere in a file as (the names it may refer to, line), relative ones resolved
    from the file's place under `root`: `import a.b` gives (a.b,), `from a import b` (a, a.b)."""
    package = list(f.relative_to(root).parent.parts)
    out: list[tuple[tuple[str, ...], int]] = []
    for node in ast.walk(ast.parse(f.read_text(), str(f))):
        if isinstance(node, ast.Import):
            out += [((a.name,), node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package[:len(package) - node.level + 1] if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            out += [((base, f"{base}.{a.name}"), node.lineno) for a in node.names]
    return out


def one_way_problems(root: Path) -> list[str]:
    """A module of benchmarks/, drafttree/ or scripts/ that imports `tests`, and a module of tests/
    that imports a test module (tests/**/test_*.py: pytest runs each by itself; what several share
    belongs in a helper module)."""
    out = set()
    for top in ("benchmarks", "drafttree", "scripts"):
        for f in sorted((root / top).rglob("*.py")):
            for names, line in imported(f, root):
                if names[0] == "tests" or names[0].startswith("tests."):
                    out.add(f"{f.relative_to(root)}:{line} imports {names[0]}")
    for f in sorted((root / "tests").rglob("*.py")):
        for names, line in imported(f, root):
            for name in names:
                target = root.joinpath(*name.split(".")).with_suffix(".py")
                if name.startswith("tests.") and target.name.startswith("test_") and target.is_file() and target != f:
                    out.add(f"{f.relative_to(root)}:{line} imports the test module {name}")
    return sorted(out)


def test_nothing_imports_tests_and_no_test_module_imports_another():
    assert one_way_problems(ROOT) == []


def test_imports_of_tests_and_of_test_modules_are_caught(tmp_path):
    write(tmp_path, {
        "benchmarks/b.py": "import sys\nfrom tests.tiny import make_target\n",
        "drafttree/__init__.py": "", "drafttree/x/y.py": "def f():\n    import tests.helpers\n",
        "scripts/s.py": "from drafttree import x\n",
        "tests/__init__.py": "", "tests/helpers.py": "def test_like():\n    pass\n",
        "tests/test_a.py": "from tests.test_b import f\nfrom tests.helpers import test_like\n",
        "tests/test_b.py": "from . import test_c\nfrom .helpers import test_like\n\n\ndef f():\n    pass\n",
        "tests/test_c.py": "from tests import helpers\n",
        "tests/sub/__init__.py": "", "tests/sub/util.py": "from ..test_a import f\n",
    })
    assert one_way_problems(tmp_path) == [
        "benchmarks/b.py:2 imports tests.tiny",
        "drafttree/x/y.py:2 imports tests.helpers",
        "tests/sub/util.py:1 imports the test module tests.test_a",
        "tests/test_a.py:1 imports the test module tests.test_b",
        "tests/test_b.py:1 imports the test module tests.test_c",
    ]
