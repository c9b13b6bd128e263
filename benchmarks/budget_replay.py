"""The per-round budget choice replayed offline: what `auto` gains or loses against fixed budgets
and against an oracle, at a given machine's round prices, from acceptance the real pair gives.

`trace` runs the engine at batch 1, T = 0, every round at the largest budget, and keeps per round
what the chooser would have read: the acceptance model's prediction and the realised τ at every
budget (a greedy round's observation covers every budget up to the one verified). `replay` walks
those rounds with a policy — a fixed budget, the engine's `BudgetChooser` (fed the observations a
round late, as the engine reads them), or the oracle that knows each round's τ — at round prices
given in ms (the bench's `budget_choice.round_ms` of a GPU run), optionally with an extra cost on
every drafting round of the adaptive choice (what its predictions cost the round). A plain round
moves the text on by one token; where a policy resumes drafting mid-way through a recorded round,
that round stands for the one it would draft: with its whole τ (`optimistic`: a plain round costs
nothing in acceptance) or with τ less the tokens already past its start, at least 1
(`conservative`). The truth lies between: the replay is an estimate, not a rerun, and ranks
policies that decode plainly often only where both agree. `trace --every-position` removes the
guess: it records the round that would start at every position of the plain output (a request
per position, batched), and `replay` then walks exactly the rounds a policy would run (`exact`),
up to the prediction's numerics at another batch size.

python benchmarks/budget_replay.py trace --device cpu --num-prompts 16 --max-tokens 128 --out trace.json
python benchmarks/budget_replay.py replay trace.json --prices 0:0.528,4:1.117,8:1.144,16:1.214,31:1.265 \
    --auto-extra-ms 0,0.137 --resume optimistic,conservative --out replay.json
python benchmarks/budget_replay.py trace --every-position --device cpu --num-prompts 16 --max-tokens 64 --out exact.json
python benchmarks/budget_replay.py replay exact.json --prices 0:0.53,4:1.00,8:1.06,16:1.09,31:1.15 \
    --timing-noise 0.1 --chooser-set EMA=0.05,DRIFT=0.002632 --out replay_exact.json
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import Counter
from pathlib import Path

import drafttree.engine.budget as budget_module
from drafttree.engine.budget import GREEDY, BudgetChooser
from drafttree.spec_decode.acceptance import PRED_SCALE

NOISE_SEEDS = 9    # draws of the timing noise a replay with noise is run over
Round = tuple[list[int], list[int]]   # predictions and observations at every budget, in 1/PRED_SCALE tokens


def trace(args: argparse.Namespace) -> None:
    from drafttree import LLM, SamplingParams
    from drafttree.bench.prompts import load_prompts

    kw = {"draft_model": args.draft_model} if args.draft_model else {}
    llm = LLM(args.model, spec="ddtree", device=args.device, dtype=args.dtype, **kw)
    chooser, rounds = llm.engine.chooser, at_largest_budget(llm)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    traces: dict[str, list[Round]] = {}
    for name in args.prompts.split(","):
        for i, prompt in enumerate(load_prompts(name, args.num_prompts)):
            rounds.clear()
            t = time.perf_counter()
            out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
            if args.every_position:
                traces[f"{name}/{i}"] = every_position(llm, out.prompt_token_ids, out.token_ids)
            else:
                traces[f"{name}/{i}"] = list(rounds)
            print(f"{name} {i}: {len(traces[f'{name}/{i}'])} rounds, {time.perf_counter() - t:.1f} s", flush=True)
    out = {"budgets": list(chooser.budgets), "draft_model": args.draft_model or "shipped",
           "max_tokens": args.max_tokens, "every_position": args.every_position, "traces": traces}
    Path(args.out).write_text(json.dumps(out))
    print(f"wrote {args.out}: {sum(map(len, traces.values()))} rounds")


def at_largest_budget(llm) -> list[Round]:
    """Every round of `llm`'s engine at the largest budget from now on; what its chooser reads is
    kept in the list returned (and still learnt from)."""
    chooser, rounds = llm.engine.chooser, []
    observe = chooser.observe
    chooser.choose = lambda bucket, allowed, rows, cap=None, extra=(), host_rows=0: allowed[-1]

    def keep(key, preds, seen):
        rounds.append((list(preds), list(seen)))
        observe(key, preds, seen)

    chooser.observe = keep
    return rounds


def every_position(llm, prompt: list[int], output: list[int]) -> list[Round]:
    """The round that would start after each of `output`'s first 1 .. n-1 tokens: one request a
    position, batched (the prompt and the output before it, whose prefill commits the position's
    token; its first round is the one kept). Each request is its own sampler setting for the
    chooser, so that every row's observation comes apart from the batch's mean."""
    from drafttree import SamplingParams
    import drafttree.engine.engine as engine_module

    key = engine_module.sampler_key
    firsts: dict[int, Round] = {}
    observe = llm.engine.chooser.observe

    def first(k, preds, seen):
        firsts.setdefault(k[2], (list(preds), list(seen)))
        observe(k, preds, seen)

    engine_module.sampler_key = lambda p: (0.0, 1.0, 1 + p.seed)
    llm.engine.chooser.observe = first
    try:
        # 9 tokens leave room for a whole first round (at most the block size's 8 and a bonus)
        params = [SamplingParams(temperature=0, max_tokens=10, seed=j) for j in range(len(output) - 1)]
        llm.generate([prompt + output[:j] for j in range(len(output) - 1)], params, use_tqdm=False)
    finally:
        engine_module.sampler_key = key
        llm.engine.chooser.observe = observe
    return [firsts[1 + j] for j in range(len(output) - 1)]


class Prices:
    """A cost table of fixed round prices (seconds), as `BudgetChooser` reads one."""

    def __init__(self, ms: dict[int, float]) -> None:
        self.ms = ms

    def round_seconds(self, bucket: int, budget: int, sampled: bool = False) -> float:
        return self.ms[budget] / 1e3


def replay(budgets: list[int], traces: dict[str, list[Round]], policy: int | str, prices: dict[int, float],
           extra_ms: float = 0.0, resume: str = "optimistic", timing_noise: float = 0.0, seed: int = 0) -> dict:
    """Tokens per ms under `policy` (a budget, "auto" or "oracle"), and the rounds per budget;
    `resume`: how a draft mid-way through a recorded round is scored (the module's docstring);
    `timing_noise`: the spread (log-normal sigma) of the seconds `auto` observes a round, about
    its price (a machine's rounds vary; the score counts the prices), drawn from `seed`."""
    noise = random.Random(seed)
    allowed = (0, *budgets)
    cost = {b: prices[b] + (extra_ms if b and policy == "auto" else 0.0) for b in allowed}
    chooser = BudgetChooser(Prices(prices), tuple(budgets)) if policy == "auto" else None
    rows = Counter({GREEDY: 1})
    tokens = ms = 0.0
    hist: Counter[int] = Counter()
    for rounds in traces.values():
        starts, p = [], 0.0
        for _, seen in rounds:
            starts.append(p)
            p += 1.0 if resume == "exact" else seen[-1] / PRED_SCALE
        pos, k, unread = 0.0, 0, None
        while pos < p - 1e-9:
            while k + 1 < len(starts) and starts[k + 1] <= pos + 1e-9:
                k += 1
            preds, seen = rounds[k]
            if resume == "conservative" and pos > starts[k]:
                past = round((pos - starts[k]) * PRED_SCALE)
                seen = [max(PRED_SCALE, x - past) if x else 0 for x in seen]
            if chooser is not None:
                b = chooser.choose(1, allowed, rows)
            elif policy == "oracle":
                b = max(allowed, key=lambda b: (seen[budgets.index(b)] / PRED_SCALE if b else 1.0) / cost[b])
            else:
                b = int(policy)
            # the text ends where the trace does: what a round commits past it is not counted
            got = min(seen[budgets.index(b)] / PRED_SCALE if b else 1.0, p - pos)
            if chooser is not None:
                chooser.observe_round(1, b, False, cost[b] / 1e3 * math.exp(noise.gauss(0.0, timing_noise)))
                if unread is not None:    # the round before is read after this one launched
                    chooser.observe(GREEDY, *unread)
                i = budgets.index(b) if b else -1
                unread = (preds, [s if j <= i else 0 for j, s in enumerate(seen)]) if b else None
            hist[b] += 1
            tokens += got
            ms += cost[b]
            pos += got
        if chooser is not None and unread is not None:
            chooser.observe(GREEDY, *unread)
    return {"tokens_per_ms": tokens / ms, "rounds": {str(b): n for b, n in sorted(hist.items())}}


def replay_batched(budgets: list[int], traces: dict[str, list[Round]], policy: int | str, prices: dict[int, float],
                   batch: int) -> dict:
    """As `replay` over a trace of every position, with the prompts in batches of `batch` rows
    (in order, as the bench batches them): each round runs every unfinished row at one budget, at
    that budget's price for the batch (given at this batch size, kept while rows finish), and `auto`
    observes the rows' mean prediction and acceptance, as the engine does."""
    allowed = (0, *budgets)
    chooser = BudgetChooser(Prices(prices), tuple(budgets)) if policy == "auto" else None
    tokens = ms = 0.0
    hist: Counter[int] = Counter()
    names = list(traces)
    for start in range(0, len(names), batch):
        group = [traces[n] for n in names[start:start + batch]]
        pos = [0] * len(group)
        unread = None
        while True:
            live = [i for i, rounds in enumerate(group) if pos[i] < len(rounds)]
            if not live:
                break
            at = {i: group[i][pos[i]] for i in live}
            got_at = lambda b: {i: min(round(at[i][1][budgets.index(b)] / PRED_SCALE) if b else 1, len(group[i]) - pos[i])
                                for i in live}
            if chooser is not None:
                b = chooser.choose(batch, allowed, Counter({GREEDY: len(live)}))
            elif policy == "oracle":
                b = max(allowed, key=lambda b: sum(got_at(b).values()) / prices[b])
            else:
                b = int(policy)
            got = got_at(b)
            if chooser is not None:
                chooser.observe_round(batch, b, False, prices[b] / 1e3)
                if unread is not None:
                    chooser.observe(GREEDY, *unread)
                k = budgets.index(b) if b else -1
                mean = lambda col: [sum(at[i][col][j] for i in live) / len(live) for j in range(len(budgets))]
                unread = (mean(0), [x if j <= k else 0 for j, x in enumerate(mean(1))]) if b else None
            for i, n in got.items():
                pos[i] += n
                tokens += n
            hist[b] += 1
            ms += prices[b]
        if chooser is not None and unread is not None:
            chooser.observe(GREEDY, *unread)
    return {"tokens_per_ms": tokens / ms, "rounds": {str(b): n for b, n in sorted(hist.items())}}


def replay_main(args: argparse.Namespace) -> None:
    data = json.loads(Path(args.trace).read_text())
    budgets, traces = data["budgets"], data["traces"]
    resumes = args.resume or ("exact" if data.get("every_position") else "optimistic,conservative")
    if args.batch > 1 and not data.get("every_position"):
        raise SystemExit("--batch replays a trace of every position (trace --every-position)")
    if ("exact" in resumes.split(",")) != bool(data.get("every_position")):
        raise SystemExit("--resume exact reads a trace of every position (trace --every-position), and only it")
    for name, value in (x.split("=") for x in args.chooser_set.split(",") if x):
        if not isinstance(getattr(budget_module, name, None), (int, float)):
            raise SystemExit(f"--chooser-set: drafttree.engine.budget has no number {name}")
        setattr(budget_module, name, type(getattr(budget_module, name))(value))
    prices = {int(b): float(ms) for b, ms in (x.split(":") for x in args.prices.split(","))}
    missing = [b for b in (0, *budgets) if b not in prices]
    if missing:
        raise SystemExit(f"--prices lacks budgets {missing} (the trace's are {budgets})")
    plain = args.batch / prices[0]   # a plain round commits a token a row
    rows = []
    policies: list[tuple[int | str, float]] = [(b, 0.0) for b in budgets] + [("oracle", 0.0)]
    policies += [("auto", float(x)) for x in args.auto_extra_ms.split(",")]
    noises = [float(x) for x in args.timing_noise.split(",")]
    # every prompt set together ("all"), then each apart (a trace's keys are "set/index", a set
    # may be a file's path)
    sets = {"all": traces}
    for key, rounds in traces.items():
        sets.setdefault(key.rsplit("/", 1)[0], {})[key] = rounds
    for resume in resumes.split(","):
        for group, chosen in sets.items():
            for policy, extra, sigma in [(p, e, 0.0) for p, e in policies] + [
                    ("auto", e, n) for p, e in policies if p == "auto" for n in noises if n]:
                if isinstance(policy, int) and resume == "conservative":
                    continue   # a fixed budget never resumes mid-way
                if args.batch > 1:
                    if sigma or extra or resume != "exact":
                        continue   # batched: exact traces, no noise or extra cost
                    r = replay_batched(budgets, chosen, policy, prices, args.batch)
                elif sigma:   # one draw of the noise is one machine's run: NOISE_SEEDS of them, the median's
                    runs = sorted((replay(budgets, chosen, policy, prices, extra, resume, sigma, seed)
                                   for seed in range(NOISE_SEEDS)), key=lambda x: x["tokens_per_ms"])
                    r = dict(runs[len(runs) // 2], tokens_per_ms_range=[runs[0]["tokens_per_ms"], runs[-1]["tokens_per_ms"]])
                else:
                    r = replay(budgets, chosen, policy, prices, extra, resume)
                r.update(policy=str(policy), extra_ms=extra, resume=resume, prompt_set=group, timing_noise=sigma,
                         speedup=r["tokens_per_ms"] / plain)
                rows.append(r)
                name = (f"{group}: {policy}" + (f" (+{extra} ms a drafting round)" if extra else "")
                        + (f" (timing noise {sigma})" if sigma else "") + f", {resume}")
                spread = (f" ({r['tokens_per_ms_range'][0] * prices[0]:.3f}-{r['tokens_per_ms_range'][1] * prices[0]:.3f})"
                          if sigma else "")
                print(f"{name:56s} {r['tokens_per_ms']:.3f} tok/ms  {r['speedup']:.3f}x plain{spread}  rounds {r['rounds']}")
    out = {"trace": args.trace, "draft_model": data.get("draft_model"), "max_tokens": data.get("max_tokens"),
           "prompts": len(traces), "recorded_rounds": sum(map(len, traces.values())),
           "prices_ms": {str(b): v for b, v in prices.items()}, "chooser_set": args.chooser_set, "batch": args.batch, "results": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace")
    t.add_argument("--model", default=None)
    t.add_argument("--draft-model", default=None)
    t.add_argument("--device", default=None)
    t.add_argument("--dtype", default="float32")
    t.add_argument("--prompts", default="sharegpt-heldout,humaneval")
    t.add_argument("--num-prompts", type=int, default=16)
    t.add_argument("--max-tokens", type=int, default=128)
    t.add_argument("--every-position", action="store_true",
                   help="record the round that would start at every position of the plain output, not only "
                        "those a fixed budget reaches (a request a position, batched)")
    t.add_argument("--out", required=True)
    r = sub.add_parser("replay")
    r.add_argument("trace")
    r.add_argument("--prices", required=True, help="budget:ms,... for 0 (plain) and every traced budget")
    r.add_argument("--auto-extra-ms", default="0", help="extra ms on each drafting round of `auto`, comma-separated")
    r.add_argument("--resume", default=None,
                   help="how a draft resumed mid-way through a recorded round is scored: optimistic, conservative "
                        "or both (default); exact for a trace of every position (its default)")
    r.add_argument("--timing-noise", default="0",
                   help="log-normal sigmas, comma-separated, of the round seconds `auto` observes: each also replayed")
    r.add_argument("--batch", type=int, default=1,
                   help="rows a round (a trace of every position only): the prompts in batches, as the bench runs them")
    r.add_argument("--chooser-set", default="", help="NAME=VALUE,...: the chooser's constants (PROBE_SHARE, EMA, ...)")
    r.add_argument("--out", default=None)
    a = ap.parse_args()
    trace(a) if a.cmd == "trace" else replay_main(a)


if __name__ == "__main__":
    main()
