#!/usr/bin/env bash
# Planned against measured peak memory per rank, as `tensorpar train` prints it, at TP=2 for
# every combination of sequence parallelism, dropout, bf16 autocast and full recomputation
# (B8 x T512, width 128, 4 layers, 4 heads, 2 KV heads; 2 steps each). Writes under runs/.
set -euo pipefail
out=${1:-runs/planner-modes}
PYTHON=${PYTHON:-python3}
rm -rf "$out"
for sp in "" --sequence-parallel; do for drop in "" "--dropout 0.1"; do
for dtype in fp32 bf16; do for rec in "" --recompute; do
  name=$(echo "tp2 $sp $drop $dtype $rec" | tr -s ' -' '_' | tr -d '.')
  line=$(COLUMNS=400 $PYTHON -m tensorpar train --tp 2 --batch-size 8 --seq-len 512 --dim 128 --n-layer 4 \
    --n-head 4 --n-kv-head 2 --steps 2 --save-every 100 --dtype $dtype $sp $drop $rec \
    --out "$out/$name" 2>&1 | grep -o "rank 0 .*" | grep -o "peak tensor memory of a step [^│]*" | sed "s/ *$//" || true)
  printf '| %s | %s | %s | %s | %s |\n' "${sp:+SP}" "${drop:+dropout 0.1}" "$dtype" \
    "${rec:+recompute}" "$line"
done; done; done; done
