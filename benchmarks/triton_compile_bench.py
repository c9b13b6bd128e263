"""Seconds Triton takes to compile the draft top-K's chunk kernel for a GPU, on a machine without one.

A cold start pays every kernel variant's compile (the start-up report's "Triton: N first uses"
notes name them); this times one, `topk_kernel._chunk_kernel` at the K2 the default pair uses,
compiled ahead of time for a target (default sm_90) with an empty cache per compile, in each
tree given (`--tree name=path`, alternated, each compile in its own process).

    python benchmarks/triton_compile_bench.py --tree before=<old checkout> --tree after=. --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tree_runs import run_in_tree

# Run inside each tree's process: compile the chunk kernel once per K2 and print the seconds.
_CHILD = r"""
import json, sys, time
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from drafttree.kernels import topk_kernel as tk
from drafttree.kernels.triton_jit import jit_kernel
arch, k2s = int(sys.argv[1]), [int(k) for k in sys.argv[2].split(",")]
fn = jit_kernel(tk._chunk_kernel, False)
out = {}
for k2 in k2s:
    groups, cap, rank = tk.filter_plan(k2, tk.CHUNK)
    const = {"CHUNK": tk.CHUNK, "K2": k2, "FILTER": tk.FILTERED, "GROUPS": groups, "CAP": cap, "RANK": rank}
    if "SLICE" in fn.arg_names:
        const["SLICE"] = min(tk.CHUNK, max(tk.SLICE, k2))
    types = {"x_ptr": "*bf16", "key_ptr": "*i64", "m_ptr": "*fp32", "s_ptr": "*fp32", "scr_ptr": "*i32",
             "V": "i32", "NC": "i32"}
    sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    t = time.perf_counter()
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": tk.CHUNK_WARPS})
    out[k2] = {"seconds": time.perf_counter() - t, "ptx_chars": len(kernel.asm.get("ptx", ""))}
out["triton"] = triton.__version__
print(json.dumps(out))
"""


def compile_once(tree: Path, arch: int, k2s: list[int], python: str) -> tuple[dict[str, dict[str, float]], str]:
    """Seconds and PTX size per K2 of one process's compiles in `tree`, and its Triton's version."""
    with tempfile.TemporaryDirectory() as cache:
        out = run_in_tree(tree, _CHILD, (str(arch), ",".join(map(str, k2s))), python,
                          env={"TRITON_CACHE_DIR": cache, "TRITON_DEFAULT_FP_FUSION": "1"})
    version = out.pop("triton")
    return out, version


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="name=path of a checkout")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    ap.add_argument("--k2", default="8,32", help="K2 values (the top-K rounded up to a power of two)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that compiles (another Triton's)")
    ap.add_argument("--out", type=Path, default=Path("triton_compile.json"))
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    k2s = [int(k) for k in args.k2.split(",")]
    runs, versions = [], set()
    for rep in range(args.reps):
        for name, path in trees.items():   # alternated, so that a busy machine slows both alike
            results, version = compile_once(Path(path), args.arch, k2s, args.python)
            versions.add(version)
            for k2, r in results.items():
                runs.append({"tree": name, "rep": rep, "k2": int(k2), **r})
                print(f"{name:8s} rep {rep}  K2 {k2:>3}  {r['seconds']:6.2f} s  ptx {r['ptx_chars']:>9,} chars",
                      flush=True)
    summary = {}
    print(f"\n{'tree':8s} {'K2':>3}  median s  min s  max s")
    for name in trees:
        for k2 in k2s:
            s = [r["seconds"] for r in runs if r["tree"] == name and r["k2"] == k2]
            summary[f"{name} K2={k2}"] = {"median": statistics.median(s), "min": min(s), "max": max(s)}
            print(f"{name:8s} {k2:>3}  {statistics.median(s):8.2f} {min(s):6.2f} {max(s):6.2f}")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "cpus": os.cpu_count(),
            "triton": sorted(versions), "arch": args.arch, "trees": trees}
    args.out.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
