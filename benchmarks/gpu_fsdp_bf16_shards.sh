#!/usr/bin/env bash
# On a lent GPU machine, from the repository root: (1) the peak memory of `train --dtype bf16`
# under FSDP2 before (autocast over fp32 gathered weights) and after (MixedPrecisionPolicy), every
# rank on the one GPU over gloo (--device cuda); (2) `prepare` and `train --data DIR` on the GPU:
# the share of step time spent waiting for data. $1: a tokenizer folder; $2: the old
# mesh/data_parallel.py (was dp/wrap.py).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__)"
model="--dim 1024 --n-layer 8 --n-head 16 --n-kv-head 4 --seq-len 512 --batch-size 8 --steps 4"
rm -rf /tmp/before && mkdir /tmp/before && cp -r tensorpar /tmp/before/ && cp "$2" /tmp/before/tensorpar/mesh/data_parallel.py
for split in "--tp 1 --dp 2" "--tp 2 --dp 2"; do
  for which in before after; do
    root=$PWD; [ $which = before ] && root=/tmp/before
    echo "== $which: bf16 FSDP2 $split"
    (cd "$root" && PYTHONPATH=$root timeout 150 python3 -m tensorpar --device cuda train --dtype bf16 $split $model \
        --out /tmp/run-$which-${split// /} 2>&1) > "$out/fsdp-$which-${split// /}.log"
    grep -E "rank 0|peak|tensor memory|loss \(first" "$out/fsdp-$which-${split// /}.log" | head -8
  done
done
echo "== shards on the GPU"
python3 - <<'PY'
from tensorpar.data.text import default_corpus
import os
os.makedirs("/tmp/corpus", exist_ok=True)
t = default_corpus()
for i in range(8):
    open(f"/tmp/corpus/part{i}.txt", "w").write(t[i * 50_000:] + t[:i * 50_000])
PY
python3 -m tensorpar prepare "/tmp/corpus/*.txt" --tokenizer "$1" --out /tmp/shards 2>&1 | tail -1
timeout 200 python3 -m tensorpar --device cuda train --tp 2 --data /tmp/shards --steps 60 --seq-len 256 \
    --batch-size 16 --out /tmp/run-shards > "$out/shards-train.log" 2>&1; echo "train exit $?"
cp /tmp/run-shards/metrics.jsonl "$out/shards-metrics.jsonl"
grep -E "data wait|tokens/s|resident" "$out/shards-train.log" | head -6
