"""Does a drafter keep its acceptance with fp8 weights? Runs `drafttree bench` twice with the same
prompts and settings: the drafter as loaded, then with `--draft-quantization fp8` (its fc, every
layer's projections and its copy of the target's LM head as float8 e4m3 with one scale per row,
`drafttree/models/quant.py`), and prints τ for each. The tokens are the target's either way.

    python benchmarks/fp8_drafter_tau.py [--out DIR] [bench args...]
"""
import argparse
import json
import sys
from pathlib import Path

from drafttree.bench.cli import main as bench


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="fp8_tau_out")
    a, rest = p.parse_known_args()
    out = Path(a.out)
    taus = {}
    for name, extra in (("as_loaded", []), ("fp8", ["--draft-quantization", "fp8"])):
        rc = bench(["--methods", "ddtree", "--out", str(out / name), *extra, *rest])
        if rc:
            return rc
        res = json.loads((out / name / "results.json").read_text())["results"]
        taus[name] = [(r["budget"], r["temperature"], round(r["tau_mean"], 3)) for r in res]
    for name, t in taus.items():
        print(f"{name}: (budget, T, tau) {t}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
