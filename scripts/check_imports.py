#!/usr/bin/env python3
"""Check the package's imports: no import cycles, and every import runs down the layer order.

Reads every module with `ast` (nothing is imported or run) and collects its imports of the
package's own modules, at module level and inside functions, methods and classes alike: an import
inside a function still ties the two modules together, it only hides the tie until the call.
Relative imports are resolved, and `from pkg.a import b` counts as an import of `pkg.a.b` when
that is a module. Imports under `if TYPE_CHECKING:` are exempt: they never run, and they name
types only. Dynamic imports (`importlib.import_module`) are not seen.

A module may import modules of its own layer or of a layer below it (LAYERS, top first). Every
module must belong to a layer: a new package is placed in the order before it is used.

Some packages are parts of their own (APART: groups of entries, matched as LAYERS' are): a module
under one entry of a group may not import a module under another entry of the same group, whatever
their layers. What two of them share moves to a module below both.

Usage: python3 scripts/check_imports.py [PACKAGE_DIR] [--layers 'a.x,a.y;a.z;...'] [--apart 'a.x,a.y;...']
                                        [--edges]
Prints one line per problem and exits 1 when there is any; 0 and a summary line otherwise.
"""
from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

# drafttree's layers, top first. Entry points and the side packages (a benchmark, the trainer, the
# server) sit above the engine and may import anything below them; nothing in the engine's stack
# imports them. `drafttree` alone is the package's __init__ (its names load lazily). The bottom
# layer imports nothing above it: the config modules, prompt files (the trainer's and the
# benchmarks'), the tiny random targets (the tests' and the host-side benchmarks').
LAYERS: tuple[tuple[str, ...], ...] = (
    ("drafttree", "drafttree.cli", "drafttree.__main__", "drafttree.entry"),
    ("drafttree.server", "drafttree.bench", "drafttree.train"),
    ("drafttree.llm",),
    ("drafttree.engine",),
    ("drafttree.runner", "drafttree.loader"),
    ("drafttree.spec_decode", "drafttree.sampling", "drafttree.structured"),
    ("drafttree.models",),
    ("drafttree.kernels", "drafttree.parallel"),
    ("drafttree.config", "drafttree.moe_config", "drafttree.phases", "drafttree.settings", "drafttree.prompts",
     "drafttree.tiny_target", "drafttree.version", "drafttree.device_start"),
)

# The side packages are apart: each stands on the engine, none on another.
APART: tuple[tuple[str, ...], ...] = (
    ("drafttree.server", "drafttree.bench", "drafttree.train"),
)


@dataclass
class Graph:
    root: str                                    # the package's name
    base: Path                                   # the directory that holds the package
    files: dict[str, Path] = field(default_factory=dict)            # module -> file
    edges: dict[tuple[str, str], int] = field(default_factory=dict)  # (importer, imported) -> line

    def targets(self, module: str) -> list[str]:
        return sorted(b for a, b in self.edges if a == module)


