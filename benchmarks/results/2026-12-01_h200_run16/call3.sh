#!/usr/bin/env bash
# Run 16, call 3: PDL mode 2 by default, the GEMV steps before the wait in gemv_kernel.BLOCKS
# (o and down projections: 2). The decode step with the o / down projections' steps before the
# wait set per process; the DDTree round with PDL on / off; the DFlash round.
# Usage: OUT=dir bash benchmarks/results/2026-12-01_h200_run16/call3.sh
set -uo pipefail
O=${OUT:-out}; mkdir -p "$O/logs"; L=$O/logs
export PYTHONPATH=.:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --random-weights qwen3-8b --tree-budgets"
phases_with() {   # "O_PRE DOWN_PRE" ARGS: drafttree.bench.phases with those steps before the wait
  timeout 60 python3 -c "import sys, drafttree.models.gemv_kernel as g
o, down = map(int, '$1'.split())
for least, b in list(g.BLOCKS['plain']):
    pre = down if least == 1 << 25 else o if least == 1 << 22 else b[3]
    g.set_blocks('plain', max(least, 1), b[:3] + (pre,))
print('plain blocks', g.BLOCKS['plain'])
from drafttree.bench.phases import main; sys.exit(main())" $P "" "${@:2}"
}
i=0
for cfg in "2 2" "4 2" "4 1" "2 1" "2 2" "1 1"; do
  i=$((i + 1))
  phases_with "$cfg" --spec none --out "$L/decode_${i}.json" > "$L/decode_${i}.txt" 2>&1
  echo "decode $i o/down before the wait $cfg: $(grep -h '"decode"\|Error' "$L/decode_${i}.txt" | tail -1)"
done
DRAFTTREE_PDL=0 timeout 60 python3 -m drafttree.bench.phases $P "" --spec none --out "$L/decode_pdl0.json" > "$L/decode_pdl0.txt" 2>&1
echo "decode PDL=0: $(grep -h '"decode"\|Error' "$L/decode_pdl0.txt" | tail -1)"
for p in 2 0; do
  DRAFTTREE_PDL=$p timeout 80 python3 -m drafttree.bench.phases $P "" --spec ddtree --budget 32 --block-size 16 \
    --out "$L/ddtree_pdl$p.json" > "$L/ddtree_pdl$p.txt" 2>&1
  echo "ddtree PDL=$p:"; grep -h '"decode"\|"round\|draft_and\|verify_acc\|Error' "$L/ddtree_pdl$p.txt" | tail -5
done
timeout 80 python3 -m drafttree.bench.phases $P "" --spec dflash --block-size 16 --out "$L/dflash.json" > "$L/dflash.txt" 2>&1
echo "dflash:"; grep -h '"decode"\|"round\|draft\|verify_acc\|Error' "$L/dflash.txt" | tail -5
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
