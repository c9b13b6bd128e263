"""Code-heavy training prompts from Python source installed on this machine (the standard library
by default): every public function or method with a docstring becomes one request to write it
from its docstring, explain it, test it, review it or annotate it. The target answers them in
regeneration like any prompt, so the drafter sees the target's own code. Parsed with `ast`, never
imported. No evaluation set is read (HumanEval stays out of training).
"""
from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Folders whose code is tests, demos, or kept only for old releases.
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages",
                       "dist-packages", "__pycache__", "venv"})

# (task, template): {kind} (function or method), {name} (Class.method for a method), {signature},
# {doc} and {source} (the code, its docstring left out for "annotate", whose answer writes one).
TASKS: tuple[tuple[str, str], ...] = (
    ("write", "Write a Python {kind} `{name}{signature}` that does the following:\n\n{doc}"),
    ("explain", "Explain what this Python code does, step by step:\n\n```python\n{source}\n```"),
    ("test", "Write pytest unit tests for this function, covering its edge cases:\n\n```python\n{source}\n```"),
    ("review", "Review this Python function: point out bugs, unclear parts and edge cases, then give an "
               "improved version.\n\n```python\n{source}\n```"),
    ("annotate", "Add type hints and a docstring to this Python function:\n\n```python\n{source}\n```"),
)


@dataclass(frozen=True)
class CodeUnit:
    """One function or method: where it is, its signature, docstring and source (dedented)."""
    module: str
    name: str
    signature: str
    doc: str
    source: str
    bare: str       # the source without its docstring


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"({ast.unparse(node.args)}){ret}"


def _without_docstring(lines: list[str], first: int, node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The function's source lines from `first` (its first decorator's) with its docstring's lines
    left out (`pass` if nothing remains)."""
    doc = node.body[0]
    kept = lines[first - 1:doc.lineno - 1] + lines[doc.end_lineno:node.end_lineno]
    if len(node.body) == 1:
        kept.append(lines[doc.lineno - 1][:doc.col_offset] + "pass")
    return textwrap.dedent("\n".join(kept)).strip()


def _units_in(path: Path, module: str, min_doc: int, max_lines: int) -> Iterator[CodeUnit]:
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return
    lines = text.splitlines()
    found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((node.name, node))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            found += [(f"{node.name}.{f.name}", f) for f in node.body
                      if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for qualname, fn in found:
        doc = ast.get_docstring(fn)
        if fn.name.startswith("_") or not doc or len(doc) < min_doc:
            continue
        first = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
        if not 3 <= fn.end_lineno - first + 1 <= max_lines:
            continue
        source = textwrap.dedent("\n".join(lines[first - 1:fn.end_lineno])).strip()
        yield CodeUnit(module, qualname, _signature(fn), doc.strip(), source, _without_docstring(lines, first, fn))


def code_units(roots: list[Path] | None = None, min_doc: int = 40, max_lines: int = 60) -> list[CodeUnit]:
    """Every public function and public class's public method under `roots` (default: the
    standard library) with a docstring of at least `min_doc` characters and at most `max_lines`
    lines, in file order; test, demo and legacy folders skipped."""
    units: list[CodeUnit] = []
    for root in roots or [stdlib_root()]:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
                continue
            module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
            units += _units_in(path, module, min_doc, max_lines)
    return units


def code_prompts(n: int | None, seed: int = 0, roots: list[Path] | None = None,
                 max_chars: int = 4000) -> tuple[list[str], dict[str, int]]:
    """Up to `n` prompts (None: one per unit), each a different unit with a task drawn with
    `seed`, and the count per task. Deterministic for a seed and the installed sources."""
    units = code_units(roots)
    rng = random.Random(seed)
    rng.shuffle(units)
    prompts: list[str] = []
    counts: dict[str, int] = {task: 0 for task, _ in TASKS}
    seen: set[str] = set()
    for u in units:
        if n is not None and len(prompts) >= n:
            break
        task, template = TASKS[rng.randrange(len(TASKS))]
        text = template.format(kind="method" if "." in u.name else "function", name=u.name,
                               signature=u.signature, doc=u.doc, source=u.bare if task == "annotate" else u.source)
        if len(text) > max_chars or text in seen:
            continue
        seen.add(text)
        prompts.append(text)
        counts[task] += 1
    return prompts, counts
