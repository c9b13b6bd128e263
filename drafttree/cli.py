"""Command line: drafttree generate | serve | graphs | train-drafter | bench."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from drafttree.engine.cli_args import add_engine_args, config_from_args, serving_fields
from drafttree.engine.engine import Engine, EngineConfig
from drafttree.parallel.group import TensorParallelError, torchrun_launch


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags: one per EngineConfig field the serving commands take (`engine.cli_args`)."""
    add_engine_args(p.add_argument_group("engine"), serving_fields())


def engine_config(a: argparse.Namespace) -> EngineConfig:
    cfg = config_from_args(a)
    run = torchrun_launch()
    if run is not None and cfg.tensor_parallel_size == 1:
        print(f"drafttree: warning: torchrun started {run.world} processes and each runs an engine of its own; "
              f"--tensor-parallel-size {run.world} shards one engine over them", file=sys.stderr)
    return cfg


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
    stats = eng.stats
    summary = {"text": seq.text if tok is not None else None, "token_ids": seq.output_ids,
               "finish_reason": seq.finish_reason, "prompt_tokens": len(seq.prompt_ids),
               "completion_tokens": n, "spec": eng.spec.method, "block_size": eng.spec.block_size,
               "budget": "auto" if eng.spec.adaptive else eng.spec.budget,
               "budget_histogram": dict(sorted(stats.budget_hist.items())), "plain_rounds": dict(stats.plain_rounds),
               "rounds": seq.stats.rounds,
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
    a = build_parser().parse_args(argv)
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


def build_parser() -> argparse.ArgumentParser:
    """generate, serve and graphs (train-drafter and bench parse their own arguments)."""
    p = argparse.ArgumentParser(prog="drafttree", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    plan = ("Memory per GPU for these flags (weights by kind, KV bytes per token, KV tokens that fit): drafttree "
            "graphs with the same model flags, no GPU needed; the engine logs it at start-up and refuses weights that "
            "cannot fit.")
    g = sub.add_parser("generate", help="generate a completion for one prompt, streamed", description=plan)
    g.add_argument("prompt")
    add_model_args(g)
    g.add_argument("--max-tokens", type=int, default=256, help="output tokens at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass (1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: off)")
    g.add_argument("--seed", type=int, default=None, help="the sampler's seed (default: a random one)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server", description=plan)
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: --model as given, or the default model's)")
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
    return p


if __name__ == "__main__":
    raise SystemExit(main())
