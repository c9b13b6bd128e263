#!/usr/bin/env bash
# Run 18, call 6: SmolLM2-135M shape, plain decode step (no drafter), alternating: the code's
# one-token GEMV blocks against call 2's sweep.
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 DRAFTTREE_CACHE=/tmp/drafttree-cache; mkdir -p $OUT/l; P="--batch 1 --prompt-len 512 --max-model-len 2048 --iters 30 --tree-budgets"; for i in 1 2; do for b in code sweep; do e=(); [ $b = sweep ] && e=(DRAFTTREE_BLOCKS=/tmp/smol1.json); env "${e[@]}" timeout 60 python3 -m drafttree.bench.phases $P "" --random-weights smollm2-135m --spec none --out $OUT/l/none_${b}_$i.json > $OUT/l/none_${b}_$i.txt 2>&1; echo "$b $i: $(grep -h '"decode"\|Error' $OUT/l/none_${b}_$i.txt | tail -1 | tr -s ' \n' ' ')"; done; done; tar czf $OUT/l.tgz -C $OUT l && rm -rf $OUT/l
