#!/usr/bin/env bash
# GPU run for the CUDA-graph work: GPU tests, then per-phase latency (eager vs graphed) on
# random-weight Qwen3-8B and SmolLM2-135M shapes. Writes logs and JSON under ${OUT:-out}.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest tests/test_cuda_graphs.py tests/test_tree.py -q -x 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
for spec in "ddtree --budget 32" "dflash" "none"; do
  name=$(echo $spec | tr -d ' -')
  python3 -m drafttree.bench.phases --random-weights qwen3-8b --spec $spec --block-size 16 \
    --prompt-len 512 --max-model-len 2048 --iters 30 --out "$OUT/phases_qwen3-8b_${name}.json" > /dev/null \
    2> "$OUT/err_q_${name}.log" || tail -5 "$OUT/err_q_${name}.log"
  python3 -m drafttree.bench.phases --random-weights smollm2-135m --spec $spec --block-size 16 \
    --prompt-len 512 --max-model-len 2048 --iters 50 --out "$OUT/phases_smollm2_${name}.json" > /dev/null \
    2> "$OUT/err_s_${name}.log" || tail -5 "$OUT/err_s_${name}.log"
done
python3 - "$OUT" <<'PY'
import json, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/phases_*.json")):
    r = json.load(open(f))
    e = {k: round(v, 3) for k, v in r["eager_ms"].items()}
    g = {k: round(v, 3) for k, v in r["graph_ms"].items()}
    print(f.split("/")[-1], "\n  eager", e, "\n  graph", g)
PY
