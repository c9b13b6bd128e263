#!/usr/bin/env python3
"""Whole-process start-up: `drafttree generate` from launch to exit, and `drafttree serve` from
launch to /ready, cold (an empty cache directory: conversion, compiles and the cost model from
nothing) and warm (the same directory again), with the longest silence of each (the longest gap
between two writes to stdout or stderr, counting the launch and the exit or /ready), the
start-up stages the process printed and, for generate, its tokens/s.

Several source trees run side by side in one call (`--tree before=/path/to/checkout`), each a
directory holding the `drafttree` package: `python -m drafttree` (the `drafttree` command) runs from there. Every
(tree, configuration) gets a cache directory of its own under --work (DRAFTTREE_CACHE, and
TRITON_HOME for Triton's default cache): the first run is cold, the later ones warm.

    python benchmarks/startup_bench.py --device cpu --reps 3 --out startup.json
    python benchmarks/startup_bench.py --tree before=/tmp/base --tree after=. --serve --out startup.json

Prints a table and writes every run to --out (JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import selectors
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CONFIGS = {
    "default": [],
    "seed": ["--spec", "ddtree", "--block-size", "8", "--budget", "32"],
    "none": ["--spec", "none"],
    "eager": [],      # the small fused pieces run as torch ops (no torch.compile)
    "compiled": [],   # the small fused pieces compiled (generate's default runs them as torch ops)
    "late-device": [],   # the GPU started by torch's first call, not at launch beside the imports
}
CONFIG_ENV = {"eager": {"DRAFTTREE_COMPILE": "0"}, "compiled": {"DRAFTTREE_COMPILE": "1"},
              "late-device": {"DRAFTTREE_EARLY_DEVICE": "0"}}
STAGE = re.compile(r"start-up: (\S.*?)\s+(\d+\.\d+) s")
RATE = re.compile(r"\[(\d+) tokens in ([\d.]+) s: ([\d.]+) tokens/s")


def launch(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def stop(proc: subprocess.Popen) -> None:
    """End the process: asked first, killed after 30 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def follow(proc: subprocess.Popen, t0: float, until=None, timeout: float = 1800.0, ignore: str | None = None) -> dict:
    """Read the process's output as it comes, with the time of each write, until it exits (or
    until() says stop). Returns the text and the gaps between writes; a write whose lines all
    match `ignore` (a server's access log of our own /ready polls) breaks no silence. `timeline`:
    each write's seconds since t0, stream and last line (cut): where the silences are."""
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    times, chunks, open_ = [t0], {"stdout": b"", "stderr": b""}, 2
    timeline: list[tuple[float, str, str]] = []
    stopped_at = None
    while open_ and time.perf_counter() - t0 < timeout:
        for key, _ in sel.select(timeout=0.05):
            try:
                data = os.read(key.fileobj.fileno(), 1 << 16)
            except BlockingIOError:
                continue
            if data:
                lines = [x for x in data.decode(errors="replace").splitlines() if x.strip()]
                name = "stdout" if key.fileobj is proc.stdout else "stderr"
                if ignore is None or not all(re.search(ignore, x) for x in lines):
                    times.append(time.perf_counter())
                    if lines and len(timeline) < 400:
                        timeline.append((round(times[-1] - t0, 3), name, lines[-1].strip()[-100:]))
                chunks[name] += data
            else:   # end of file
                sel.unregister(key.fileobj)
                open_ -= 1
        if until is not None and until():
            stopped_at = time.perf_counter()
            break
    end = stopped_at or time.perf_counter()
    timed_out = stopped_at is None and bool(open_)
    if stopped_at is None:
        if timed_out:   # still running at --run-timeout: stopped, its record kept
            stop(proc)
        proc.wait(timeout=60)
        end = time.perf_counter()
    times.append(end)
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"seconds": end - t0, "longest_silence_s": max(gaps),
            "first_output_s": times[1] - t0 if len(times) > 2 else None,
            "timeline": timeline + [(round(end - t0, 3), "exit", "")],
            "stdout": chunks["stdout"].decode(errors="replace"), "stderr": chunks["stderr"].decode(errors="replace"),
            "rc": proc.returncode, "timed_out": timed_out}


def stages(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, s in STAGE.findall(text):
        name = name.strip()
        out[name] = out.get(name, 0.0) + float(s)
    return out


EXTRA_ENV: dict[str, str] = {}   # --env


def save(a: argparse.Namespace, trees: dict[str, Path], runs: list[dict]) -> None:
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
            "host": platform.node(), "cpus": os.cpu_count(), "device": a.device,
            "trees": {k: str(v) for k, v in trees.items()},
            "prompt": a.prompt, "max_tokens": a.max_tokens, "env": EXTRA_ENV, "loadavg_end": os.getloadavg()}
    Path(a.out).write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))


