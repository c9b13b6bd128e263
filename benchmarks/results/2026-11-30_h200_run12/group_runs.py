"""CPU check behind the top-K filter's strided groups: on the default model's logits (7 prompts,
60 greedy tokens each, bf16-rounded), how many candidates each 8,192-entry chunk keeps when group
g holds runs of RUN consecutive entries, strided (RUN = 1: today's groups; RUN = 8,192 / groups:
runs of consecutive entries only). Over CAP a chunk falls back to sorting all its entries.

    python benchmarks/results/2026-11-30_h200_run12/group_runs.py     (CPU, ~20 s)
"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafttree.loader.default_model import default_model_dir
from drafttree.spec.topk_kernel import filter_plan

CHUNK = 8192
d = str(default_model_dir())
tok = AutoTokenizer.from_pretrained(d)
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
texts = ["Write a haiku about the sea.", "def quicksort(xs):\n", "北京是中国的首都，", "1, 2, 3, 4, 5, 6, 7, 8,",
         "The capital of France is", "import numpy as np\n", "Once upon a time"]
with torch.no_grad():
    seqs = [model.generate(tok(t, return_tensors="pt").input_ids, max_new_tokens=60, do_sample=False) for t in texts]
    logits = torch.cat([model(s).logits[0] for s in seqs]).to(torch.bfloat16)


def counts(x: torch.Tensor, k2: int, run: int) -> torch.Tensor:
    V, groups = x.shape[-1], filter_plan(k2, CHUNK)[0]
    nc = -(-V // CHUNK)
    pad = x.new_full((*x.shape[:-1], nc * CHUNK - V), float("-inf"), dtype=torch.float32)
    chunks = torch.cat([x.float(), pad], -1).unflatten(-1, (nc, CHUNK))
    gmax = chunks.unflatten(-1, (CHUNK // (groups * run), groups, run)).amax(-1).amax(-2)
    threshold = gmax.topk(min(k2, groups), dim=-1).values[..., -1:]
    real = (torch.arange(nc * CHUNK) < V).view(nc, CHUNK)
    return ((chunks >= threshold) & real).sum(-1)


print(f"{logits.shape[0]} positions, vocabulary {logits.shape[1]}")
print("K2  run  max kept  CAP  chunks over CAP %  mean kept")
for k2 in (8, 32, 128):
    groups, cap, _ = filter_plan(k2, CHUNK)
    for run in (r for r in (1, 2, 4, 8, 16, 32, 64) if groups * r <= CHUNK):
        c = counts(logits, k2, run)
        print(f"{k2:3d} {run:4d} {c.max().item():9d} {cap:4d} {100 * (c > cap).float().mean().item():17.2f}"
              f" {c.float().mean().item():10.1f}")
