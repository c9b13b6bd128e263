"""Command line: drafttree generate | serve | graphs | train-drafter | bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from drafttree.engine.engine import Engine, EngineConfig
from drafttree.parallel.group import TensorParallelError, torchrun_launch


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--draft-model", default=None, help="DFlash drafter directory (default: the shipped drafter for the default model)")
    g.add_argument("--spec", choices=["none", "dflash", "ddtree"], default=None,
                   help="speculative method (default: ddtree when a drafter is available)")
    g.add_argument("--block-size", type=int, default=None, help="draft width (default: the drafter's)")
    g.add_argument("--budget", default="auto",
                   help="'auto' (the default): every round chooses the budget (DDTree nodes up to the drafter "
                        "config's ddtree_default_budget, else 32; the DFlash chain; or 0, a plain decode step) "
                        "that maximises expected tokens/s from the measured cost of each and the drafter's "
                        "predicted acceptance; N >= 1: DDTree verifies N + 1 tokens every round (DFlash: drafts every "
                        "round)")
    g.add_argument("--budget-schedule", default=None,
                   help="DDTree budget by batch bucket under load, e.g. '8:16,32:4' (batch:budget; caps with "
                        "--budget auto); budget 0 decodes plainly from that batch size on ('16:0', DFlash too); "
                        "default with a fixed budget: the drafter config's ddtree_default_budget_schedule, if any "
                        "('none' clears it)")
    g.add_argument("--speculate-sampled", action=argparse.BooleanOptionalAction, default=None,
                   help="whether rounds with a request at temperature > 0 speculate (else they decode plainly; "
                        "greedy rounds still speculate); default: the drafter config's "
                        "ddtree_default_speculate_sampled, else on")
    g.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--draft-quantization", choices=["fp8"], default=None,
                   help="the drafter's weights and its copy of the LM head as fp8 e4m3, a scale per row: the "
                        "output is unchanged, the acceptance may move; pays for large drafters only (CUDA "
                        "compute capability 8.9+, or CPU)")
    g.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    g.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs,
                   help="requests running at once (the KV page pool bounds how many contexts fit)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length per request")
    g.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="KV page pool size (default: 1 GiB on CPU, 60%% of the free memory on CUDA)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="CUDA: the share of the device's memory to use; the KV page pool gets what the weights "
                        "and CUDA graphs leave of it")
    g.add_argument("--page-size", type=int, default=EngineConfig.page_size, help="tokens per KV page")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt in full (default: requests share the KV pages of common prefixes)")
    g.add_argument("--no-cuda-graphs", action="store_true", help="run every phase eagerly")
    g.add_argument("--no-prefill-graphs", action="store_true",
                   help="run prefill eagerly (default with CUDA graphs: graphed per (rows, length bucket, "
                        "attention length), from position 0 and at offsets (prefix-cache hits, continuing "
                        "chunks), every shape the scheduler can ask for captured at start-up)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="shard the target over N ranks, one GPU each (gloo processes on the CPU): started here, "
                        "or under torchrun (--nproc-per-node, --nnodes) its processes; a size the model "
                        "cannot split (heads, MLP rows, experts) is refused, naming what it must divide")
    g.add_argument("--distributed-timeout", type=float, default=EngineConfig.distributed_timeout_s, metavar="S",
                   help="tensor parallel: a collective waiting longer than S seconds for a rank stops the engine")
    g.add_argument("--deterministic", action="store_true", default=None,
                   help="a token's logits the same bits whatever the phase, width and batch that computes it: "
                        "speculative decoding then reproduces plain decoding bit for bit on the GPU, and a "
                        "served answer can be reproduced (dense targets; costs speed, see docs/performance.md)")
    g.add_argument("--no-overlap", action="store_true",
                   help="read each round's tokens before launching the next (default on CUDA: the next round "
                        "is launched first, so the host's work between rounds overlaps the device's)")


def engine_config(a: argparse.Namespace) -> EngineConfig:
    run = torchrun_launch()
    if run is not None and a.tensor_parallel_size == 1:
        print(f"drafttree: warning: torchrun started {run.world} processes and each runs an engine of its own; "
              f"--tensor-parallel-size {run.world} shards one engine over them", file=sys.stderr)
    return EngineConfig(model=a.model, draft_model=a.draft_model, spec=a.spec, block_size=a.block_size,
                        budget=a.budget, budget_schedule=a.budget_schedule,
                        speculate_sampled=a.speculate_sampled, dtype=a.dtype,
                        draft_quantization=a.draft_quantization, device=a.device,
                        max_num_seqs=a.max_num_seqs,
                        max_model_len=a.max_model_len, kv_cache_memory_gb=a.kv_cache_memory_gb,
                        gpu_memory_utilization=a.gpu_memory_utilization, page_size=a.page_size,
                        enable_prefix_caching=not a.no_prefix_caching,
                        cuda_graphs=False if a.no_cuda_graphs else None,
                        prefill_graphs=False if a.no_prefill_graphs else None,
                        overlap=False if a.no_overlap else None, tensor_parallel_size=a.tensor_parallel_size,
                        distributed_timeout_s=a.distributed_timeout, deterministic=a.deterministic)


def cmd_generate(a: argparse.Namespace) -> int:
    from drafttree.engine.launch import follow, start_engine

    eng = start_engine(engine_config(a))
    if not eng.leader:   # a torchrun rank other than 0
        return follow(eng)
    try:
        return _generate(a, eng)
    finally:
        eng.shutdown()


def _generate(a: argparse.Namespace, eng: Engine) -> int:
    from drafttree.loader.chat_template import apply_chat_template, has_chat_template
    from drafttree.sampling import SamplingParams

    prompt = a.prompt
    tok = eng.tokenizer
    if not a.raw and has_chat_template(tok):
        prompt = apply_chat_template(tok, [{"role": "user", "content": prompt}])
    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                            max_tokens=a.max_tokens)
    eng.stream_text = not a.json
    seq = eng.add_request(prompt, params)
    shown = 0
    while not seq.finished:
        eng.step()
        if not a.json and tok is not None:
            sys.stdout.write(seq.text[shown:])
            sys.stdout.flush()
            shown = len(seq.text)
    t = seq.timings()
    n = len(seq.output_ids)
    summary = {"text": seq.text if tok is not None else None, "token_ids": seq.output_ids,
               "finish_reason": seq.finish_reason, "prompt_tokens": len(seq.prompt_ids),
               "completion_tokens": n, "spec": eng.spec.method, "block_size": eng.spec.block_size,
               "budget": "auto" if eng.spec.adaptive else eng.spec.budget,
               "budget_histogram": dict(sorted(eng.stats.budget_hist.items())), "rounds": seq.stats.rounds,
               "mean_accept_length": round(seq.stats.mean_accept_length, 3),
               "accept_histogram": seq.stats.histogram, **{k: round(v, 4) for k, v in t.items()}}
    if a.json:
        print(json.dumps(summary))
    else:
        if tok is None:
            print(seq.output_ids)
        tau = f", mean accepted length {summary['mean_accept_length']}" if eng.spec.speculative else ""
        print(f"\n\n[{n} tokens in {t['total_s']:.2f} s: {t['tokens_per_s']:.1f} tokens/s "
              f"(decode {t['decode_tokens_per_s']:.1f} tokens/s), {eng.spec.method}{tau}]", file=sys.stderr)
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    from drafttree.server.app import run_server
    from drafttree.server.limits import ServerLimits
    run_server(engine_config(a), a.host, a.port, a.served_model_name, ServerLimits(a.max_request_bytes))
    return 0


def cmd_graphs(a: argparse.Namespace) -> int:
    """Print the CUDA graph capture plan and the memory plan per GPU from the configs alone (no
    weights, no GPU); with --costs, start the engine and print the cost model it measured."""
    from drafttree.engine.memory_plan import Device
    from drafttree.engine.plan import describe_plan
    cuda_total = None
    if a.gpu_memory_gb is None:
        import torch
        cuda_total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else None
    print(describe_plan(engine_config(a), Device.of(a.gpu_memory_gb, cuda_total)))
    if a.costs:
        from drafttree.engine.launch import follow, start_engine
        eng = start_engine(engine_config(a))
        if not eng.leader:
            return follow(eng)
        print(eng.costs.format() if eng.costs is not None else "no cost model: the budget is fixed")
        eng.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "train-drafter":
        from drafttree.train.cli import main as train_main
        return train_main(argv[1:])
    if argv and argv[0] == "bench":
        from drafttree.bench.cli import main as bench_main
        return bench_main(argv[1:])
    p = argparse.ArgumentParser(prog="drafttree", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt, streamed")
    g.add_argument("prompt")
    add_model_args(g)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="larger request bodies are refused (413) before they are read (default 4 MiB)")
    gr = sub.add_parser("graphs", help="print the CUDA graph capture plan and the memory plan per GPU (no GPU "
                                         "or weights needed: a directory with config.json is enough)")
    add_model_args(gr)
    gr.add_argument("--gpu-memory-gb", type=float, default=None, metavar="GIB",
                    help="plan for GPUs of this much memory (GiB; default: this machine's CUDA device, else an "
                         "H200: 139 GiB, as the output says)")
    gr.add_argument("--costs", action="store_true",
                    help="also load the models, capture the graphs and print the measured cost model")
    sub.add_parser("train-drafter", help="train a DFlash drafter (see drafttree train-drafter --help)")
    sub.add_parser("bench", help="AR vs DFlash vs DDTree benchmark (see drafttree bench --help)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.cmd == "serve" else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return {"generate": cmd_generate, "serve": cmd_serve, "graphs": cmd_graphs}[a.cmd](a)
    except (ValueError, FileNotFoundError) as e:
        print(f"drafttree: error: {e}", file=sys.stderr)
        return 2
    except TensorParallelError as e:
        print(f"drafttree: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
