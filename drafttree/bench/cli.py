"""drafttree bench: AR vs DFlash vs DDTree (budget sweep) at several temperatures
(`drafttree bench serve --help`: load on a running server instead).

Reports per run: mean accepted length τ and its histogram, tokens/s, time per output token,
speedup over AR, and a round's wall time against its device time (the host's share between
rounds); writes results.json and PNG plots into --out.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import platform
import pstats
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from drafttree.bench.environment import environment
from drafttree.bench.prompts import load_prompts
from drafttree.engine.budget import sampler_key
from drafttree.engine.cli_args import add_engine_args, config_from_args, field_names
from drafttree.engine.plan import settings_of
from drafttree.llm import LLM
from drafttree.parallel.group import torchrun_launch
from drafttree.phases import Phase, schedule_for
from drafttree.sampling import SamplingParams
from drafttree.settings import scope


# Every engine field but those each run sets (the method, its budget, the rows for --batch).
ENGINE_FIELDS = tuple(field_names(exclude=("spec", "budget", "max_num_seqs")))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="drafttree bench", description=__doc__)
    add_engine_args(p.add_argument_group("engines (one per method and budget)"), ENGINE_FIELDS,
                    defaults={"speculate_sampled": True, "max_model_len": 2048},
                    notes={"budget_schedule": "DFlash takes it when all its entries are batch:0",
                           "speculate_sampled": "on by default here: each method is measured as itself, whatever "
                                                "the drafter config's ddtree_default_speculate_sampled says",
                           "deterministic": "with it, same_as_ar is 1.00 at T = 0 on the GPU too",
                           "tensor_parallel_size": "every engine of the run starts its own ranks"})
    p.add_argument("--prompts", default="humaneval",
                   help="humaneval | sharegpt-heldout | FILE.jsonl, or several, comma-separated (one engine runs them all)")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts taken from each set")
    p.add_argument("--waves", type=int, default=0,
                   help="at each batch size B, decode at least this many full batches (N x B requests, the "
                        "prompts reused in order): cells at large batch sizes then run long enough to rank")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every cell this many times, the methods' order reversed each time (every engine "
                        "kept started): a shared machine's changing load falls on each alike; results.json "
                        "then holds each repeat's rows and, under 'summary', each method's median and range")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--methods", default="ar,dflash,ddtree",
                   help="what to run, comma-separated: ar (plain decoding), dflash, ddtree")
    p.add_argument("--budgets", default="auto,8,16,32,64,128",
                   help="DDTree budgets to run, each fixed for every round, and 'auto' (each round chooses; "
                        "DFlash then runs auto too): e.g. auto,4,8,16,32,64")
    p.add_argument("--temperatures", default="0,1", help="sampling temperatures, comma-separated: each a run")
    p.add_argument("--top-p", type=float, default=1.0, help="of every sampled request (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="of every sampled request (0: off)")
    p.add_argument("--batch", default="1",
                   help="concurrent requests, or several sizes comma-separated (e.g. 1,4,16,64): each method's "
                        "engine is started once, at the largest, and runs every size")
    p.add_argument("--host-profile", action="store_true",
                   help="write each run's host-side profile (cProfile, top 40 by own time) into --out; "
                        "the profiler slows the host, so its tok/s are not comparable")
    p.add_argument("--out", default="bench_out", help="directory for results.json, the plots and profiles")
    p.add_argument("--from-results", nargs="+", default=None, metavar="JSON",
                   help="run nothing: merge these results.json files (e.g. one per GPU) into --out")
    return p


def runs(a: argparse.Namespace) -> list[tuple[str, int | str | None]]:
    """(method, budget): a DDTree budget fixed for every round or 'auto'; DFlash's chain in every
    round (None) and, when the budgets name auto, chosen per round ('auto')."""
    out: list[tuple[str, int | str | None]] = []
    budgets = [b.strip() for b in a.budgets.split(",") if b.strip()]
    for m in a.methods.split(","):
        if m == "ddtree":
            out += [("ddtree", b if b == "auto" else int(b)) for b in budgets]
        elif m == "dflash":
            out += [("dflash", None)] + ([("dflash", "auto")] if "auto" in budgets else [])
        elif m == "ar":
            out.append((m, None))
        else:
            raise ValueError(f"unknown method {m!r} (ar, dflash, ddtree)")
    return out


def batches(a: argparse.Namespace) -> list[int]:
    out = [int(b) for b in str(a.batch).split(",") if b.strip()]
    if not out or min(out) < 1:
        raise ValueError(f"--batch needs positive sizes, got {a.batch!r}")
    if a.waves < 0:
        raise ValueError(f"--waves must be >= 0, got {a.waves}")
    if a.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {a.repeats}")
    if a.repeats > 1 and a.tensor_parallel_size > 1:
        raise ValueError("--repeats keeps every method's engine started, and one process holds one "
                         "tensor-parallel engine at a time: use --repeats 1 with --tensor-parallel-size")
    return out


def cell_requests(a: argparse.Namespace, prompts: int, batch: int) -> int:
    """How many requests a cell of `prompts` prompts decodes at `batch`: --waves full batches at least."""
    return max(prompts, a.waves * batch)


def make_llm(a, method: str, budget: int | str | None) -> LLM:
    """One engine per (method, budget): every temperature of the run shares it (and its graphs)."""
    # DFlash's chain in every round: a fixed budget (its value is not used)
    engine_budget = 1 if method == "dflash" and budget is None else budget
    cfg = config_from_args(a, spec="none" if method == "ar" else method, budget=engine_budget,
                           budget_schedule=schedule_for(method, a.budget_schedule), max_num_seqs=max(batches(a)))
    return LLM(**dataclasses.asdict(cfg))


def run_one(a, llm: LLM, method: str, budget: int | str | None, prompts, temperature: float,
            bar, batch: int | None = None, prompt_set: str | None = None) -> tuple[dict, list[list[int]]]:
    """One method at one temperature over all prompts, `batch` at a time: its figures, and its
    outputs' token ids."""
    batch = batch or batches(a)[0]
    eng = llm.engine
    texts = [p if isinstance(p, list) or llm.tokenizer is None else llm.apply_chat_template(
        [{"role": "user", "content": p}]) for p in prompts]
    distinct = len(texts)
    texts = [texts[i % distinct] for i in range(cell_requests(a, distinct, batch))]
    params = [SamplingParams(temperature=temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens, seed=i)
              for i in range(len(texts))]
    # Warm-up on every batch of the run, short outputs: first calls compile and load kernels per
    # shape, and without this the first method timed pays for them (AR run three times in one
    # process at batch 16: 2,034, 7,774, 9,439 tok/s).
    warm = SamplingParams(temperature=temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=min(8, a.max_tokens),
                          seed=0)
    for i in range(0, distinct, batch):
        llm.generate(texts[i:min(i + batch, distinct)], warm)
    before = eng.stats
    profiler = cProfile.Profile() if a.host_profile else None
    outs, t0 = [], time.perf_counter()
    if profiler is not None:
        profiler.enable()
    for i in range(0, len(texts), batch):
        outs += llm.generate(texts[i:i + batch], params[i:i + batch])
        bar.update(len(texts[i:i + batch]))
    wall = time.perf_counter() - t0
    st = eng.stats
    if profiler is not None:
        profiler.disable()
        cell = _cell_suffix(prompt_set or a.prompts, batch, len(prompt_sets(a)) * len(batches(a)) > 1)
        name = f"host_profile_{method}{'' if budget is None else budget}_T{temperature:g}{cell}.txt"
        with open(Path(a.out) / name, "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("tottime").print_stats(40)
    rounds = max(st.rounds - before.rounds, 1)
    n = sum(len(o.token_ids) for o in outs)
    taus = [t for o in outs for t in o.metrics["accept_lengths"]]
    tpot = [(o.metrics["total_s"] - o.metrics["ttft_s"]) / max(len(o.token_ids) - 1, 1) for o in outs]
    after_first = sum(o.metrics["total_s"] - o.metrics["ttft_s"] for o in outs)
    row = {"method": method, "budget": budget, "prompts": prompt_set or a.prompts, "batch": batch,
           "budget_schedule": eng.spec.budget_schedule,
           "block_size": eng.spec.block_size, "temperature": temperature, "top_p": a.top_p, "top_k": a.top_k,
           "output_tokens": n, "wall_s": wall, "tokens_per_s": n / wall,
           "tpot_ms": 1e3 * sum(tpot) / len(tpot), "tau_mean": sum(taus) / max(len(taus), 1),
           "ttft_ms": 1e3 * sum(o.metrics["ttft_s"] for o in outs) / len(outs),
           # tokens after each request's first, over the time they took: TPOT weighted by length
           "decode_tokens_per_s": sum(len(o.token_ids) - 1 for o in outs) / max(after_first, 1e-9),
           "tau_histogram": dict(sorted(Counter(taus).items())), "rounds": len(taus),
           # per round: the wall time outside prefill, and the device time of its phases (CUDA
           # events; on CPU, host time): the difference is the host's time between rounds
           "round_ms": 1e3 * (wall - (st.prefill_seconds - before.prefill_seconds)) / rounds,
           "round_gpu_ms": 1e3 * (_round_seconds(st) - _round_seconds(before)) / rounds,
           "graph_fallbacks": st.graph_fallbacks if eng.setup.cuda_graphs else None,
           # rounds per budget they ran at (0: plain decode rounds), the chosen ones under auto
           "budget_histogram": {str(k): v for k, v in sorted((st.budget_hist - before.budget_hist).items())},
            # why rounds of a speculative engine decoded plainly (schedule, speculate_sampled off, max_budget, cost model)
            "plain_rounds": dict(st.plain_rounds - before.plain_rounds),
            "cost_model_s": eng.costs.measure_s if eng.costs is not None else None,
            # the engine's start-up, stage by stage (`engine.startup`), and what each did
            "startup": eng.startup.record()}
    if eng.spec.adaptive:
        row["budget_choice"] = budget_choice(eng, batch, params[0])
    return row, [o.token_ids for o in outs]


def budget_choice(eng, batch: int, params: SamplingParams) -> dict:
    """What the per-round choice weighed at the cell's end for the cell's sampler setting: each
    budget's round in milliseconds as priced (the cost table, scaled by the round times
    observed), the calibration per budget (drafted tokens the target's sampler accepted /
    predicted) and the calibrated expected τ."""
    chooser, bucket = eng.chooser, eng.runner.cache_cfg.batch_bucket(batch)
    allowed = eng.spec.budgets_at(bucket, params.greedy)
    cal = chooser.calibration(sampler_key(params))
    return {"round_ms": {str(b): 1e3 * chooser.round_seconds(bucket, b, not params.greedy) for b in allowed},
            "calibration": {str(b): cal.ratio(chooser.budgets.index(b)) for b in allowed if b} if cal else None,
            "expected_tau": {str(b): cal.expected(chooser.budgets.index(b)) for b in allowed if b} if cal else None}


def _cell_suffix(prompt_set: str, batch: int, many: bool) -> str:
    """What tells a cell's files apart when a run has several cells (prompt sets x batch sizes)."""
    return f"_{Path(str(prompt_set)).stem}_b{batch}" if many else ""


def prompt_sets(a: argparse.Namespace) -> list[str]:
    return [p.strip() for p in a.prompts.split(",") if p.strip()]


def _cell(r: dict) -> tuple:
    """The runs one speedup compares: the same prompts, batch size, temperature and repeat."""
    return r.get("prompts"), r.get("batch"), r["temperature"], r.get("repeat", 0)


def summary(results: list[dict]) -> list[dict]:
    """Per method, budget and cell over its repeats: the median tok/s and speedup over plain
    decoding (each repeat against the plain run of the same repeat) and their ranges."""
    import statistics
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["method"], str(r["budget"]), *_cell(r)[:3]), []).append(r)
    out = []
    for (m, b, ps, batch, T), rs in groups.items():
        tps = [r["tokens_per_s"] for r in rs]
        sp = [r["speedup"] for r in rs if r.get("speedup") is not None]
        row = {"method": m, "budget": b, "prompts": ps, "batch": batch, "temperature": T, "repeats": len(rs),
               "tokens_per_s": statistics.median(tps), "tokens_per_s_range": [min(tps), max(tps)]}
        if sp:
            row.update(speedup=statistics.median(sp), speedup_range=[min(sp), max(sp)])
        out.append(row)
    return out


