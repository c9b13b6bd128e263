"""Greedy decoding speed of the default model: drafttree (plain decoding) vs transformers generate.

Same prompt (chat template applied), same number of new tokens, same dtype and device.
Usage: python benchmarks/ar_vs_transformers.py [--device cpu] [--tokens 128] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from transformers import AutoModelForCausalLM

from drafttree import LLM, SamplingParams
from drafttree.loader.default_model import default_model_dir

p = argparse.ArgumentParser()
p.add_argument("--device", default="cpu")
p.add_argument("--tokens", type=int, default=128)
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--out", default=None)
a = p.parse_args()
dtype = "float32" if a.device == "cpu" else "bfloat16"
llm = LLM(device=a.device, dtype=dtype, spec="none", max_num_seqs=1, max_model_len=2048)
prompt = llm.apply_chat_template([{"role": "user", "content": "Write quicksort in Python."}])
ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
sp = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
ours, ours_ids = [], None
for _ in range(a.repeats):
    t0 = time.perf_counter()
    out = llm.generate([ids], sp)[0]
    ours.append(a.tokens / (time.perf_counter() - t0))
    ours_ids = out.token_ids
hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=getattr(torch, dtype)).to(a.device).eval()
hf.generation_config.eos_token_id = None   # run past EOS like ignore_eos, without suppressing it
x = torch.tensor([ids], device=a.device)
theirs, hf_ids = [], None
for _ in range(a.repeats):
    t0 = time.perf_counter()
    with torch.no_grad():
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=a.tokens, min_new_tokens=a.tokens,
                        do_sample=False, pad_token_id=-1)
    theirs.append(a.tokens / (time.perf_counter() - t0))
    hf_ids = y[0, len(ids):].tolist()
res = {"date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
       "threads": torch.get_num_threads(), "device": a.device, "dtype": dtype, "prompt_tokens": len(ids),
       "new_tokens": a.tokens, "drafttree_tok_s": max(ours), "transformers_tok_s": max(theirs),
       "same_tokens": ours_ids == hf_ids}
print(json.dumps(res, indent=1))
if a.out:
    json.dump(res, open(a.out, "w"), indent=1)
