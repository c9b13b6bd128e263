"""Kernel-level profile of rounds (which kernels dominate a decode step, a DDTree round, or its
draft phase alone) on random weights (CUDA).

    python benchmarks/profile_decode.py [--shape qwen3-8b] [--spec none|dflash|ddtree] [--batch 1]
                                        [--phase round|draft] [--draft-quantization fp8]

`round`: graphed rounds as the engine runs them. `draft`: the draft phase eagerly, the drafter's
forward and the tree build under their own labels, so their split shows in the table.
"""
import argparse

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from drafttree.engine.engine import Engine, EngineConfig
from drafttree.sampling import SampleMode, SamplingParams
from drafttree.spec_decode import rounds as R

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="qwen3-8b")
ap.add_argument("--spec", default="none")
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--phase", choices=("round", "draft"), default="round")
ap.add_argument("--draft-quantization", default=None)
ap.add_argument("--prompt-len", type=int, default=512)
args = ap.parse_args()

extra = dict(block_size=16, budget=32) if args.spec == "ddtree" else {}
if args.spec == "dflash":
    extra = dict(block_size=16)
if args.draft_quantization:
    extra["draft_quantization"] = args.draft_quantization
B, P = args.batch, args.prompt_len
# the draft phase is profiled eagerly: no graphs to capture at start-up
graphs = None if args.phase == "round" else False
eng = Engine(EngineConfig(spec=args.spec, random_weights=args.shape, max_num_seqs=B, max_model_len=2048,
                          cuda_graphs=graphs, **extra))
r = eng.runner
V = r.target.cfg.vocab_size
g = torch.Generator().manual_seed(0)
r.prefill_rows([torch.randint(0, V - 2, (P,), generator=g).tolist() for _ in range(B)],
               [SamplingParams(temperature=0.0)] * B, list(range(B)))
state = (r.state.start, r.state.bonus, r.state.ctx_n, r.state.ctx_feat)
snap = [t.clone() for t in state]
kv_len = r.round_kv_len(P)
ROUNDS = 5


def draft_only() -> None:
    with record_function("draft_forward"):
        logits = R.draft(r.round_ctx, B, kv_len)
    with record_function("tree_build"):
        R.make_tree(r.round_ctx, logits, B)


with torch.inference_mode():
    def rounds():
        for _ in range(ROUNDS):
            for t, v in zip(state, snap):   # every round from the same prefix
                t.copy_(v)
            if args.phase == "draft":
                draft_only()
            else:
                r.run_round(B, SampleMode.GREEDY, P)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    rounds()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.phase == "draft" else [])
    with profile(activities=acts) as prof:
        rounds()
drafter = args.draft_quantization or "bf16"
print(f"{args.shape}, spec {args.spec}, drafter {drafter}, {ROUNDS} {args.phase}s at batch {B}, KV bucket {kv_len}")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=90))
