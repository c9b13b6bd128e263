"""drafttree bench serve: load on a running OpenAI-compatible server, as `vllm bench serve` or
SGLang's bench_serving do: streamed requests sent at a Poisson rate (or all at once) under an
optional concurrency cap; reports time to first token (TTFT), inter-token latency (ITL, between
streamed chunks), time per output token (TPOT, after the first), end-to-end latency,
throughputs and errors; writes results.json and a plot into --out.

Output tokens are what the server reports in each stream's usage. A chunk may carry several
tokens (a speculative round commits up to τ), so ITL is per chunk and TPOT per token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from drafttree.bench.prompts import Prompt, load_prompts
from drafttree.bench.serve_report import RequestResult, plot, print_table, summarize

# Common English words, most one token each with their leading space: a shared prefix of N of
# them is about N tokens for the usual BPE vocabularies.
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had "
         "by word but not what all were we when your can said there use an each which she do how their if will "
         "up other about out many then them these so some her would make like him into time has look two more "
         "write go see number no way could people my than first water been call who oil its now find long down "
         "day did get come made may part").split()


def shared_prefix(n_words: int) -> str:
    return "You are a helpful assistant. " + " ".join(WORDS[i % len(WORDS)] for i in range(n_words))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="drafttree bench serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="/v1/chat/completions (prompts as a user message) or /v1/completions (raw)")
    p.add_argument("--model", default=None, help="default: the server's one model (/v1/models)")
    p.add_argument("--dataset", default="humaneval", help="humaneval | sharegpt-heldout (drafttree.bench.prompts)")
    p.add_argument("--dataset-path", default=None, help="a .jsonl file of {\"prompt\": ...} or {\"prompt_ids\": [...]}")
    p.add_argument("--num-prompts", type=int, default=64, help="requests sent (the prompts are cycled)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="every request generates --max-tokens")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="prepend the same system prompt of this many common words (about as many tokens)")
    p.add_argument("--seed", type=int, default=0, help="of the arrival times")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the server's /ready")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", default=None, help="directory for results.json and serve_latency.png")
    return p


def request_body(a: argparse.Namespace, model: str, prompt: Prompt, prefix: str) -> tuple[str, dict]:
    common = {"model": model, "max_tokens": a.max_tokens, "temperature": a.temperature, "stream": True,
              "stream_options": {"include_usage": True}}
    if a.ignore_eos:
        common["ignore_eos"] = True
    if isinstance(prompt, list):   # token ids: completions only
        ids = [100 + i % 1000 for i in range(a.shared_prefix_len)] + prompt
        return "/v1/completions", {**common, "prompt": ids}
    if a.endpoint == "completions":
        return "/v1/completions", {**common, "prompt": f"{prefix}\n\n{prompt}" if prefix else prompt}
    messages = ([{"role": "system", "content": prefix}] if prefix else []) + [{"role": "user", "content": prompt}]
    return "/v1/chat/completions", {**common, "messages": messages}


async def send(client: httpx.AsyncClient, path: str, body: dict, res: RequestResult, t0: float) -> None:
    sent = time.perf_counter()
    res.start_s = sent - t0
    last = None
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                res.error = f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.ok = res.error is None
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message", obj["error"]))
                    continue
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"]["prompt_tokens"]
                    res.output_tokens = obj["usage"]["completion_tokens"]
                for ch in obj.get("choices") or []:
                    text = ch.get("delta", {}).get("content") if "delta" in ch else ch.get("text")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft_s = now - sent
                        else:
                            res.itl_s.append(now - last)
                        last = now
            if not res.ok and res.error is None:
                res.error = "the stream ended without [DONE]"
    except (httpx.HTTPError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.latency_s = time.perf_counter() - sent


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: Poisson arrivals at `rate`."""
    if rate == float("inf"):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run(a: argparse.Namespace, prompts: list[Prompt]) -> tuple[list[RequestResult], float, str]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=a.base_url, timeout=a.timeout, limits=limits) as client:
        await wait_ready(client, a.ready_timeout)
        model = a.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        prefix = shared_prefix(a.shared_prefix_len) if a.shared_prefix_len else ""
        gate = asyncio.Semaphore(a.max_concurrency) if a.max_concurrency else None
        results = [RequestResult(i % len(prompts), 0.0) for i in range(a.num_prompts)]
        t0 = time.perf_counter()

        async def one(res: RequestResult, at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            path, body = request_body(a, model, prompts[res.index], prefix)
            if gate is None:
                await send(client, path, body, res, t0)
            else:
                async with gate:
                    await send(client, path, body, res, t0)

        await asyncio.gather(*(one(r, at) for r, at in zip(results, arrival_times(a.num_prompts, a.request_rate,
                                                                                 a.seed))))
        return results, time.perf_counter() - t0, model


async def wait_ready(client: httpx.AsyncClient, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = await client.get("/ready")
            if r.status_code in (200, 404):   # 404: a server without /ready
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server was not ready within {timeout:g} s")
        await asyncio.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.num_prompts < 1 or a.max_tokens < 1 or a.request_rate <= 0:
        raise ValueError("--num-prompts, --max-tokens and --request-rate must be positive")
    source = a.dataset_path or a.dataset
    prompts = load_prompts(source, a.num_prompts)
    if not prompts:
        raise ValueError(f"no prompts in {source}")
    results, duration, model = asyncio.run(run(a, prompts))
    summary = summarize(results, duration)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": "drafttree bench serve " + " ".join(
        sys.argv[3:] if argv is None else argv), "base_url": a.base_url, "model": model, "endpoint": a.endpoint,
        "dataset": source, "num_prompts": a.num_prompts, "max_tokens": a.max_tokens,
        "request_rate": a.request_rate if a.request_rate != float("inf") else "inf",
        "max_concurrency": a.max_concurrency, "shared_prefix_len": a.shared_prefix_len,
        "temperature": a.temperature, "ignore_eos": a.ignore_eos}
    print_table(summary)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        reqs = [dict(asdict(r), tpot_s=r.tpot_s) for r in results]
        (out / "results.json").write_text(json.dumps({"meta": meta, "summary": summary, "requests": reqs}, indent=1))
        plot(results, out / "serve_latency.png")
        print(f"wrote {out / 'results.json'} and serve_latency.png")
    return 0 if summary["failed"] == 0 else 1
