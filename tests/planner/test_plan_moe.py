"""The planner on Mixture-of-Experts models: parameter counts against the published figures,
Hugging Face configs with experts, the per-rank weights under expert parallelism, the
all-to-all count against the MoE layer's own, and the layout search over ep. Pure arithmetic:
no ranks."""

import argparse
import dataclasses
import re

import pytest

from tensorpar.cli import plan as plan_cli
from tensorpar.parallel.sharding import check_expert_parallel
from tensorpar.planner.activations import block_terms
from tensorpar.planner.comm import predicted_comm
from tensorpar.planner.memory import rank_params
from tensorpar.planner.moe_comm import expected_calls, moe_comm
from tensorpar.planner.report import params_text
from tensorpar.planner.search import expert_sizes
from tensorpar.planner.shapes import MOE_CONFIGS, moe_tensors, preset, shape_from_hf_config
from tensorpar.planner.step import Step
from tensorpar.planner.tp_plan import plan_memory
from tensorpar.transformer.moe import moe_collective_counts


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


def _build(*argv) -> dict:
    ap = argparse.ArgumentParser()
    plan_cli.add_parser(ap.add_subparsers())
    return plan_cli.build(ap.parse_args(["plan", *argv]))


def test_weights_per_rank_at_tp2_ep8_dp8_ddp():
    """Mixtral at (tp 2, ep 8, dp 8 DDP, bf16): a rank holds its TP half of the non-expert
    weights plus the norms and the router whole (replicated over TP), and 1/8 of the routed
    experts, 2 bytes each: (non-expert / 2 + (norms + router) / 2 + expert / 8) x 2."""
    s = preset("mixtral-8x7b")
    expert = s.expert_params()
    non_expert = s.params() - expert
    replicated = (2 * s.n_layer + 1) * s.dim + s.n_layer * s.moe.experts * s.dim
    row = plan_memory(Step(s, tp=2, ep=8, dp=8, dp_mode="ddp", batch=8, seq=4096,
                           dtype="bf16"))
    assert expert % 8 == 0 and (non_expert - replicated) % 2 == 0
    assert row["weights"] == ((non_expert - replicated) // 2 + replicated + expert // 8) * 2
    assert row["weights"] == 12_881_240_064 and row["ep"] == 8
    # the gradients and AdamW states follow the weights (Megatron-style bf16: 2 + 12 B)
    p = rank_params(s, 2, 0, 8)
    assert row["grads"] == 2 * p["total"]
    assert row["optimizer"] == 12 * p["total"] + 4 * p["tensors"]


def test_experts_split_as_tensor_split():
    """6 experts over 4 EP ranks: 2, 2, 1, 1, as torch.tensor_split cuts them; the routed
    experts' elements summed over the EP ranks are the model's, each held once."""
    d = dict(MOE_CONFIGS["mixtral-8x7b"], num_local_experts=6, num_hidden_layers=2,
             hidden_size=64, intermediate_size=32, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=100)
    s = shape_from_hf_config(d, "six")
    one = s.moe.expert_params(s.dim) * s.moe.moe_layers(s.n_layer)
    shares = [rank_params(s, 1, 0, 4, r)["experts"] for r in range(4)]
    assert shares == [2 * one, 2 * one, one, one] and sum(shares) == s.expert_params()
    assert [d0 for name, d0, _ in moe_tensors(s, 1, 0, 4, 3) if name.endswith("down_proj")] == [1]


def test_routed_activations_scale_with_top_k():
    """The routed part keeps tokens x top-k rows: doubling k adds exactly the rows' terms
    (SwiGLU's four (n·k, H_e) tensors and three (n·k, D) row tensors) and nothing else."""
    s = preset("mixtral-8x7b")
    k4 = dataclasses.replace(s, moe=dataclasses.replace(s.moe, top_k=4))
    step = Step(s, tp=2, ep=8, dp=8, batch=8, seq=1024, dtype="fp32")
    a, b = block_terms(step), block_terms(step.replace(shape=k4))
    n = 1024 // 2  # the TP rank's share of the tokens
    assert b["mlp"] - a["mlp"] == 4 * (n * 2) * s.moe.hidden * 4
    assert b["expert rows"] - a["expert rows"] == 3 * (n * 2) * s.dim * 4
    assert b["total"] - a["total"] == (b["mlp"] - a["mlp"]) + (b["expert rows"] - a["expert rows"])


@pytest.mark.parametrize("tp, ep, dp, sp, recompute, m", [
    (2, 8, 8, False, "none", 1), (1, 4, 4, False, "full", 2), (4, 2, 1, True, "none", 3),
    (2, 1, 1, False, "none", 1)])
def test_all_to_all_calls_match_the_layer(tp, ep, dp, sp, recompute, m):
    """The all-to-alls and the statistics' all-reduce of a step equal ParallelMoE's own count
    (moe_collective_counts) times the MoE layers and passes; the rows' bytes are each token's
    k rows of width D, (ep-1)/ep of them leaving the rank, forward out and back, backward
    twice."""
    s = preset("mixtral-8x7b")
    step = Step(s, tp=tp, ep=ep, dp=dp, batch=dp * m, seq=256, micro_batches=m,
                sequence_parallel=sp, recompute=recompute, dtype="fp32")
    c = moe_comm(step)
    assert c["counts"] == expected_calls(step)
    layer = moe_collective_counts(1, ep, dp * tp, False)
    fwd = 2 if recompute == "full" else 1
    assert c["counts"].get("all_to_all", 0) == s.n_layer * m * (
        fwd * layer["forward"].get("all_to_all", 0) + layer["backward"].get("all_to_all", 0))
    if ep > 1:
        rows = 256 // tp * s.moe.top_k * s.dim * 4  # fp32 rows of one pass
        row_calls = s.n_layer * m * (2 * fwd + 2)
        assert c["bytes"]["all_to_all"] == row_calls * rows + s.n_layer * m * fwd * 8 * 8
        assert c["sent"]["all_to_all"] == round(c["bytes"]["all_to_all"] * (ep - 1) / ep)


def test_moe_tp_collectives_match_the_layer():
    """The MoE layer's own TP collectives in predicted_comm (no shared experts, no SP): per
    layer what moe_collective_counts gives at TP 2 beyond the EP ones, the dense MLP's gone."""
    s = preset("mixtral-8x7b")
    c = predicted_comm(s, 1, 64, 2)
    rows = {r["source"]: r["calls"] for r in c["breakdown"]}
    assert not any(k.startswith("mlp") for k in rows)
    layer = moe_collective_counts(2, 1, 1, False)
    assert rows["MoE outputs gathered (x32)"] == 32 * layer["forward"]["all_gather"]
    assert rows["MoE input grads gathered (x32)"] + rows["router grads (x32)"] == \
        32 * sum(layer["backward"].values())


@pytest.mark.parametrize("ep, tp, dp, experts, message", [
    (3, 2, 1, 8, "--ep 3 does not divide the 2 ranks of a stage (--dp 1 x --tp 2)"),
    (16, 2, 8, 8, "--ep 16 is more than the 8 routed experts"),
    (2, 2, 1, 0, "--ep 2: the model has no experts"),
    (2, 4, 2, 8, "--ep 2 with --tp 4: an EP group holds whole TP groups"),
    (0, 1, 1, 8, "--ep 0 must be >= 1")])
def test_folding_rule(ep, tp, dp, experts, message):
    """EP ranks fold into the dp x tp ranks: one rule, one line naming the numbers."""
    with pytest.raises(ValueError, match=re.escape(message)):
        check_expert_parallel(ep, tp, dp, experts)


def test_plan_prints_total_active_and_ep():
    """plan on Mixtral shows its total and active parameters and the EP traffic; the same flags
    refuse an EP size that does not fold; a dense model's output has no MoE keys."""
    data = _build("--model", "mixtral-8x7b", "--tp", "2", "--ep", "8", "--dp", "8",
                  "--dp-mode", "ddp", "--batch", "8", "--seq", "4096")
    assert data["params"] == 46_702_792_704 and data["params_active"] == 12_879_925_248
    assert data["ep_comm"]["2"]["counts"]["all_to_all"] == 32 * 5
    assert params_text(data) == "46.70B params, 12.88B active, EP=8"
    with pytest.raises(ValueError, match="--ep 3 does not divide"):
        _build("--model", "mixtral-8x7b", "--tp", "2", "--ep", "3")
    # EP folds over the CP ranks too, as the trainer folds it (train --hf --cp 2 --ep 2)
    folded = _build("--model", "mixtral-8x7b", "--tp", "1", "--cp", "2", "--ep", "2",
                    "--seq", "4096")
    assert folded["rows"][0]["ep"] == 2
    assert expert_sizes(preset("mixtral-8x7b"), tp=1, dp=1, cp=2) == [1, 2]
    dense = _build("--model", "llama-2-7b", "--tp", "2")
    assert "params_active" not in dense and "ep" not in dense["rows"][0]


def test_search_lists_layouts_with_ep():
    """plan --model mixtral-8x7b --devices 16 --device-memory 80GB lists layouts with ep > 1
    (and every layout's EP folds into its dp x tp, whole TP groups in an EP group, as the trainer
    requires)."""
    data = _build("--model", "mixtral-8x7b", "--devices", "16", "--device-memory", "80GB")
    assert data["layouts"] and any(r["ep"] > 1 for r in data["layouts"])
    assert all((r["dp"] * r["cp"] * r["tp"]) % r["ep"] == 0 for r in data["layouts"])
    assert all(r["ep"] == 1 or r["ep"] % r["tp"] == 0 for r in data["layouts"]), \
        [(r["tp"], r["ep"]) for r in data["layouts"]]
    assert expert_sizes(preset("mixtral-8x7b"), tp=4, dp=2) == [1, 4, 8]
    assert "(EP=" in data["verdict"]
