"""The figures of a `drafttree bench serve` run: each request's result, percentiles, the printed
table and the plot."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class RequestResult:
    index: int                    # into the prompt list
    start_s: float                # sent, seconds after the run began
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)   # gaps between chunks that carried text
    latency_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0        # from the server's usage

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


PERCENTILES = (50, 90, 99)


def stats_ms(values: list[float]) -> dict[str, float | None]:
    """Mean and percentiles, in milliseconds, of values in seconds (None when there are none)."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values) * 1e3
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration_s,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s, "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "ttft_ms": stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": stats_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": stats_ms([x for r in ok for x in r.itl_s]),
        "e2el_ms": stats_ms([r.latency_s for r in ok]),
        "errors": dict(Counter(r.error for r in results if not r.ok).most_common(5)),
    }


def print_table(s: dict[str, Any]) -> None:
    print(f"{'completed / failed':<28}{s['completed']} / {s['failed']}")
    print(f"{'duration':<28}{s['duration_s']:.2f} s")
    print(f"{'input / output tokens':<28}{s['total_input_tokens']} / {s['total_output_tokens']}")
    print(f"{'requests/s':<28}{s['request_throughput']:.2f}")
    print(f"{'output tokens/s':<28}{s['output_throughput']:.1f}")
    print(f"{'total tokens/s':<28}{s['total_token_throughput']:.1f}")
    print(f"{'ms':<10}{'mean':>10}" + "".join(f"{'p' + str(p):>10}" for p in PERCENTILES))
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E")):
        row = s[key]
        print(f"{name:<10}" + "".join(f"{row[k]:>10.1f}" if row[k] is not None else f"{'-':>10}"
                                      for k in ["mean"] + [f"p{p}" for p in PERCENTILES]))
    for message, n in s["errors"].items():
        print(f"error x{n}: {message}")


def plot(results: list[RequestResult], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].hist([1e3 * r.ttft_s for r in ok if r.ttft_s is not None], bins=30)
    axes[0].set_xlabel("time to first token (ms)")
    axes[1].hist([1e3 * x for r in ok for x in r.itl_s], bins=50)
    axes[1].set_xlabel("inter-token latency, per chunk (ms)")
    for ax in axes[:2]:
        ax.set_ylabel("count")
    axes[2].scatter([r.start_s for r in ok], [1e3 * r.latency_s for r in ok], s=8, label="end to end")
    axes[2].scatter([r.start_s for r in ok], [1e3 * (r.ttft_s or 0) for r in ok], s=8, label="first token")
    axes[2].set_xlabel("sent at (s)")
    axes[2].set_ylabel("ms")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
