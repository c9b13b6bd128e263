"""`drafttree train-drafter`: prompts -> target-regenerated responses -> DFlash (or DFlash2) drafter -> τ.

Every stage reads and writes files under --out, so each can be rerun or resumed alone:
  prompts_train.jsonl, prompts_heldout.jsonl   (stage `prompts`: ShareGPT conversations, every
                                               user turn, and code prompts from installed Python
                                               source; held-out first turns for τ)
  prompt_sources.json                          (what each source gave)
  responses.jsonl                              (stage `regenerate`, appended as requests finish;
                                               a conversation's turns wave by wave; with --shard
                                               responses.shardIofN.jsonl, which `train` reads too;
                                               a rerun under any shard layout asks only what no
                                               file there holds)
  checkpoints/last.pt, drafter/, train_log.json (stage `train`; `eval` adds τ to the log)
`all` runs the four in order, skipping what is already done.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drafttree.engine.cli_args import add_engine_args
from drafttree.prompts import Conversation, Prompt, load_sharegpt_conversations, read_prompts, write_prompts
from drafttree.train.code_prompts import code_prompts, stdlib_root
from drafttree.train.data import responses_path
from drafttree.train.parallel import Group, close_group, init_group
from drafttree.train.regen import RegenConfig

if TYPE_CHECKING:
    from drafttree.train.evaluate import Cell

STAGES = ("prompts", "regenerate", "train", "eval", "all")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="working directory for every stage's files")
    p.add_argument("--target", default=None, help="target model directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="target dtype: bf16 / fp32 (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def code_count(text: str) -> int | None:
    """--code-prompts: a count, or 'all' (None)."""
    if text == "all":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a count or 'all', got {text!r}")
    return int(text)


def _prompt_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompts (ShareGPT, code)")
    g.add_argument("--limit", type=int, default=None, help="at most this many training prompts")
    g.add_argument("--eval-size", type=int, default=None, help="held-out prompts (default: 2%% of all)")
    g.add_argument("--max-prompt-chars", type=int, default=4000,
                   help="skip conversations whose first turn is longer; end them before a longer later turn")
    g.add_argument("--turns", choices=["all", "first"], default="all",
                   help="all: every user turn of a conversation, each answered in the context of the turns and "
                        "replies before it; first: first turns only")
    g.add_argument("--code-prompts", type=code_count, default=None, metavar="N|all",
                   help="code prompts from installed Python source mixed into training (default: all; 0: none; "
                        "train.code_prompts)")
    g.add_argument("--code-roots", type=Path, nargs="+", default=None,
                   help="folders of Python source for the code prompts (default: the standard library)")


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (regeneration and τ)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="concurrent requests (default: 64 CUDA, 8 CPU)")
    g.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer (templated) prompts")
    g.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                   help="feed text prompts without the target's chat template")
    add_engine_args(g, ("cuda_graphs", "kv_cache_memory_gb"))


def _regen_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("regeneration")
    g.add_argument("--prompts", type=Path, default=None,
                   help="prompt JSONL ({'prompt': str} or {'prompt_ids': [int]}); default OUT/prompts_train.jsonl")
    g.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts of the file")
    g.add_argument("--max-tokens", type=int, default=512, help="response tokens per prompt")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--shard", default="0/1", metavar="I/N|all",
                   help="regenerate only prompts i with i %% N == I, into responses.shardIofN.jsonl; 'all': one "
                        "process per visible GPU, each its shard on its GPU (training reads the shards)")
    g.add_argument("--regen-time-limit", type=float, default=None,
                   help="stop after this many seconds; unfinished prompts are redone by a later run")


def _train_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("drafter")
    g.add_argument("--data", type=Path, nargs="+", default=None,
                   help="sequences JSONL files, e.g. regeneration shards or temperatures (default: what regenerate "
                        "wrote under OUT, its shards included)")
    g.add_argument("--block-size", type=int, default=None,
                   help="positions a block drafts, anchor included (default 16; with --init-from-drafter: its own)")
    g.add_argument("--draft-layers", type=int, default=3)
    g.add_argument("--intermediate-size", type=int, default=None, help="draft MLP width (default: the target's)")
    g.add_argument("--num-target-features", type=int, default=5, help="target layers whose hidden states condition")
    g.add_argument("--target-layer-ids", type=int, nargs="+", default=None, help="explicit target layer ids")
    g.add_argument("--mask-token-id", type=int, default=None, help="default: largest id absent from the data")
    g.add_argument("--init-from-target", action="store_true", help="start draft layers from the target's last layers")
    g.add_argument("--init-from-drafter", type=Path, default=None,
                   help="continue training a published drafter (its config and weights; shape flags are ignored)")
    g.add_argument("--grow-layers", type=int, default=None, metavar="N",
                   help="with --init-from-drafter: N layers, the new ones after the old and starting as identities "
                        "(the grown drafter drafts exactly as the old one until trained)")
    g.add_argument("--grow-intermediate", type=int, default=None, metavar="M",
                   help="with --init-from-drafter: MLP width M, the new units starting silent")
    g.add_argument("--attention", default="auto", choices=["auto", "dense", "blockwise"],
                   help="training attention (auto: blockwise on CUDA, dense on CPU)")
    g.add_argument("--arch", default=None, choices=["dflash", "dflash2"],
                   help="dflash, or dflash2 (block convolutions and a candidate selector, docs/dflash2.md); default: "
                        "--init-from-drafter's, else dflash. dflash2 with a DFlash --init-from-drafter keeps its "
                        "weights, the convolutions starting as the identity and the selector fresh")
    g.add_argument("--conv-kernel-size", type=int, default=None, help="dflash2: taps per convolution (default 2)")
    g.add_argument("--conv-group-size", type=int, default=None,
                   help="dflash2: channels per dynamic coefficient, a divisor of the hidden size (default 16)")
    g.add_argument("--selector-rank", type=int, default=None, help="dflash2: the selector's rank (default 256)")
    g.add_argument("--selector-top-k", type=int, default=None, help="dflash2: candidates per position (default 16)")
    g.add_argument("--selector-loss-weight", type=float, default=1.0,
                   help="dflash2: weight of the selector's K-way cross-entropy beside the unary loss")
    g = p.add_argument_group("training")
    g.add_argument("--loss", default="ce", choices=["ce", "kl"],
                   help="ce: cross-entropy against the regenerated tokens (the recipe); kl: distillation, the KL "
                        "divergence to the target's own distribution at each position (the target runs alongside)")
    g.add_argument("--anchors-per-seq", type=int, default=512)
    g.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    g.add_argument("--epochs", type=int, default=2)
    g.add_argument("--max-steps", type=int, default=None, help="cap on optimizer steps (the schedule spans them)")
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--warmup", type=float, default=0.04, help="warmup fraction of the steps")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--gamma", type=float, default=None, help="loss decay (default: 7 for bs 16, 5 for 10, 4 for 8)")
    g.add_argument("--max-len", type=int, default=2048, help="cut sequences to this many tokens")
    g.add_argument("--loop-keep", type=int, default=None, metavar="N",
                   help="cut a response that ends in a loop to N periods of it (default: keep all)")
    g.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--snapshot-every", type=int, default=0, metavar="N",
                   help="save the drafter every N steps under OUT/snapshots (the τ curve's points: eval --snapshots)")
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/last.pt")
    g.add_argument("--save-dtype", default="bf16", choices=["bf16", "fp32", "fp16"])
    g.add_argument("--train-time-limit", type=float, default=None,
                   help="stop training after this many seconds: without --max-steps the cosine schedule is "
                        "fitted to the time; with it, the run stops checkpointed and --resume carries on")


def _eval_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("τ evaluation")
    g.add_argument("--drafter", type=Path, default=None, help="drafter directory (default OUT/drafter)")
    g.add_argument("--eval-prompts", type=Path, default=None, help="default OUT/prompts_heldout.jsonl")
    g.add_argument("--eval-num", type=int, default=16, help="held-out prompts to decode (0: skip)")
    g.add_argument("--eval-max-tokens", type=int, default=256)
    g.add_argument("--compare-plain", action="store_true", help="also check outputs equal plain decoding")
    g.add_argument("--methods", type=_words, default=["dflash"], metavar="M,M",
                   help="dflash (the chain, budget 1) and/or ddtree (default: dflash)")
    g.add_argument("--budgets", type=_ints, default=[8, 32, 128], metavar="B,B", help="DDTree budgets (default 8,32,128)")
    g.add_argument("--temperatures", type=_floats, default=[0.0], metavar="T,T",
                   help="sampling temperatures (default 0); each request has a seed, so T > 0 is repeatable")
    g.add_argument("--snapshots", action="store_true",
                   help="τ of every drafter under OUT/snapshots instead: OUT/tau_curve.json and .png, τ against "
                        "the tokens trained on")


def _words(text: str) -> list[str]:
    return [w.strip() for w in text.split(",") if w.strip()]


def _ints(text: str) -> list[int]:
    return [int(w) for w in _words(text)]


def _floats(text: str) -> list[float]:
    return [float(w) for w in _words(text)]


def eval_cells(a: argparse.Namespace) -> list[Cell]:
    from drafttree.train.evaluate import cells_of
    try:
        return cells_of(a.methods, a.budgets, a.temperatures)
    except ValueError as e:
        raise SystemExit(f"train-drafter: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="drafttree train-drafter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="stage", required=True)
    groups = {"prompts": (_prompt_args,), "regenerate": (_engine_args, _regen_args),
              "train": (_engine_args, _train_args, _eval_args), "eval": (_engine_args, _eval_args),
              "all": (_prompt_args, _engine_args, _regen_args, _train_args, _eval_args)}
    for stage in STAGES:
        p = sub.add_parser(stage)
        _common(p)
        for add in groups[stage]:
            add(p)
    return parser


def regen_config(a: argparse.Namespace) -> RegenConfig:
    return RegenConfig(target=a.target, device=a.device, dtype=a.dtype, max_num_seqs=a.max_num_seqs,
                       max_prompt_tokens=a.max_prompt_tokens, max_tokens=getattr(a, "max_tokens", 512),
                       temperature=getattr(a, "temperature", 0.0), seed=a.seed, chat_template=a.chat_template,
                       cuda_graphs=a.cuda_graphs, kv_cache_memory_gb=a.kv_cache_memory_gb,
                       time_limit=getattr(a, "regen_time_limit", None))


def run_shards(argv: list[str], gpus: int) -> None:
    """`regenerate --shard all`: this command again once per GPU, as shard i of N on GPU i (its
    own process, CUDA_VISIBLE_DEVICES=i); a CPU machine runs the one shard here. Waits for all,
    and fails if any failed (a rerun resumes each shard where it stopped)."""
    n = max(gpus, 1)
    at = argv.index("--shard")
    procs = []
    for i in range(n):
        cmd = [sys.executable, "-m", "drafttree.train.cli", *argv[:at], "--shard", f"{i}/{n}", *argv[at + 2:]]
        env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": str(i)} if gpus else {}))
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"regeneration shards exited with {codes} (rerun to resume them)")


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise SystemExit(f"--shard must look like I/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= i < n:
        raise SystemExit(f"--shard {text}: need 0 <= I < N")
    return i, n


def run_prompts(a: argparse.Namespace) -> None:
    """Training prompts (whole conversations with --turns all, and code prompts, shuffled
    together so that every regeneration shard gets both) and held-out first turns (the τ
    evaluation's prompts; their conversations stay out of training)."""
    n_code = a.code_prompts   # None: all
    train, heldout = load_sharegpt_conversations(a.limit, a.seed, a.eval_size, max_chars=a.max_prompt_chars)
    train_prompts: list[Prompt] = list(train) if a.turns == "all" else [c.turns[0] for c in train]
    code, tasks = code_prompts(n_code, a.seed, a.code_roots, a.max_prompt_chars) if n_code != 0 else ([], {})
    turns = sum(len(c.turns) if isinstance(c, Conversation) else 1 for c in train_prompts)
    sources = {"sharegpt": {"prompts": len(train_prompts), "user_turns": turns,
                            "chars": sum(len(t) for c in train_prompts for t in
                                         (c.turns if isinstance(c, Conversation) else [c]))},
               "code": {"prompts": len(code), "tasks": tasks, "chars": sum(map(len, code)),
                        "roots": [str(r) for r in a.code_roots or [stdlib_root()]]},
               "heldout": {"prompts": len(heldout), "source": "sharegpt"}}
    train_prompts += code
    random.Random(a.seed).shuffle(train_prompts)
    write_prompts(a.out / "prompts_train.jsonl", train_prompts)
    write_prompts(a.out / "prompts_heldout.jsonl", [c.turns[0] for c in heldout])
    (a.out / "prompt_sources.json").write_text(json.dumps(sources, indent=1))
    print(f"{len(train_prompts)} training prompts ({sources['sharegpt']['prompts']} ShareGPT with {turns} user turns, "
          f"{len(code)} code) and {len(heldout)} held-out prompts written to {a.out}")


def run_regenerate(a: argparse.Namespace, argv: list[str] | None = None) -> None:
    from drafttree.train.regen import regenerate

    if getattr(a, "shard", "0/1") == "all":
        if a.stage != "regenerate" or argv is None:
            raise SystemExit("--shard all runs in the regenerate stage (then train on the shards)")
        import torch
        run_shards(argv, torch.cuda.device_count())
        return
    path = a.prompts or a.out / "prompts_train.jsonl"
    prompts = read_prompts(path, a.num_prompts)
    shard = parse_shard(getattr(a, "shard", "0/1"))
    out = regenerate(prompts, responses_path(a.out, shard), regen_config(a), progress=not a.quiet, shard=shard)
    print(f"responses for {len(prompts)} prompts in {out}")


def run_train(a: argparse.Namespace, group: Group | None = None) -> dict[str, Any]:
    from drafttree.train.trainer import TrainConfig, Trainer

    cfg = TrainConfig(out=a.out, data=a.data, target=a.target, device=a.device, dtype=a.dtype,
                      draft_layers=a.draft_layers, intermediate_size=a.intermediate_size, block_size=a.block_size,
                      num_target_features=a.num_target_features, target_layer_ids=a.target_layer_ids,
                      mask_token_id=a.mask_token_id, init_from_target=a.init_from_target, arch=a.arch,
                      conv_kernel_size=a.conv_kernel_size, conv_group_size=a.conv_group_size,
                      selector_rank=a.selector_rank, selector_top_k=a.selector_top_k,
                      selector_loss_weight=a.selector_loss_weight, loss=a.loss,
                      init_from_drafter=a.init_from_drafter, grow_layers=a.grow_layers,
                      grow_intermediate=a.grow_intermediate, attention=a.attention,
                      anchors_per_seq=a.anchors_per_seq, batch_size=a.batch_size, epochs=a.epochs,
                      max_steps=a.max_steps, lr=a.lr, warmup=a.warmup, weight_decay=a.weight_decay,
                      grad_clip=a.grad_clip, gamma=a.gamma, max_len=a.max_len, loop_keep=a.loop_keep,
                      save_every=a.save_every, snapshot_every=a.snapshot_every, log_every=a.log_every,
                      resume=a.resume, save_dtype=a.save_dtype, seed=a.seed, time_limit=a.train_time_limit,
                      progress=not a.quiet)
    summary = Trainer(cfg, group=group).run()
    last = summary["history"][-1] if summary["history"] else {}
    if group is not None and not group.main:
        return summary
    print(f"trained {summary['step']} steps ({summary['seconds_per_step'] * 1e3:.1f} ms/step), "
          f"{summary['parameters'] / 1e6:.2f} M parameters -> {cfg.drafter_dir}; "
          f"last loss {last.get('loss', float('nan')):.3f}, training τ {last.get('tau_train', float('nan')):.2f}")
    return summary


def run_eval(a: argparse.Namespace) -> dict[str, Any] | None:
    from drafttree.train.evaluate import measure_cells
    from drafttree.train.trainer import write_log

    path = a.eval_prompts or a.out / "prompts_heldout.jsonl"
    if a.eval_num <= 0 or not path.is_file():
        print(f"τ evaluation skipped ({'no ' + str(path) if a.eval_num > 0 else '--eval-num 0'})")
        return None
    if a.snapshots:
        return run_curve(a, path)
    drafter = a.drafter or a.out / "drafter"
    cells = eval_cells(a)
    results = measure_cells(drafter, read_prompts(path, a.eval_num), regen_config(a), cells, a.eval_max_tokens,
                            compare_plain=a.compare_plain)
    for label, r in results.items():
        print(f"τ = {r['tau']:.3f} ({label}: mean accepted length over {r['rounds']} rounds, {r['prompts']} prompts)")
    # one cell keeps the log's flat form; several go by label, the first also flat
    result = dict(results[cells[0].label], **({"cells": results} if len(cells) > 1 else {}))
    write_log(a.out, {"eval": result})
    return result


def run_curve(a: argparse.Namespace, path: Path) -> dict[str, Any]:
    """τ of every snapshot the trainer saved under OUT/snapshots, against the tokens trained on."""
    from drafttree.train.curves import plot_tau_curve
    from drafttree.train.evaluate import tau_curve

    rows = tau_curve(a.out / "snapshots", read_prompts(path, a.eval_num), regen_config(a), a.eval_max_tokens,
                     eval_cells(a))
    (a.out / "tau_curve.json").write_text(json.dumps(rows, indent=1))
    plot_tau_curve(rows, a.out / "tau_curve.png")
    for r in rows:
        cells = ", ".join(f"{k} {v:.3f}" for k, v in r["cells"].items())
        print(f"step {r['step']}: {r['tokens'] / 1e6:.2f} M tokens, τ = {r['tau']:.3f} ({cells})")
    return {"tau_curve": rows}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if hasattr(a, "methods"):
        eval_cells(a)   # bad τ cells are refused before a stage runs, not after hours of training
    a.out.mkdir(parents=True, exist_ok=True)
    if a.stage == "prompts":
        run_prompts(a)
    elif a.stage == "regenerate":
        run_regenerate(a, argv)
    elif a.stage == "train":
        # under torchrun (one process per GPU) the ranks train together; rank 0 then evaluates
        group = init_group()
        run_train(a, group)
        close_group(group)
        if group.main:
            run_eval(a)
    elif a.stage == "eval":
        run_eval(a)
    else:
        if a.prompts is None and not (a.out / "prompts_train.jsonl").is_file():
            run_prompts(a)
        run_regenerate(a)
        run_train(a)
        run_eval(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
