#!/usr/bin/env bash
# The GPU checks of issue 15 in one call, for a lent machine with one GPU of 140 GB (an H200:
# the interleaved bench keeps four 837M-parameter contenders with their AdamW states, about
# 110 GB). Run from the repository root; results go to $OUT (at most 8 files come back):
#   1. benchmarks/gpu_tp1_profile.py: tensorpar at TP=1 against the plain model, eager, per op
#   2. tensorpar bench --device cuda at the 837M shape: TP=1 eager and compiled, interleaved
#   3. tests/test_cuda.py's bench test (tensorpar bench --device cuda on a tiny model)
# Each step gets what is left of a deadline (first argument, seconds; default 580); the second
# argument picks the steps (default "profile bench pytest"), PYTEST_K the GPU tests.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu-session}
mkdir -p "$out/bench"
end=$(( $(date +%s) + ${1:-580} ))
parts=${2:-profile bench pytest}
left() { local s=$(( end - $(date +%s) - ${1:-0} )); echo $(( s > 10 ? s : 10 )); }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

if [[ $parts == *profile* ]]; then
  echo "== 1. per-op profile, eager, TP=1 (837M)"
  timeout "$(left 420)" python3 benchmarks/gpu_tp1_profile.py --out /tmp/prof 2>&1 | grep -v "USDT\|UserWarning\|self.profiler"
  cp /tmp/prof/profile_diff.md /tmp/prof/profile_tensorpar.txt /tmp/prof/profile_dense.txt "$out/"
fi

if [[ $parts == *bench* ]]; then
echo "== 2. tensorpar bench --device cuda, 837M, interleaved"
timeout "$(left 75)" python3 -m tensorpar bench --device cuda --dim 2048 --n-layer 16 --n-head 16 \
    --n-kv-head 4 --vocab-size 32000 --seq-len 2048 --batch-size 8 \
    --contenders tensorpar-tp1,dense-1t,tensorpar-tp1-c,dense-c --repeats ${REPEATS:-10} \
    --steps-per-repeat 2 --out "$out/bench" >"$out/bench.log" 2>&1
echo "bench exit $?"
grep -v "^round" "$out/bench.log" | tail -n 25
rm -f "$out/bench/bench.png"
fi

if [[ $parts == *pytest* ]]; then
  echo "== 3. pytest tests/test_cuda.py -k ${PYTEST_K:=bench_on_one_gpu}"
  timeout "$(left)" python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k "$PYTEST_K" \
      >"$out/pytest.log" 2>&1
  echo "pytest exit $?"
  tail -n 5 "$out/pytest.log"
fi