def module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def collect(package: Path) -> Graph:
    """Every module of the package (a directory with __init__.py) and its imports of the package."""
    package = package.resolve()
    g = Graph(package.name, package.parent)
    for f in sorted(package.rglob("*.py")):
        g.files[module_name(f, package.parent)] = f
    for mod, f in g.files.items():
        here = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        for name, line in _imports(ast.parse(f.read_text(), str(f)), here):
            target = _known(g, name)
            if target is not None and target != mod:
                g.edges[(mod, target)] = min(line, g.edges.get((mod, target), line))
    return g


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
           (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, here: str) -> list[tuple[tuple[str, ...], int]]:
    """The imports in the tree as (names to try, first that is a module wins; line), skipping
    `if TYPE_CHECKING:` bodies: `import a.b` gives ('a.b',), `from a import b` ('a.b', 'a')."""
    out: list[tuple[tuple[str, ...], int]] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            out += [((a.name,), node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:   # relative: from the importing module's package, level - 1 up
                up = here.split(".")
                base = ".".join(up[:len(up) - (node.level - 1)] + ([node.module] if node.module else []))
            out += [((f"{base}.{a.name}", base), node.lineno) for a in node.names]
        todo.extend(ast.iter_child_nodes(node))
    return out


def _known(g: Graph, names: tuple[str, ...]) -> str | None:
    """The package module an import refers to: the first name that is a module, else the longest
    module prefix of the last one; None outside the package."""
    if names[0].split(".")[0] != g.root:
        return None
    for name in names:
        if name in g.files:
            return name
    parts = names[-1].split(".")
    while parts and ".".join(parts) not in g.files:
        parts.pop()
    return ".".join(parts) or None


def entry_of(module: str, groups: tuple[tuple[str, ...], ...], root: str) -> tuple[int, str] | None:
    """(group index, entry) of the longest entry that names the module or a package above it (the
    root entry names the package's __init__ alone); None when no entry does."""
    best: tuple[int, str] | None = None
    for i, entries in enumerate(groups):
        for e in entries:
            hit = module == e or (e != root and module.startswith(e + "."))
            if hit and (best is None or len(e) > len(best[1])):
                best = (i, e)
    return best


def layer_of(module: str, layers: tuple[tuple[str, ...], ...], root: str) -> int | None:
    """Index of the layer whose longest matching entry names the module or a package above it."""
    hit = entry_of(module, layers, root)
    return hit[0] if hit else None


def cycles(g: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    succ = {m: g.targets(m) for m in g.files}
    for start in sorted(g.files):
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(succ[v]):
                work.append((v, i + 1))
                w = succ[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return sorted(out)


def cycle_path(g: Graph, comp: list[str]) -> list[str]:
    """One closed import path through a component, from its first module back to it."""
    members, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in g.targets(v):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def problems(g: Graph, layers: tuple[tuple[str, ...], ...], apart: tuple[tuple[str, ...], ...] = ()) -> list[str]:
    out = []
    rel = lambda m: g.files[m].relative_to(g.base)  # noqa: E731

    def where(a: str, b: str) -> str:
        return f"{rel(a)}:{g.edges[(a, b)]}"

    for m in sorted(g.files):
        if layer_of(m, layers, g.root) is None:
            out.append(f"not in any layer: {m} ({rel(m)}); add it to LAYERS")
    for comp in cycles(g):
        path = cycle_path(g, comp)
        sites = ", ".join(where(a, b) for a, b in zip(path, path[1:]))
        out.append(f"import cycle: {' -> '.join(path)} ({sites})")
    for (a, b) in sorted(g.edges):
        la, lb = layer_of(a, layers, g.root), layer_of(b, layers, g.root)
        if la is not None and lb is not None and lb < la:
            out.append(f"upward import: {a} (layer {la}: {', '.join(layers[la])}) imports {b} "
                       f"(layer {lb}: {', '.join(layers[lb])}) at {where(a, b)}")
        pa, pb = entry_of(a, apart, g.root), entry_of(b, apart, g.root)
        if pa and pb and pa[0] == pb[0] and pa[1] != pb[1]:
            out.append(f"import between apart packages: {a} ({pa[1]}) imports {b} ({pb[1]}) at {where(a, b)}; "
                       f"{', '.join(apart[pa[0]])} import none of each other")
    return out


def parse_layers(text: str) -> tuple[tuple[str, ...], ...]:
    """'a,b;c;d' -> (('a', 'b'), ('c',), ('d',)): layers top first, entries of one layer by commas."""
    return tuple(tuple(e.strip() for e in layer.split(",") if e.strip()) for layer in text.split(";") if layer.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("package", nargs="?", default=str(Path(__file__).resolve().parent.parent / "drafttree"))
    p.add_argument("--layers", default=None, help="the layer order, top first: 'a.x,a.y;a.z;...'")
    p.add_argument("--apart", default=None, help="groups of packages none of which imports another: 'a.x,a.y;...'")
    p.add_argument("--edges", action="store_true", help="also print every import found")
    a = p.parse_args(argv)
    layers = parse_layers(a.layers) if a.layers else LAYERS
    apart = parse_layers(a.apart) if a.apart is not None else APART
    g = collect(Path(a.package))
    if a.edges:
        for (x, y), line in sorted(g.edges.items()):
            print(f"{x} -> {y}  (line {line})")
    found = problems(g, layers, apart)
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} problem(s) in {g.root}'s imports", file=sys.stderr)
        return 1
    print(f"{g.root}: {len(g.files)} modules, {len(g.edges)} imports, no cycles, all imports run down "
          f"{len(layers)} layers, none between apart packages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
