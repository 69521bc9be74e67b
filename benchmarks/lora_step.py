"""A LoRA step against a full fine-tuning step of the same converted Llama, at TP=2 on gloo.

    python benchmarks/lora_step.py --dim 1024 --layers 4 --repeats 2

Builds a random Llama (width ``--dim``, MLP 2.6875 x width, heads of 64, half as many KV heads,
vocabulary 512), saves it in a temporary folder, and times forward plus backward of a batch of
8 x 256 tokens with the model's ``labels=`` loss (``tp.from_pretrained``), every weight trained
or LoRA adapters of rank 8 on every block projection (``tensorpar.hf.lora.add_lora``), the
median of 5 steps after none, alternating the two ``--repeats`` times. Prints one line a run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import tensorpar as tp


def _step_times(path: str, lora: bool, steps: int = 5) -> float:
    from tensorpar.hf.lora import add_lora

    group = tp.init_tensor_parallel()
    model = tp.from_pretrained(path, group=group).train()
    if lora:
        add_lora(model, 8, 8.0)
    ids = torch.randint(0, 512, (8, 257), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(ids[:, :-1], labels=ids[:, :-1]).loss.backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    import transformers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        heads = args.dim // 64
        config = transformers.LlamaConfig(
            vocab_size=512, hidden_size=args.dim, intermediate_size=args.dim * 43 // 16,
            num_hidden_layers=args.layers, num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2), max_position_embeddings=512)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
        for _ in range(args.repeats):
            for lora in (False, True):
                seconds = tp.launch(_step_times, 2, folder, lora)[0]
                print(f"dim {args.dim}, {args.layers} layers, TP=2: "
                      f"{'LoRA r=8' if lora else 'full fine-tuning'} {seconds:.3f} s a step",
                      flush=True)


if __name__ == "__main__":
    main()
