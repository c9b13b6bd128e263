#!/usr/bin/env bash
# Run 21, call 2: tests/test_cuda_graphs.py whole (call 1's 200 s ran out after 32 of 73 cases,
# all passed, while the kernels compiled on a cold machine); then the compile caches
# (Triton's and inductor's) are packed into $OUT so later cold calls can start from them.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run21/call2.sh
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
if [ -f .kcache/kcache.tgz ]; then tar -C / -xzf .kcache/kcache.tgz; fi
timeout 480 python3 -m pytest -q -p no:cacheprovider -rf tests/test_cuda_graphs.py > "$OUT/graphs.log" 2>&1
tail -n 2 "$OUT/graphs.log"; echo "resets: $(grep -c 'CUDAGraph::reset' "$OUT/graphs.log")"
du -sh ~/.triton/cache /tmp/torchinductor_* 2>/dev/null
tar -C / -czf "$OUT/kcache.tgz" "${HOME#/}/.triton/cache" $(cd / && ls -d tmp/torchinductor_* 2>/dev/null) 2>/dev/null
ls -la "$OUT"
