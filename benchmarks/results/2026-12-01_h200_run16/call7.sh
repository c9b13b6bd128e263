#!/usr/bin/env bash
# Run 16, call 7: under PDL, one setting changed per process from the code's (c0ab71d): the QKV,
# gate/up and o projections' GEMV blocks (rows per program, columns per step, warps, steps before
# the wait) and the attention's target programs; the decode step of each.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run16/call7.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --random-weights qwen3-8b --tree-budgets"
decode_with() {   # "KIND NUMEL BN BK WARPS PRE" or "attn TARGET" or "-": the decode step with that setting
  timeout 45 python3 -c "import sys, drafttree.models.gemv_kernel as g, drafttree.models.attn_kernel as a
s = '$1'.split()
if s[0] == 'attn': a.TARGET_PROGRAMS = int(s[1])
elif s[0] != '-': g.set_blocks(s[0], int(s[1]), tuple(map(int, s[2:])))
print('setting', s, g.BLOCKS, a.TARGET_PROGRAMS)
from drafttree.bench.phases import main; sys.exit(main())" $P "" --spec none "${@:2}"
}
i=0
while read -r cfg; do
  i=$((i + 1))
  decode_with "$cfg" --out "$L/decode_${i}.json" > "$L/decode_${i}.txt" 2>&1
  echo "decode $i [$cfg]: $(grep -h '"decode"\|Error' "$L/decode_${i}.txt" | tail -1)"
done <<'CFGS'
-
norm 25165824 8 1024 4 1
norm 25165824 8 512 4 1
norm 25165824 16 512 4 2
glu 100663296 8 512 4 1
glu 100663296 4 512 4 2
plain 16777216 4 512 8 4
attn 132
attn 528
-
CFGS
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
