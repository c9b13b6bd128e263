"""Command line: drafttree generate | serve | graphs | cache | train-drafter | bench."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Any

from drafttree.engine.cli_args import add_engine_args, config_from_args, serving_fields
from drafttree.engine.engine import Engine, EngineConfig
from drafttree.parallel.group import TensorParallelError, torchrun_launch

# What `generate` captures, unless its flags say otherwise: its one request is a batch of one,
# in one sampler mode, of a known length, and prefills once (eagerly: a graph would not repay
# its capture). Graphs the run cannot use would cost start-up time and nothing else.
GENERATE_DEFAULTS = {"max_num_seqs": 1}
GENERATE_TEXTS = {"sampler_modes": "the one mode the sampling flags give",
                  "prefill_graphs": "off: one prompt prefills once",
                  "structured_graphs": "off: its request is not constrained",
                  "processed_graphs": "off: its request asks for no logits processing",
                  "max_graph_len": "the prompt's tokens and --max-tokens"}


def add_model_args(p: argparse.ArgumentParser, defaults: dict | None = None, texts: dict | None = None) -> None:
    """The engine's flags: one per EngineConfig field the serving commands take (`engine.cli_args`)."""
    add_engine_args(p.add_argument_group("engine"), serving_fields(), defaults=defaults, default_texts=texts)


def engine_config(a: argparse.Namespace) -> EngineConfig:
    cfg = config_from_args(a)
    run = torchrun_launch()
    if run is not None and cfg.tensor_parallel_size == 1:
        print(f"drafttree: warning: torchrun started {run.world} processes and each runs an engine of its own; "
              f"--tensor-parallel-size {run.world} shards one engine over them", file=sys.stderr)
    return cfg


def cmd_generate(a: argparse.Namespace) -> int:
    from drafttree.engine.launch import follow, start_engine

    if a.raw and not a.prompt:   # refused before the model is loaded, as the engine would after
        raise ValueError("the prompt is empty (0 tokens)")
    generate_settings()
    eng = start_engine(*generate_config(engine_config(a), a))
    if not eng.leader:   # a torchrun rank other than 0
        return follow(eng)
    try:
        return _generate(a, eng)
    finally:
        eng.shutdown()


def generate_settings() -> None:
    """`generate` runs the small fused pieces as torch ops unless DRAFTTREE_COMPILE says otherwise.
    A process that decodes one request pays torch.compile's tracing of every piece at every shape
    it meets (its eager prefill's included) on each start, warm caches or not: more than the
    fused pieces then save over one request. (The ranks its engine spawns take its settings.)"""
    from drafttree.settings import env_name, install, process_default
    if not os.environ.get(env_name("compile")):
        install(process_default().replace(compile="0"))


def _params(a: argparse.Namespace):
    from drafttree.sampling import SamplingParams
    return SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                          max_tokens=a.max_tokens)


def _prompt(a: argparse.Namespace, tok) -> str:
    """The prompt as the engine gets it: in the chat template, unless --raw or none."""
    from drafttree.loader.chat_template import apply_chat_template, has_chat_template
    if not a.raw and has_chat_template(tok):
        return apply_chat_template(tok, [{"role": "user", "content": a.prompt}])
    return a.prompt


def generate_config(cfg: EngineConfig, a: argparse.Namespace) -> tuple[EngineConfig, Any]:
    """`generate`'s engine: graphs for its request's sampler mode and, with CUDA graphs, its
    length only (counted with the model's tokenizer); no prefill graphs. A flag given says
    otherwise. Returns the config and the tokenizer it loaded to count (None: none), which the
    engine then takes instead of loading its own."""
    from drafttree.config import resolve_device
    from drafttree.engine.plan import may_choose_budget
    from drafttree.sampling import SampleMode

    changes: dict = {}
    graphed = cfg.cuda_graphs is not False and resolve_device(cfg.device).type == "cuda"
    # The mode chooses the graphs captured and the modes the cost model times: an engine with
    # neither is not given one (the engine warns of an option that takes no effect).
    if cfg.sampler_modes is None and (graphed or may_choose_budget(cfg)):
        changes["sampler_modes"] = (SampleMode.of([_params(a)]).name.lower(),)
    if cfg.prefill_graphs is None:
        changes["prefill_graphs"] = False
    if cfg.structured_graphs is None:
        changes["structured_graphs"] = False
    if cfg.processed_graphs is None:
        changes["processed_graphs"] = False
    tok = None
    if cfg.max_graph_len is None and graphed:
        tok = _tokenizer(cfg)
        if tok is not None:
            changes["max_graph_len"] = len(tok.encode(_prompt(a, tok), add_special_tokens=False)) + a.max_tokens
    return dataclasses.replace(cfg, **changes), tok