def _round_seconds(stats) -> float:
    """Seconds counted in round phases (not prefill) in an engine's stats snapshot."""
    return sum(v for p, v in stats.phase_seconds.items() if p != Phase.PREFILL.value)


def plot(results: list[dict], out: Path, suffix: str = "") -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    temps = sorted({r["temperature"] for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, T in enumerate(temps):
        color = f"C{i}"
        rs = [r for r in results if r["temperature"] == T and r["method"] == "ddtree" and isinstance(r["budget"], int)]
        for ax, key in zip(axes, ("speedup", "tau_mean")):
            if rs:
                ax.plot([r["budget"] for r in rs], [r[key] for r in rs], "o-", color=color, label=f"DDTree T={T:g}")
            for r in results:
                if r["temperature"] == T and r["budget"] == "auto" and r[key] is not None:
                    ax.axhline(r[key], ls=":" if r["method"] == "dflash" else "-.", color=color,
                               label=f"{r['method']} auto T={T:g}")
                elif r["temperature"] == T and r["method"] == "dflash":
                    ax.axhline(r[key], ls="--", color=color, label=f"DFlash T={T:g}")
    for ax, name in zip(axes, ("speedup over AR", "mean accepted length τ")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tree nodes)")
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"budget_sweep{suffix}.png", dpi=120)
    files.append(f"budget_sweep{suffix}.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        if r["method"] != "ar" and r["temperature"] == temps[0]:
            h = {int(k): v for k, v in r["tau_histogram"].items()}
            tot = sum(h.values()) or 1
            xs = sorted(h)
            ax.plot(xs, [h[x] / tot for x in xs], "o-", ms=3,
                    label=r["method"] + (f" B={r['budget']}" if r["budget"] else ""))
    ax.set_xlabel(f"accepted length τ per round (T={temps[0]:g})")
    ax.set_ylabel("fraction of rounds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"acceptance_histogram{suffix}.png", dpi=120)
    plt.close("all")
    return files + [f"acceptance_histogram{suffix}.png"]


def finish(results: list[dict], meta: dict, out: Path) -> None:
    """Speedups over AR at the same temperature, results.json, plots and the printed table."""
    for r in results:
        ar = next((x for x in results if x["method"] == "ar" and _cell(x) == _cell(r)), None)
        r["speedup"] = r["tokens_per_s"] / ar["tokens_per_s"] if ar else None
    repeated = any(r.get("repeat", 0) for r in results)
    record = {"meta": meta, "results": results, **({"summary": summary(results)} if repeated else {})}
    (out / "results.json").write_text(json.dumps(record, indent=1))
    cells = list(dict.fromkeys((r.get("prompts"), r.get("batch")) for r in results))
    files = []
    many = len(cells) > 1
    for ps, b in cells:
        files += plot([r for r in results if (r.get("prompts"), r.get("batch")) == (ps, b)], out,
                      _cell_suffix(ps, b, many))
    head = f"{'prompts':<12}{'batch':>6}" if many else ""
    print(f"{head}{'method':<8}{'budget':>7}{'T':>4}{'tau':>7}{'tok/s':>9}{'TPOT ms':>9}{'TTFT ms':>9}{'speedup':>9}{'=AR':>6}"
          f"{'round ms':>10}{'GPU ms':>8}")
    for r in results:
        sp = f"{r['speedup']:.2f}" if r["speedup"] else "-"
        ttft = f"{r['ttft_ms']:.1f}" if "ttft_ms" in r else "-"   # absent from older results files
        same = f"{r['same_as_ar']:.2f}" if r.get("same_as_ar") is not None else "-"
        rnd = f"{r['round_ms']:>10.3f}{r['round_gpu_ms']:>8.3f}" if "round_ms" in r else f"{'-':>10}{'-':>8}"
        cell = f"{Path(str(r.get('prompts'))).stem[:11]:<12}{r.get('batch') or '-':>6}" if many else ""
        print(f"{cell}{r['method']:<8}{r['budget'] or '-':>7}{r['temperature']:>4g}{r['tau_mean']:>7.2f}"
              f"{r['tokens_per_s']:>9.1f}{r['tpot_ms']:>9.2f}{ttft:>9}{sp:>9}{same:>6}{rnd}")
    for r in results:
        if r.get("budget") == "auto":
            where = f"{Path(str(r.get('prompts'))).stem} b{r.get('batch')} " if many else ""
            print(f"{where}{r['method']} auto T={r['temperature']:g}: rounds per chosen budget "
                  f"{r.get('budget_histogram')}")
            if r.get("budget_choice"):
                c = r["budget_choice"]
                tau = c["expected_tau"] or {}
                print(f"  priced round ms {_fmt(c['round_ms'])}; calibration {_fmt(c['calibration'] or {})}; "
                      f"expected τ {_fmt(tau)}")
    for r in record.get("summary", []):
        sp = f", speedup {r['speedup']:.3f} ({r['speedup_range'][0]:.3f}-{r['speedup_range'][1]:.3f})" \
            if "speedup" in r else ""
        print(f"{Path(str(r['prompts'])).stem} b{r['batch']} T={r['temperature']:g} {r['method']} "
              f"{r['budget'] if r['budget'] != 'None' else ''}: {r['repeats']} repeats, median "
              f"{r['tokens_per_s']:.1f} tok/s ({r['tokens_per_s_range'][0]:.1f}-{r['tokens_per_s_range'][1]:.1f}){sp}")
    print(f"wrote {out / 'results.json'} and {', '.join(files)}")


def _environment(a: argparse.Namespace) -> dict:
    """`environment()` under the settings every engine of the run has (its deterministic choice)."""
    with scope(settings_of(config_from_args(a))):
        return environment()


def _fmt(d: dict) -> str:
    return "{" + ", ".join(f"{k}: {v:.3g}" for k, v in d.items()) + "}"


def merge(paths: list[str], out: Path) -> int:
    loaded = [json.loads(Path(p).read_text()) for p in paths]
    meta = dict(loaded[0]["meta"], commands=[d["meta"]["command"] for d in loaded])
    finish([r for d in loaded for r in d["results"]], meta, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        from drafttree.bench.serve import main as serve_main
        return serve_main(argv[1:])
    a = build_parser().parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.from_results:
        return merge(a.from_results, out)
    if a.tensor_parallel_size > 1 and torchrun_launch() is not None:
        raise SystemExit("drafttree bench starts one engine per method and budget, each with its own ranks: run it "
                         "without torchrun (--tensor-parallel-size N starts them)")
    vocab = None
    if a.random_weights:
        from drafttree.models.random_shapes import shape_config
        vocab = shape_config(a.random_weights)[0].vocab_size
    sizes = batches(a)
    sets = {ps: load_prompts(ps, a.num_prompts, random_vocab=vocab) for ps in prompt_sets(a)}
    temps = [float(T) for T in a.temperatures.split(",")]
    plan = runs(a)
    meta = {"date": time.strftime("%Y-%m-%d"),
            "command": "drafttree bench " + " ".join(sys.argv[2:] if argv is None else argv),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() and a.device != "cpu"
            else f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
            "prompts": a.prompts, "num_prompts": {ps: len(p) for ps, p in sets.items()}, "max_tokens": a.max_tokens,
            "batch": sizes, "waves": a.waves,
            "tensor_parallel_size": a.tensor_parallel_size,
            "environment": _environment(a)}
    results, outputs = [], {}
    total = a.repeats * len(plan) * len(temps) * sum(cell_requests(a, len(p), b) for p in sets.values() for b in sizes)

    def one(m, b, llm, ps, size, T, rep) -> None:
        bar.set_postfix_str(f"{m}{'' if b is None else f' B={b}'} T={T:g} batch {size}"
                            + (f" repeat {rep + 1}/{a.repeats}" if a.repeats > 1 else ""))
        r, outputs[(m, b, T, ps, size, rep)] = run_one(a, llm, m, b, sets[ps], T, bar, size, ps)
        if a.repeats > 1:
            r["repeat"] = rep
        results.append(r)
        # written after every run, so a run cut short still leaves what it measured
        (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))

    with tqdm(total=total, desc="bench", unit="req") as bar:
        if a.repeats == 1:   # one engine at a time (tensor-parallel engines cannot share a process)
            for m, b in plan:
                llm = make_llm(a, m, b)
                for ps in sets:
                    for size in sizes:
                        for T in temps:
                            one(m, b, llm, ps, size, T, 0)
                llm.shutdown()   # its ranks, before the next engine starts its own
                del llm
        else:   # every engine kept; each cell runs the methods in turn, in reverse order every other repeat
            llms = {(m, b): make_llm(a, m, b) for m, b in plan}
            for rep in range(a.repeats):
                for ps in sets:
                    for size in sizes:
                        for T in temps:
                            for m, b in (plan if rep % 2 == 0 else plan[::-1]):
                                one(m, b, llms[(m, b)], ps, size, T, rep)
            for llm in llms.values():
                llm.shutdown()
    for r in results:
        # Greedy outputs identical to plain decoding's. In fp32 a speculative method must give 1.0;
        # in bf16 on a GPU, a batched verify's numerics may part from one-row decoding on near-ties.
        rep = r.get("repeat", 0)
        ar = outputs.get(("ar", None, r["temperature"], r["prompts"], r["batch"], rep))
        if r["temperature"] == 0 and ar is not None:
            mine = outputs[(r["method"], r["budget"], r["temperature"], r["prompts"], r["batch"], rep)]
            r["same_as_ar"] = sum(x == y for x, y in zip(mine, ar)) / len(ar)
            # and to plain decoding one batch size apart (the smallest run): what a request gets
            # does not depend on which others share its rounds (fp32, or --deterministic on a GPU)
            alone = outputs.get(("ar", None, r["temperature"], r["prompts"], min(sizes), rep))
            if alone is not None:
                r["same_as_ar_alone"] = sum(x == y for x, y in zip(mine, alone)) / len(alone)
    finish(results, meta, out)
    return 0
