"""What a constrained request's arrival costs the engine's thread: `Engine.add_request` seconds for
requests whose JSON schema is a call of one of N tools (the form a `tool_choice: required` request
takes), the grammar's text already checked once (an agent sends the same tools again), the median
of --repeats; the engine's rounds for every other request wait that long.

    python benchmarks/grammar_admit_bench.py [--tools 1,8,32] [--repeats 15] [--device cpu] [--out admit.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # this checkout's drafttree

from drafttree import LLM, SamplingParams
from drafttree.structured.params import StructuredOutputs


def tool_call(i: int) -> dict:
    args = {"type": "object", "properties": {
        "city": {"type": "string"}, "units": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "filters": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"},
                                                                               "v": {"type": "number"}},
                                               "required": ["k", "v"]}}}, "required": ["city"]}
    return {"type": "object", "properties": {"name": {"const": f"tool_{i}"}, "arguments": args},
            "required": ["name", "arguments"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tools", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="also write the figures (JSON) here")
    a = ap.parse_args()
    llm = LLM(budget=8, max_num_seqs=4, **({"device": a.device} if a.device else {}))
    eng = llm.engine
    report: dict = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv),
                             "device": eng.runner.device.type, "repeats": a.repeats}, "add_request_ms": {}}
    for n in (int(x) for x in a.tools.split(",")):
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [tool_call(i) for i in range(n)]}}
        params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputs(json=schema))
        eng.abort(eng.add_request("Call a tool.", params))   # the text checked once
        seconds = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            seq = eng.add_request("Call a tool.", params)
            seconds.append(time.perf_counter() - t0)
            eng.abort(seq)
        ms = sorted(1e3 * s for s in seconds)
        report["add_request_ms"][str(n)] = {"median": statistics.median(ms), "min": ms[0], "max": ms[-1]}
        print(f"{n:3d} tools: add_request {statistics.median(ms):.2f} ms (min {ms[0]:.2f}, max {ms[-1]:.2f})")
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