def env_for(cache: Path, device: str, config_env: dict[str, str]) -> dict[str, str]:
    # PYTHONPATH is kept (where the extras live); `python -m` puts the tree's own root first.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    env.update(DRAFTTREE_CACHE=str(cache), TRITON_HOME=str(cache), PYTHONUNBUFFERED="1", **EXTRA_ENV, **config_env)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_generate(tree: Path, env: dict[str, str], args: list[str], a: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "drafttree", "generate", a.prompt, "--max-tokens", str(a.max_tokens), *args]
    t0 = time.perf_counter()
    r = follow(launch(cmd, tree, env), t0, timeout=a.run_timeout)
    m = RATE.search(r["stderr"])
    r.update(stages=stages(r["stderr"]), tokens=int(m.group(1)) if m else None,
             decode_s=float(m.group(2)) if m else None, tokens_per_s=float(m.group(3)) if m else None)
    if r["rc"] != 0:
        print(r["stderr"][-2000:], file=sys.stderr)
    r.pop("stdout")
    r["stderr"] = r["stderr"][-4000:]
    return r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""
    except OSError:
        return 0, ""


def run_serve(tree: Path, env: dict[str, str], args: list[str], a: argparse.Namespace) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "drafttree", "serve", "--port", str(port), *args]
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = launch(cmd, tree, env)
    polled = [0.0]

    def ready() -> bool:
        if proc.poll() is not None:
            return True
        now = time.perf_counter()
        if now - polled[0] < 0.1:
            return False
        polled[0] = now
        return _get(url + "/ready")[0] == 200

    r = follow(proc, t0, until=ready, timeout=a.run_timeout, ignore=r'"GET /(ready|metrics) HTTP')
    r["ready"] = proc.poll() is None
    metrics = _get(url + "/metrics")[1] if r["ready"] else ""
    r["metrics_stages"] = {m.group(1): float(m.group(2)) for m in
                           re.finditer(r'drafttree_startup_seconds\{stage="([^"]+)"\} ([\d.e+-]+)', metrics)}
    # work left for after /ready (defer_graphs): when the idle server had done it all. Its output is
    # read meanwhile (a pipe nobody reads fills, and the server then blocks on its next log line),
    # and the gauge's count is kept every few seconds and printed, for a call stopped before the end.
    r["graphs_done_s"], r["pending"] = None, []
    if r["ready"] and a.graphs_wait_s > time.perf_counter() - t0:
        last = [0.0]

        def idle_done() -> bool:
            now = time.perf_counter()
            if proc.poll() is not None or now - last[0] < 0.25:
                return proc.poll() is not None
            last[0] = now
            m = re.search(r"^drafttree_cuda_graph_sets_pending ([\d.e+-]+)", _get(url + "/metrics")[1], re.MULTILINE)
            if m is None:
                return True
            n = float(m.group(1))
            if not r["pending"] or now - t0 - r["pending"][-1][0] >= 5 or n == 0:
                r["pending"].append((round(now - t0, 2), n))
                print(f"  idle work: {n:.0f} pending at {now - t0:.0f} s", flush=True)
            if n == 0:
                r["graphs_done_s"] = now - t0
            return n == 0

        idle = follow(proc, t0, until=idle_done, timeout=a.graphs_wait_s, ignore=r'"GET /(ready|metrics) HTTP')
        r["idle_timeline"] = idle["timeline"][-60:]
        r["stderr"] += idle["stderr"]
        # each kind of idle work's host seconds and pieces, as the server logged them when it was done
        r["idle_work"] = {m.group(1): {"pieces": int(m.group(2)), "seconds": float(m.group(3))} for m in
                          re.finditer(r"work left for later: (.+?) done, (\d+) pieces in ([\d.]+) s", idle["stderr"])}
    stop(proc)
    r["stages"] = stages(r["stderr"])
    r.pop("stdout")
    r["stderr"] = r["stderr"][-4000:]
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                   help="a source tree to run (default: this checkout, as 'here'); repeat to compare")
    p.add_argument("--configs", default="default,seed,none", help=f"of {', '.join(CONFIGS)}")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--reps", type=int, default=2, help="warm runs after the cold one")
    p.add_argument("--run-timeout", type=float, default=1800.0,
                   help="seconds a run may take; one still running then is stopped and recorded (timed_out)")
    p.add_argument("--serve", action="store_true", help="also time `drafttree serve` to /ready (and to the "
                   "last graph set it captures after /ready, while idle: graphs_done_s)")
    p.add_argument("--graphs-wait-s", type=float, default=180.0, help="with --serve: how long after launch to wait "
                   "for the graph sets left for after /ready")
    p.add_argument("--no-generate", action="store_true", help="time serve only")
    p.add_argument("--prompt", default="Write quicksort in Python.")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--keep-models", action="store_true",
                   help="cold runs find the converted default model (linked from the user's cache): no conversion")
    p.add_argument("--work", default=None, help="where the cache directories go (default: a temporary directory)")
    p.add_argument("--warm-only", action="store_true",
                   help="keep the cache directories --work holds (from an earlier call's runs) and run warm only: "
                        "--reps runs per configuration and tree, no cold one")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="set in every run's environment (e.g. OMP_WAIT_POLICY=PASSIVE)")
    p.add_argument("--out", default="startup_bench.json")
    a = p.parse_args()
    EXTRA_ENV.update(e.split("=", 1) for e in a.env)
    trees = dict(t.split("=", 1) for t in a.tree) if a.tree else {"here": str(Path(__file__).resolve().parent.parent)}
    trees = {k: Path(v).resolve() for k, v in trees.items()}
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    work = Path(a.work or tempfile.mkdtemp(prefix="startup_bench_"))
    kinds = ([] if a.no_generate else ["generate"]) + (["serve"] if a.serve else [])
    runs = []
    for kind in kinds:
        caches = {}
        for cfg in configs:
            for name in trees:
                cache = caches[cfg, name] = work / f"{kind}-{cfg}-{name}"
                if a.warm_only:
                    cache.mkdir(parents=True, exist_ok=True)
                    continue
                shutil.rmtree(cache, ignore_errors=True)
                cache.mkdir(parents=True)
                if a.keep_models:
                    user = Path(os.environ.get("DRAFTTREE_CACHE", Path.home() / ".cache" / "drafttree"))
                    user = user.resolve() / "models"   # a link's target must not depend on the working directory
                    if user.is_dir():
                        (cache / "models").symlink_to(user)
        # configs and trees take turns, run by run: a load that comes and goes weighs on each alike
        for i in range(1 if a.warm_only else 0, 1 + a.reps):
            for cfg in configs:
                for name, tree in trees.items():
                    phase = "cold" if i == 0 else "warm"
                    fn = run_generate if kind == "generate" else run_serve
                    load = os.getloadavg()[0]
                    before = resource.getrusage(resource.RUSAGE_CHILDREN)
                    env = env_for(caches[cfg, name], a.device, CONFIG_ENV.get(cfg, {}))
                    r = fn(tree, env, CONFIGS[cfg] + (["--device", a.device] if a.device == "cpu" else []), a)
                    after = resource.getrusage(resource.RUSAGE_CHILDREN)
                    r.update(kind=kind, config=cfg, config_env=CONFIG_ENV.get(cfg, {}), tree=name, phase=phase, rep=i, loadavg_before=load,
                             cpu_s=(after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
                    runs.append(r)
                    tps = f"{r['tokens_per_s']:.1f} tok/s" if r.get("tokens_per_s") else ""
                    print(f"{kind:<8} {cfg:<8} {name:<8} {phase:<5} {r['seconds']:7.2f} s  silence "
                          f"{r['longest_silence_s']:5.2f} s  cpu {r['cpu_s']:6.1f} s  load {load:4.1f}  rc {r['rc']}  "
                          f"{tps}", flush=True)
                    if r.get("idle_work") or r.get("graphs_done_s"):
                        done = r.get("graphs_done_s")
                        print(f"  idle work done at {done:.1f} s:" if done else "  idle work not done:",
                              ", ".join(f"{k} {v['pieces']} in {v['seconds']:.1f} s" for k, v in r["idle_work"].items()),
                              flush=True)
                    save(a, trees, runs)   # after every run: a call cut short keeps what it measured
    save(a, trees, runs)
    print(f"\n{'kind':<8} {'config':<8} {'tree':<8} {'phase':<5} {'runs':>4} {'median s':>9} {'min s':>7} "
          f"{'max silence s':>13} {'cpu s':>7} {'tok/s':>7}")
    for kind in kinds:
        for cfg in configs:
            for name in trees:
                for phase in ("cold", "warm"):
                    # a run stopped at --run-timeout, or a server that never answered /ready, times nothing
                    rs = [r for r in runs if (r["kind"], r["config"], r["tree"], r["phase"]) == (kind, cfg, name, phase)
                          and not r["timed_out"] and r.get("ready", True)]
                    if not rs:
                        continue
                    secs = [r["seconds"] for r in rs]
                    tps = [r["tokens_per_s"] for r in rs if r.get("tokens_per_s")]
                    print(f"{kind:<8} {cfg:<8} {name:<8} {phase:<5} {len(rs):>4} {statistics.median(secs):>9.2f} "
                          f"{min(secs):>7.2f} {max(r['longest_silence_s'] for r in rs):>13.2f} "
                          f"{statistics.median(r['cpu_s'] for r in rs):>7.1f} "
                          f"{statistics.median(tps) if tps else float('nan'):>7.1f}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
