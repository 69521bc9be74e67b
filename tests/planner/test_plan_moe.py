"""The planner on Mixture-of-Experts models: parameter counts against the published figures,
Hugging Face configs with experts, the per-rank weights under expert parallelism, the
all-to-all count against the MoE layer's own, and the layout search over ep. Pure arithmetic:
no ranks."""

import pytest

from tensorpar.planner.shapes import MOE_CONFIGS, preset, shape_from_hf_config


def test_mixtral_counts_equal_its_config_exactly():
    """Mixtral-8x7B from its config.json: 46,702,792,704 parameters, 12,879,925,248 active
    (the embedding table counted, as Mistral counts)."""
    s = preset("mixtral-8x7b")
    assert s.params() == 46_702_792_704
    assert s.params(active=True) == 12_879_925_248


@pytest.mark.parametrize("name, total, active, digits, embedding", [
    ("qwen3-30b-a3b", 30.53e9, 3.35e9, 2, True),  # Qwen: 30.5B / 3.3B (to 2 decimals here)
    ("gpt-oss-120b", 116.8e9, 5.13e9, (1, 2), False),  # OpenAI's card: 116.83B / 5.13B
    ("deepseek-v3", 671e9, 37e9, 0, False),  # DeepSeek: 671B / 37B (MTP module not counted)
])
def test_published_totals_and_active(name, total, active, digits, embedding):
    """Each preset's total and active parameters round to the published figures; GPT-OSS and
    DeepSeek count active parameters without the input embedding table."""
    s = preset(name)
    dt, da = digits if isinstance(digits, tuple) else (digits, digits)
    assert round(s.params() / 1e9, dt) == round(total / 1e9, dt)
    assert round(s.params(active=True, embedding=embedding) / 1e9, da) == round(active / 1e9, da)


def test_dense_counts_unchanged():
    """The dense presets count as before (Llama 2 7B: 6,738,415,616; GPT-2: 124,439,808), and
    their active count is their total."""
    assert preset("llama-2-7b").params() == 6_738_415_616
    assert preset("gpt2").params() == 124_439_808
    assert preset("llama-2-7b").params(active=True) == 6_738_415_616
    assert preset("llama-2-7b").moe is None and preset("llama-2-7b").expert_params() == 0


def test_hf_moe_configs_read():
    """Qwen2-MoE's keys: a shared expert with its gate, decoder_sparse_step and mlp_only_layers
    choose the dense layers; DeepSeek's first_k_dense_replace and latent attention."""
    d = {"model_type": "qwen2_moe", "vocab_size": 1000, "hidden_size": 64,
         "intermediate_size": 160, "moe_intermediate_size": 32,
         "shared_expert_intermediate_size": 96, "num_hidden_layers": 6,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 6,
         "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [5]}
    s = shape_from_hf_config(d, "tiny")
    m = s.moe
    assert (m.experts, m.top_k, m.hidden, m.shared_hidden, m.shared_gate) == (6, 2, 32, 96, True)
    assert [m.is_moe(i) for i in range(6)] == [False, True, False, True, False, False]
    assert s.qkv_bias  # Qwen2's default
    moe_layer = 6 * 64 + 6 * 3 * 64 * 32 + 3 * 64 * 96 + 64
    assert s.mlp_params(1) == moe_layer and s.mlp_params(0) == 3 * 64 * 160
    assert s.mlp_params(1, active=True) == moe_layer - 4 * 3 * 64 * 32
    ds = shape_from_hf_config(MOE_CONFIGS["deepseek-v3"], "ds")
    assert ds.moe.dense_first == 3 and ds.moe.moe_layers(61) == 58
    assert ds.moe.router == "sigmoid" and ds.moe.shared_hidden == 2048
    assert ds.mla.kv_lora == 512 and ds.head_dim == 192
    oss = preset("gpt-oss-120b")
    assert oss.moe.expert_bias and oss.moe.router_bias and oss.sinks and oss.o_bias
