set -u; export PYTHONUNBUFFERED=1; R=$OUT/r; mkdir -p $R; REPO=$PWD
uptime > $R/uptime.txt; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> $R/uptime.txt
job() { local cores=$1 name=$2 dir=$3; shift 3; ( cd $dir && timeout 420 taskset -c $cores env PYTHONPATH=$dir "$@" > $R/$name.txt 2>&1; echo "exit $?" >> $R/$name.txt ) & }
P="python3 $REPO/benchmarks/lora_profile.py"
W1024="--dim 1024 --n-head 16 --n-kv-head 4 --hidden-dim 2048"
job 0,1 base-768 /tmp/base $P --rounds 30 --out $R/base-768.json
job 3,4 new-768 $REPO $P --rounds 30 --out $R/new-768.json
job 6,7 base-1024 /tmp/base $P $W1024 --rounds 16 --out $R/base-1024.json
B="python3 -m tensorpar bench --contenders hf-llama,hf-llama-lora --seq-len 128 --batch-size 8 --tp 2 --repeats 11"
job 9,10 bench-768 $REPO $B --dim 768 --n-head 12 --n-kv-head 4 --hidden-dim 2048 --out $R/bench-768
job 12,13 bench-1024 $REPO $B $W1024 --out $R/bench-1024
sleep 90; uptime >> $R/uptime.txt; wait; uptime >> $R/uptime.txt
rm -f $R/*/bench.png; tar czf $OUT/all2.tgz -C $OUT r; rm -rf $R
