#!/usr/bin/env bash
# On a lent GPU machine, from the repository root: LoRA fine-tuning of a tiny random Llama with
# every rank on the GPU over gloo (--device cuda), TP=1 and TP=2 (their losses must agree),
# then generate from the run and export its PEFT folder; and one step of chat data, packed.
set -eu
export PYTHONPATH=$PWD:$PWD/tests PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu-lora}; mkdir -p "$out"
python3 - <<'PY'
import json, torch, transformers
from tests_common import bpe_tokenizer
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
transformers.LlamaForCausalLM(cfg).save_pretrained("/tmp/gl")
bpe_tokenizer("/tmp/gl")
with open("/tmp/sft.jsonl", "w") as f:
    for i in range(40):
        f.write(json.dumps({"prompt": f"question {i}:", "completion": f" answer {i % 7}"}) + "\n")
PY
for tp in 1 2; do
  python3 -m tensorpar --device cuda train --hf /tmp/gl --tp $tp --lora-rank 4 --steps 4 --seq-len 64 \
      --batch-size 4 --out /tmp/lora-tp$tp > "$out/lora-tp$tp.log" 2>&1
  python3 -c "import json; print('tp $tp', [round(json.loads(l)['loss'], 6) for l in open('/tmp/lora-tp$tp/metrics.jsonl')])"
done
python3 -m tensorpar --device cuda generate --ckpt /tmp/lora-tp2 --tp 2 --prompt "The with" --max-new-tokens 8
python3 -m tensorpar export --ckpt /tmp/lora-tp2 --peft-out /tmp/peft && ls /tmp/peft
python3 -m tensorpar --device cuda train --hf /tmp/gl --tp 2 --data /tmp/sft.jsonl --pack --steps 2 --seq-len 64 \
    --batch-size 2 --out /tmp/sft > "$out/sft.log" 2>&1 && grep -E "data |loss \(first" "$out/sft.log"