def _tokenizer(cfg: EngineConfig) -> Any:
    from drafttree.engine.plan import resolve_chat_template
    from drafttree.engine.text import load_tokenizer, with_chat_template
    from drafttree.loader.default_model import resolve_model
    model_dir = resolve_model(cfg.model)
    return with_chat_template(load_tokenizer(model_dir, cfg.trust_remote_code),
                              resolve_chat_template(cfg.chat_template, model_dir))


def _generate(a: argparse.Namespace, eng: Engine) -> int:
    tok = eng.tokenizer
    prompt = _prompt(a, tok)
    params = _params(a)
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
    reasoning = eng.text.reasoning
    if reasoning is not None and tok is not None:   # the reply's two parts, as the server's chat gives them
        from drafttree.structured.reasoning import reply_parts
        parts = reply_parts(tok, reasoning, seq.output_ids, reasoning.state(seq.prompt_ids), eng.eos_ids,
                            seq.params.stop, seq.finish_reason)
        summary["reasoning"] = None if parts is None else parts.reasoning
        summary["content"] = seq.text if parts is None else parts.content
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
    key = a.api_key if a.api_key is not None else os.environ.get("DRAFTTREE_API_KEY")
    origins = tuple(o.strip() for o in a.allowed_origins.split(",") if o.strip())
    run_server(engine_config(a), a.host, a.port, a.served_model_name,
               ServerLimits(a.max_request_bytes, key, origins))
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


def cmd_cache(a: argparse.Namespace) -> int:
    """Show or clear what drafttree keeps between runs."""
    import os

    from drafttree.engine import caches
    from drafttree.kernels import compile_cache
    from drafttree.settings import current

    root = current().cache
    if a.action == "info":
        if a.parts:
            raise ValueError("drafttree cache info takes no parts (drafttree cache clear [PART ...] does)")
        parts = caches.info(root)
        print(f"drafttree cache at {root} (DRAFTTREE_CACHE moves it)")
        for part in parts:
            print("  " + part.format())
        print(f"  total     {sum(p.files for p in parts):>7} files {sum(p.bytes for p in parts) / 2**20:>10.1f} MiB")
        print(f"this platform's compiled kernels: {compile_cache.compiled_dir(root=root)}")
        for env in (compile_cache.TRITON_ENV, compile_cache.INDUCTOR_ENV):
            if env in os.environ:
                print(f"  {env}={os.environ[env]} is set: that compiler keeps its own there")
        return 0
    parts = caches.PARTS if not a.parts or "all" in a.parts else tuple(a.parts)
    for part in caches.clear(parts, root):
        print(f"cleared {part.name}: {part.files} files, {part.bytes / 2**20:.1f} MiB ({part.path})")
    return 0


def _report_startup() -> None:
    """Start-up lines (`engine.startup`) on stderr as they come, whatever the root logger's level."""
    logger = logging.getLogger("drafttree.engine.startup")
    if not any(getattr(h, "drafttree_startup", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("drafttree: %(message)s"))
        handler.drafttree_startup = True   # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


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
    if a.cmd in ("generate", "graphs"):
        _report_startup()
    try:
        return {"generate": cmd_generate, "serve": cmd_serve, "graphs": cmd_graphs, "cache": cmd_cache}[a.cmd](a)
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
    add_model_args(g, GENERATE_DEFAULTS, GENERATE_TEXTS)
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
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="requests must carry Authorization: Bearer KEY, but /health, /ready, /metrics and /version "
                        "(default: $DRAFTTREE_API_KEY, else none)")
    s.add_argument("--allowed-origins", default="*", metavar="ORIGIN,...",
                   help="origins whose browser pages may call the server (CORS), comma-separated; '' for none "
                        "(default: *, as vLLM)")
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
    c = sub.add_parser("cache", help="show or clear what drafttree keeps between runs: converted models, "
                                     "compiled kernels, measured cost tables (under DRAFTTREE_CACHE, default "
                                     "~/.cache/drafttree)")
    c.add_argument("action", choices=("info", "clear"))
    c.add_argument("parts", nargs="*", metavar="PART",
                   help="clear: models, compiled, costs or all (default: all)")
    sub.add_parser("train-drafter", help="train a DFlash drafter (see drafttree train-drafter --help)")
    sub.add_parser("bench", help="AR vs DFlash vs DDTree benchmark (see drafttree bench --help)")
    return p


if __name__ == "__main__":
    raise SystemExit(main())
