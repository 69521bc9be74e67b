"""The planner against a measured LoRA step: a Hugging Face Llama converted by tensorpar, its base
frozen and adapters on its projections, built, stepped and measured as ``tensorpar train --hf
--lora-rank`` does (the run's recipe, loss and optimizer), at TP=1 and 2 on gloo ranks."""

import json

import pytest
import torch
import torch.distributed as dist

from tensorpar.parallel.ownership import ShardOwnership, clip_grad_norm_
from tensorpar.planner.memory import tensorpar_memory
from tensorpar.planner.meter import MemoryMeter
from tensorpar.planner.shapes import shape_from_hf_config
from tensorpar.planner.step import Lora, Step

# a small random Llama with grouped KV heads; B x T large enough that activations, not weights,
# make most of the peak (as in a real fine-tune), small enough for a few seconds
CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
          "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
          "tie_word_embeddings": False}
B, T = 4, 64
# (LoRA rank, --lora-targets, --dtype, --base-dtype)
CASES = [(8, None, "fp32", "fp32"), (16, "q_proj,v_proj", "fp32", "fp32"),
         (8, None, "bf16", "fp32"), (8, None, "bf16", "bf16")]


def _lora_peaks(path, tp, cases):
    """Each case's second step (AdamW's states exist), measured as the trainer measures it: the
    peak tensor memory less what this pool's rank held before."""
    from tensorpar.hf.plans import plan_for
    from tensorpar.train.config import TrainConfig
    from tensorpar.train.hf_recipe import HFRecipe, _meta_model
    from tensorpar.train.optim import make_optimizer

    group = dist.group.WORLD
    # the run's recipe (hf_recipe's: the model's plan, the head split by vocabulary), from a
    # folder of config.json alone (weights=False): the frozen base is drawn below
    recipe = HFRecipe(path, path, CONFIG, plan_for(_meta_model(path)) | {"lm_head": "column"},
                      weights=False)
    ids = torch.randint(0, CONFIG["vocab_size"], (B, T + 1),
                        generator=torch.Generator().manual_seed(0))
    out = []
    with MemoryMeter() as before:  # what this pool's rank holds from earlier tests: not ours
        pass
    for r, targets, dtype, base in cases:
        cfg = TrainConfig(tp=tp, batch_size=B, seq_len=T, lora_rank=r, lora_targets=targets,
                          dtype=dtype, base_dtype=base)
        model, _ = recipe.build(cfg, group, 0, torch.device("cpu"))
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad:
                    p.normal_(0, 0.05)
        forward, ownership = recipe.loss_fn(model, cfg, group), ShardOwnership.gather(model, group)
        opt = make_optimizer(model, cfg)
        for _ in range(2):
            with MemoryMeter() as mem:
                with torch.autocast("cpu", torch.bfloat16, enabled=dtype == "bf16"):
                    loss = forward(ids[:, :-1], ids[:, 1:])
                loss.backward()
                clip_grad_norm_(model, ownership, 1.0, group)
                opt.step()
                opt.zero_grad(set_to_none=True)
        out.append(mem.peak_bytes - before.entry_bytes)
        del model, forward, ownership, opt, loss
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_planned_lora_peak_near_the_measured(ranks, tmp_path, tp):
    """The planned peak of a LoRA step (frozen base: no weight gradients, adapters' AdamW states,
    the converted attention's tensors, the final norm's backward) is within 1.5% of the measured
    one on every rank in fp32 (4% when the all-reduce is slow), 6% under bf16 autocast; with
    every projection adapted and with q_proj and v_proj alone, the frozen base in fp32 and in
    bf16."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    shape = shape_from_hf_config(CONFIG, "llama")
    for rank, peaks in enumerate(ranks(tp).run(_lora_peaks, str(tmp_path), tp, CASES)):
        for (r, targets, dtype, base), got in zip(CASES, peaks, strict=True):
            plan = tensorpar_memory(Step(shape, tp, B, T, "bf16-autocast" if dtype == "bf16"
                                         else dtype, lora=Lora(r, targets, base)), rank)
            what = (f"TP={tp} rank {rank} r={r} targets={targets} {dtype} base {base} "
                    f"({plan.peak_at}): {got} vs {plan.total}")
            # measured (torch 2.13 CPU): within 0.13% in fp32 alone, 4.3-5.0% over under bf16 (the
            # planner of before was 8-26% over: it counted the GPT's attention, the kept inputs
            # of frozen layers and a trained model's backward); in a loaded full-suite run, TP=2
            # rank 1 at r=16 (q_proj, v_proj) measured 3.3% over the plan at the block backward:
            # the adapters' dB are made while the input gradient's all-reduce travels, so whether
            # its buffer is still held then depends on the collective's timing
            band = 0.04 if dtype == "fp32" else 0.06
            assert got == pytest.approx(plan.total, rel=band), (what, got, plan.total,
                                                                 plan.total / got - 1)
