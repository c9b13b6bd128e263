#!/usr/bin/env bash
# Run 19, call 1: the GGUF's first part; on the SmolLM2-135M shape's DDTree round (B = 32,
# block 16): the compiled acceptance walk and draft inputs against the torch ops before them
# (the package rebuilt in /tmp by reversing their diff), alternating, one process each; the
# round's few-row tiles without input splits (no second launch to add them; DRAFTTREE_BLOCKS
# files), and a kernel profile of the round and of the decode step with PDL off.
# Usage: mkdir -p .ab && git diff 2ffab6b 233c9dd -- drafttree/spec > .ab/spec_pieces.diff
#        OUT=dir bash benchmarks/results/2026-12-01_h200_run19/call1.sh   (.ab/split1*.json: see the record)
set -uo pipefail
O=$(realpath -m "${OUT:-out}"); mkdir -p "$O/logs"; L=$O/logs
export PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$O/machine.txt"
rm -f /tmp/gguf.asm; cat .parts/g3.00 >> /tmp/gguf.asm
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r drafttree /tmp/old/ && (cd /tmp/old && patch -s -R -p1 < "$OLDPWD/.ab/spec_pieces.diff")
P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --tree-budgets"
phases() {   # name, package root, extra env
  (cd $2 && env PYTHONPATH=$2:/tmp/site ${3:-} timeout 60 python3 -m drafttree.bench.phases $P "" --random-weights smollm2-135m \
    --spec ddtree --budget 32 --block-size 16 --out "$L/$1.json" > "$L/$1.txt" 2>&1)
  echo "$1: $(grep -h '"draft_and\|"verify_acc\|"round"\|Error\|failed' "$L/$1.txt" | tail -4 | tr -s ' \n' ' ')"
}
for i in 1 2; do
  phases new_$i $PWD
  phases old_$i /tmp/old
done
phases split1 $PWD DRAFTTREE_BLOCKS=$PWD/.ab/split1.json
phases split1_bn32 $PWD DRAFTTREE_BLOCKS=$PWD/.ab/split1_bn32.json
phases new_3 $PWD
for s in ddtree none; do
  PYTHONPATH=.:/tmp/site DRAFTTREE_PDL=0 timeout 90 python3 benchmarks/profile_decode.py smollm2-135m $s > "$L/profile_$s.txt" 2>&1
  echo "profile $s: $(grep -c . "$L/profile_$s.txt") lines"
done
tar czf "$O/logs.tgz" -C "$O" logs && rm -rf "$L"
