set -u; export PYTHONUNBUFFERED=1; R=$OUT/r; mkdir -p $R
nproc; uptime; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; lscpu | grep -i "model name"
job() { local cores=$1 name=$2; shift 2; ( timeout 500 taskset -c $cores "$@" > $R/$name.txt 2>&1; echo "exit $?" >> $R/$name.txt ) & }
P="python3 benchmarks/lora_profile.py"
W1024="--dim 1024 --n-head 16 --n-kv-head 4 --hidden-dim 2048"
job 0,1 base-768 env PYTHONPATH=/tmp/base $P --rounds 20 --out $R/base-768.json
job 2,3 new-768 env PYTHONPATH=$PWD $P --rounds 20 --out $R/new-768.json
job 4,5 base-1024 env PYTHONPATH=/tmp/base $P $W1024 --rounds 14 --out $R/base-1024.json
job 6,7 new-1024 env PYTHONPATH=$PWD $P $W1024 --rounds 14 --out $R/new-1024.json
B="python3 -m tensorpar bench --contenders hf-llama,hf-llama-lora --seq-len 128 --batch-size 8 --tp 2 --repeats 9"
job 8,9 bench-768 env PYTHONPATH=$PWD $B --dim 768 --n-head 12 --n-kv-head 4 --hidden-dim 2048 --out $R/bench-768
job 10,11 bench-1024 env PYTHONPATH=$PWD $B $W1024 --out $R/bench-1024
job 12,13 base-bench-768 env PYTHONPATH=/tmp/base $B --dim 768 --n-head 12 --n-kv-head 4 --hidden-dim 2048 --out $R/base-bench-768
sleep 60; uptime > $R/uptime.txt; wait; uptime >> $R/uptime.txt
rm -f $R/*/bench.png; tar czf $OUT/all.tgz -C $OUT r
for f in $R/*.txt; do echo "== $f"; grep -v "USDT\|^round" $f | tail -32; done
