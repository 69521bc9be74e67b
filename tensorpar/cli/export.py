"""``tensorpar export``: a checkpoint as one dense safetensors file
(``tensorpar/checkpoint/export.py``) or as a
Hugging Face model folder (``tensorpar/hf/export.py``)::

    tensorpar export --ckpt runs/gpt --out gpt.safetensors
    tensorpar export --ckpt runs/gpt --hf-out gpt-hf [--max-shard-size 5GB]
"""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint's weights as one dense safetensors "
                       "(--out) or as a Hugging Face model folder (--hf-out)")
    p.add_argument("--ckpt", required=True, help="a run directory (its newest checkpoint) or a "
                   "step-* checkpoint directory (required)")
    p.add_argument("--out", help="the file to write: a name ending in .safetensors, in an "
                   "existing writable directory; an existing file is replaced atomically "
                   "(required: this or --hf-out)")
    p.add_argument("--hf-out", metavar="DIR", help="instead: a new or empty folder to write as "
                   "a Hugging Face model that transformers' AutoModelForCausalLM and "
                   "AutoTokenizer load (the GPT as a LlamaForCausalLM, with its byte tokenizer; "
                   "with MoE blocks a MixtralForCausalLM, with shared experts a "
                   "Qwen2MoeForCausalLM; a run of train --hf as its source model); "
                   "written next to it and renamed into place (required: this or --out)")
    p.add_argument("--peft-out", metavar="DIR", help="instead, for a LoRA run (train --hf PATH "
                   "--lora-rank R): a new or empty folder to write its adapters as PEFT's "
                   "(adapter_config.json, adapter_model.safetensors), which "
                   "peft.PeftModel.from_pretrained(base, DIR) loads; --hf-out writes the merged "
                   "model (required: this, --out or --hf-out)")
    p.add_argument("--max-shard-size", metavar="SIZE", help="with --hf-out: the largest "
                   "safetensors file, with its unit (5GB, 500MB, 2GiB); above it the weights are "
                   "split into files named in model.safetensors.index.json (default 5GB)")
    p.set_defaults(func=run)


def run(args) -> int:
    if sum(x is not None for x in (args.out, args.hf_out, args.peft_out)) != 1:
        raise ValueError("give one of --out FILE.safetensors (one dense file), --hf-out DIR (a "
                         "Hugging Face model folder) and --peft-out DIR (a LoRA run's adapters)")
    if args.peft_out is not None:
        from tensorpar.hf.export import export_peft

        if args.max_shard_size is not None:
            raise ValueError("--max-shard-size goes with --hf-out")
        path = export_peft(args.ckpt, args.peft_out)
    elif args.hf_out is not None:
        from tensorpar.hf.export import DEFAULT_SHARD_SIZE, export_hf

        note = lambda line: print(f"tensorpar export: note: {line}", file=sys.stderr)  # noqa: E731
        path = export_hf(args.ckpt, args.hf_out, args.max_shard_size or DEFAULT_SHARD_SIZE,
                         note)
    elif args.max_shard_size is not None:
        raise ValueError("--max-shard-size goes with --hf-out (--out writes one file)")
    else:
        from tensorpar.checkpoint.export import export_dense

        path = export_dense(args.ckpt, args.out)
    print(f"wrote {path}")
    return 0
