#!/usr/bin/env bash
# On a lent GPU machine, from the repository root: pipeline stages with every rank on the GPU
# over gloo (--device cuda) are refused in one line (gloo's point-to-point ops take CPU tensors
# only: torch 2.11 aborted with "writev ... Bad address"); LoRA at TP=2 with the frozen base in
# bf16 against it in fp32 (equal losses, less memory).
set -eu
export PYTHONPATH=$PWD:$PWD/tests PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu-pipeline}; mkdir -p "$out"
rm -rf /tmp/ref-fp32 /tmp/ref-bf16 /tmp/pp2-fp32 /tmp/pp2-bf16 /tmp/pp2v2-fp32 /tmp/pp2v2-bf16 /tmp/lora-fp32 /tmp/lora-bf16
python3 -c "from tensorpar.data.text import default_corpus; open('/tmp/text.txt','w').write(default_corpus())"
gpt="--data /tmp/text.txt --dim 512 --n-layer 8 --n-head 8 --n-kv-head 4 --vocab-size 256 --seq-len 256 \
     --batch-size 16 --micro-batch-size 2 --steps 6 --warmup-steps 2 --no-tie-embeddings --save-every 3"
show() { python3 -c "import json; print('$1', [(round(r['loss'], 6), round(r['grad_norm'], 6)) for r in map(json.loads, open('$2/metrics.jsonl'))])"; }
# pipeline stages need NCCL on GPUs (gloo's send and receive take CPU tensors): one line
python3 -m tensorpar --device cuda train $gpt --tp 1 --pp 2 --out /tmp/pp2-fp32 2>&1 | tail -1 || true
python3 - <<'PY'
import torch, transformers
from tests_common import bpe_tokenizer
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2752, num_hidden_layers=4,
                               num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512)
transformers.LlamaForCausalLM(cfg).save_pretrained("/tmp/gl")
bpe_tokenizer("/tmp/gl")
PY
for base in fp32 bf16; do
  python3 -m tensorpar --device cuda train --hf /tmp/gl --data /tmp/text.txt --tp 2 --lora-rank 8 --dtype bf16 --base-dtype $base \
      --steps 4 --seq-len 512 --batch-size 8 --out /tmp/lora-$base > "$out/lora-$base.log" 2>&1
  show "LoRA bf16, base $base" /tmp/lora-$base
  grep -E "^│ rank 0" -A3 "$out/lora-$base.log" | head -4
done
