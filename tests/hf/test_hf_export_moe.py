"""``export --hf-out`` of a GPT with MoE blocks, in this process: with shared experts it is a
Qwen2MoeForCausalLM (its shared-expert gate written as zeros, the shared down projection
doubled: exactly the GPT's sum) whose logits and greedy tokens equal the GPT's; a router no
transformers class holds is one line. (A trained run's export as a Mixtral, against ``tensorpar
generate``: tests/train/test_moe_resume.py.)"""

import dataclasses

import pytest
import torch
import transformers

from tensorpar.checkpoint.save import save_checkpoint
from tensorpar.gpt.generate import generate
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.hf.export import export_hf
from tensorpar.parallel.ownership import ShardOwnership

MOE = {"vocab_size": 256, "n_layer": 2, "dim": 16, "n_head": 4, "n_kv_head": 2,
       "hidden_dim": 16, "moe_experts": 6, "moe_top_k": 2}


def _saved(tmp_path, **change):
    cfg = GPTConfig(**(MOE | change))
    model = GPT(cfg, seed=4).eval()
    save_checkpoint(tmp_path / "run", 1, model, ShardOwnership.gather(model),
                    meta={"config": dataclasses.asdict(cfg), "tokenizer": "bytes"})
    return model, tmp_path / "run"


def test_shared_experts_export_as_qwen2_moe(tmp_path):
    """Shared experts: a Qwen2MoeForCausalLM with no missing or unexpected key; its logits equal
    the GPT's to fp32 rounding and its greedy tokens are the GPT's."""
    gpt, run = _saved(tmp_path, moe_shared_experts=2)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        export_hf(run, tmp_path / "hf"), output_loading_info=True)
    assert type(model).__name__ == "Qwen2MoeForCausalLM" and all(not v for v in info.values())
    assert model.config.shared_expert_intermediate_size == 2 * MOE["hidden_dim"]
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine, theirs = gpt(ids), model.eval()(ids).logits
        greedy = model.generate(ids[:1, :8], do_sample=False, max_new_tokens=12,
                                attention_mask=torch.ones(1, 8, dtype=torch.long))
    # measured 1.1e-7 of the largest logit
    assert (mine - theirs).abs().max() <= 2e-6 * mine.abs().max()
    assert generate(gpt, ids[:1, :8], 12)[0].tolist() == greedy[0].tolist()


def test_sigmoid_router_refused_in_one_line(tmp_path):
    """DeepSeek-V3's sigmoid router has no class the export writes: one line naming the flag
    and what writes the weights instead; no folder."""
    _, run = _saved(tmp_path, moe_router="sigmoid")
    with pytest.raises(ValueError, match=r"--moe-router sigmoid has no transformers class "
                                         r"export --hf-out writes .*--out writes the dense") as e:
        export_hf(run, tmp_path / "hf")
    assert "\n" not in str(e.value) and not (tmp_path / "hf").exists()
