"""Does a drafter keep its acceptance with fp8 weights? Writes a copy of a drafter whose projection
weights (fc and every layer's q/k/v/o and MLP) went through float8 e4m3 with one absmax scale per
output row and back (what a weight-only fp8 kernel would read), then runs `drafttree bench` with
both drafters, same prompts and settings, and prints τ for each. Norms stay as they are; the LM
head is the target's (not part of a DFlash checkpoint) and is not quantized here.

    python benchmarks/fp8_drafter_tau.py [--draft-model DIR] [--out DIR] [bench args...]
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drafttree.bench.cli import main as bench
from drafttree.engine.plan import SHIPPED_DRAFTER

E4M3_MAX = 448.0


def fp8_round_trip(w: torch.Tensor) -> torch.Tensor:
    """w through e4m3 with a scale per output row (absmax -> 448), back in w's dtype."""
    scale = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return ((w.float() / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)


def quantized_copy(src: Path, dst: Path) -> int:
    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = load_file(str(src / "model.safetensors"))
    n = 0
    for name, w in weights.items():
        if w.dim() == 2 and (name.endswith("proj.weight") or name == "fc.weight"):
            weights[name] = fp8_round_trip(w)
            n += 1
    save_file(weights, str(dst / "model.safetensors"))
    return n


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--draft-model", default=str(SHIPPED_DRAFTER))
    p.add_argument("--out", default="fp8_tau_out")
    a, rest = p.parse_known_args()
    out = Path(a.out)
    fp8 = out / "drafter-fp8"
    n = quantized_copy(Path(a.draft_model), fp8)
    print(f"{n} projection weights through e4m3 -> {fp8}")
    taus = {}
    for name, d in (("bf16", a.draft_model), ("fp8", str(fp8))):
        rc = bench(["--draft-model", d, "--methods", "ddtree", "--out", str(out / name), *rest])
        if rc:
            return rc
        res = json.loads((out / name / "results.json").read_text())["results"]
        taus[name] = [(r["budget"], r["temperature"], round(r["tau_mean"], 3)) for r in res]
    for name, t in taus.items():
        print(f"{name}: (budget, T, tau) {t}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
