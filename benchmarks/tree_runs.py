"""Run a Python snippet in a given checkout's drafttree: what the benchmarks that compare source
trees (`--tree before=DIR --tree after=.`) time in each, a fresh process a run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# after the snippet: it must have run the tree's own drafttree, not an installed or checked-out one
_CHECK = "\nimport drafttree as _d, pathlib as _p\nassert _p.Path(_d.__file__).resolve().is_relative_to({tree!r}), _d.__file__\n"


def run_in_tree(tree: Path, code: str, args: tuple[str, ...] = (), python: str = sys.executable,
                env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `code` with `tree` first on the path (from a temporary directory, whose name shadows no
    package, as a checkout's would) and return the JSON object its last line of output prints."""
    tree = tree.resolve()
    full_env = {**os.environ, **(env or {}),
                "PYTHONPATH": str(tree) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([python, "-c", code + _CHECK.format(tree=str(tree)), *args], cwd=tempfile.gettempdir(),
                       env=full_env, capture_output=True, text=True, check=False)
    lines = r.stdout.strip().splitlines()
    if r.returncode or not lines:
        raise SystemExit(f"the run in {tree} failed:\n{r.stderr[-3000:]}")
    return json.loads(lines[-1])
