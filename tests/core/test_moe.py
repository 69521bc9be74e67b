"""The MoE layer against a plain per-token reference, at any (TP, EP) layout: output, input
gradient, every gradient shard, the auxiliary losses, the collectives counted.

Layouts on n ranks, rank = d * tp + t: TP groups are consecutive ranks (they hold the same
tokens), the data ranks d hold different tokens. ``ep="data"``: the experts are split across
the data ranks (TP peers hold the same experts); ``ep="world"``: across all the ranks (a TP
group's ranks hold different experts). The reference runs every data rank's tokens in one
process; a replicated parameter's gradient summed over the data ranks equals its gradient.
"""

import pytest
import torch
import torch.distributed as dist

from tensorpar.cli.compare import dense_shard, max_rel_error
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.runtime.groups import tp_rank, tp_size
from tensorpar.transformer.moe import MoEConfig, ParallelMoE, moe_collective_counts
from tensorpar.transformer.reference import DenseMoE

B, T, D, H = 2, 5, 16, 12  # per data rank; D and H keep _grouped_mm's rows 16-byte aligned
BALANCE_COEF, Z_COEF = 0.1, 0.01
# the largest relative error of the output, the aux losses and every gradient: ~10x the largest
# measured over every layout and router here (torch 2.13 CPU)
TOL = 5e-6  # measured 5.7e-7 (the router weight's gradient, EP 2)
ROUTERS = {  # Mixtral (renormalised, shared experts), Qwen3-MoE without renormalising,
    # DeepSeek-V3 (sigmoid, a selection bias, scaled weights); 6 experts: 2, 2, 1, 1 over 4 ranks
    "softmax-norm": {"num_experts": 6, "top_k": 2, "shared_hidden_dim": 8},
    "softmax": {"num_experts": 6, "top_k": 2, "norm_topk_prob": False},
    "sigmoid": {"num_experts": 6, "top_k": 3, "router": "sigmoid", "route_scale": 2.5,
                "shared_hidden_dim": 8},
}
LAYOUTS = {  # name: (ranks, tp, ep)
    "ep1": (1, 1, "data"), "ep2": (2, 1, "data"), "ep4": (4, 1, "data"),
    "tp2-ep2": (4, 2, "data"), "tp2-is-ep2": (2, 2, "world"), "tp2-ep4": (4, 2, "world"),
}
_GROUPS: dict = {}


def _groups(tp: int):
    """(tp_group, data_group) of this rank; collective on first use, cached per process (every
    rank asks for the same layouts in the same order)."""
    n = dist.get_world_size()
    if (n, tp) not in _GROUPS:
        tp_group = dist.new_subgroups_by_enumeration(
            [list(range(d * tp, d * tp + tp)) for d in range(n // tp)])[0]
        data_group = dist.new_subgroups_by_enumeration(
            [list(range(t, n, tp)) for t in range(tp)])[0]
        _GROUPS[n, tp] = tp_group, data_group
    return _GROUPS[n, tp]


def _dense(config: MoEConfig) -> DenseMoE:
    torch.manual_seed(0)  # the same weights, tokens and output gradient on every rank
    dense = DenseMoE(config)
    if config.router == "sigmoid":
        dense.router.selection_bias.copy_(torch.randn(config.num_experts))
    return dense


def _layer(dense: DenseMoE, tp_group, ep_group, stats_group, sp=False) -> ParallelMoE:
    s = dense.shared
    moe = ParallelMoE.from_dense(dense.config, dense.router.weight, dense.experts.gate_up_proj,
                                 dense.experts.down_proj,
                                 None if s is None else (s.gate, s.up, s.down),
                                 tp_group=tp_group, ep_group=ep_group, stats_group=stats_group,
                                 sequence_parallel=sp)
    if dense.config.router == "sigmoid":
        moe.router.selection_bias.copy_(dense.router.selection_bias)
    return moe


def _check(name, actual, expected, errors):
    errors[name] = err = max_rel_error(actual, expected)
    assert err <= TOL, f"{name}: relative error {err:.2e} > {TOL:.0e} (rank {tp_rank()})"


def _body(router: str, tp: int, ep: str, sp: bool = False):
    config = MoEConfig(dim=D, hidden_dim=H, **ROUTERS[router])
    tp_group, data_group = _groups(tp)
    ep_group = data_group if ep == "data" else None
    dense = _dense(config)
    n_data, d = tp_size(data_group), tp_rank(data_group)
    x_all = torch.randn(B * n_data, T, D)
    g_all = torch.randn(B * n_data, T, D)
    x_ref = x_all.clone().requires_grad_(True)
    y_ref, (balance, z, load) = dense(x_ref)
    ((y_ref * g_all).sum() + BALANCE_COEF * balance + Z_COEF * z).backward()

    moe = _layer(dense, tp_group, ep_group, None, sp)

    def mine(t):  # this rank's tokens: its data rank's, under SP its TP rank's shard of them
        t = t[d * B:(d + 1) * B]
        return torch.tensor_split(t, tp, 1)[tp_rank(tp_group)] if sp else t

    x = mine(x_all).clone().requires_grad_(True)
    with CollectiveCounter() as fwd:
        y, aux = moe(x, seq_len=T if sp else None)
    with CollectiveCounter() as bwd:
        ((y * mine(g_all)).sum() + aux.loss(BALANCE_COEF, Z_COEF)).backward()
    errors: dict[str, float] = {}
    _check("output", y, mine(y_ref), errors)
    _check("input grad", x.grad, mine(x_ref.grad), errors)
    _check("balance loss", aux.balance_loss, balance, errors)
    _check("z-loss", aux.z_loss, z, errors)
    assert torch.equal(aux.expert_load, load), (aux.expert_load, load)
    dense_params = dict(dense.named_parameters())
    for pname, p in moe.named_parameters():
        grad = p.grad
        spec = getattr(p, "ep_shard", None) or p.tp_shard
        if not hasattr(p, "ep_shard"):  # replicated over the data ranks: their sum is the grad
            grad = grad.clone()
            dist.all_reduce(grad, group=data_group)
        _check(f"grad {pname}", grad, dense_shard(dense_params[pname].grad, spec), errors)
    return {"forward": dict(fwd.counts), "backward": dict(bwd.counts), "errors": errors,
            "load": aux.expert_load.tolist()}


def _run(ranks, router, layout, sp=False):
    n, tp, ep = LAYOUTS[layout]
    results = ranks(n).run(_body, router, tp, ep, sp)
    ep_size = n if ep == "world" else n // tp
    shared = bool(ROUTERS[router].get("shared_hidden_dim"))
    want = moe_collective_counts(tp, ep_size, n, shared, sp)
    for rank, got in enumerate(results):
        assert got["forward"] == want["forward"], (rank, got["forward"], want)
        assert got["backward"] == want["backward"], (rank, got["backward"], want)
    return results


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_equal_one_process(ranks, layout):
    """Mixtral's routing with shared experts at EP 1, 2, 4 (6 experts over 4 ranks: 2, 2, 1, 1),
    TP 2 x EP 2 on 4 ranks (TP peers hold the same experts), TP 2 with the experts split over
    the TP group itself, and TP 2 x EP 4: output, input gradient, every weight's gradient, the
    balancing and z-losses equal one process running all the tokens; the collectives are the
    analytic count."""
    _run(ranks, "softmax-norm", layout)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("layout", ["ep4", "tp2-ep2"])
def test_routers_equal_one_process(ranks, router, layout):
    """Top-k without renormalising (Qwen3-MoE's default), and the sigmoid router whose selection
    bias moves the choice but not the weights (DeepSeek-V3), at EP 4 and TP 2 x EP 2."""
    _run(ranks, router, layout)


@pytest.mark.parametrize("layout", ["tp2-is-ep2", "tp2-ep2"])
def test_sequence_parallel(ranks, layout):
    """Under sequence parallelism each TP rank routes its own sequence shard (T = 5 over 2:
    3 and 2 tokens): no token split or gather; the same numbers."""
    _run(ranks, "softmax-norm", layout, sp=True)


def _hf_block(family: str, config: MoEConfig):
    """transformers' own sparse MoE block of ``family`` with ``config``'s sizes."""
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        return MixtralSparseMoeBlock(MixtralConfig(
            hidden_size=D, intermediate_size=H, num_local_experts=config.num_experts,
            num_experts_per_tok=config.top_k))
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(
        hidden_size=D, moe_intermediate_size=H, num_experts=config.num_experts,
        num_experts_per_tok=config.top_k, norm_topk_prob=config.norm_topk_prob))


@pytest.mark.parametrize("family,norm", [("mixtral", True), ("qwen3_moe", False),
                                         ("qwen3_moe", True)])
def test_transformers_blocks_agree(family, norm):
    """transformers' MixtralSparseMoeBlock and Qwen3MoeSparseMoeBlock, given the reference's
    weights, give its output and gradients; their ``load_balancing_loss_func`` gives the
    layer's balancing loss (one process: every collective is the identity)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = MoEConfig(dim=D, hidden_dim=H, num_experts=6, top_k=2, norm_topk_prob=norm)
    dense = _dense(config)
    hf = _hf_block(family, config)
    with torch.no_grad():
        hf.gate.weight.copy_(dense.router.weight)
        hf.experts.gate_up_proj.copy_(dense.experts.gate_up_proj)
        hf.experts.down_proj.copy_(dense.experts.down_proj)
    moe = _layer(dense, None, None, None)
    x, g = torch.randn(3, 7, D), torch.randn(3, 7, D)
    x_hf, x_moe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_hf = hf(x_hf)
    balance_hf = load_balancing_loss_func((hf.gate(x_hf)[0],), config.num_experts, config.top_k)
    ((y_hf * g).sum() + BALANCE_COEF * balance_hf).backward()
    y, aux = moe(x_moe)
    ((y * g).sum() + BALANCE_COEF * aux.balance_loss).backward()
    errors: dict[str, float] = {}
    _check("output", y, y_hf, errors)
    _check("balance loss", aux.balance_loss, balance_hf, errors)
    _check("input grad", x_moe.grad, x_hf.grad, errors)
    _check("router grad", moe.router.weight.grad, hf.gate.weight.grad, errors)
    _check("gate_up grad", moe.experts.gate_up_proj.grad, hf.experts.gate_up_proj.grad, errors)
    _check("down grad", moe.experts.down_proj.grad, hf.experts.down_proj.grad, errors)


def test_gpt_oss_experts_agree():
    """GPT-OSS's experts (interleaved gate and up, a bias on each expert's two matmuls, the
    SwiGLU clamped at a limit low enough to clamp here) as ``GroupedExperts`` with
    ``activation="clamped_swiglu"`` and ``expert_bias``, run by ``routed_experts`` on the
    same choices: transformers' ``GptOssExperts`` output and every gradient (one process)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from tensorpar.transformer.moe import GroupedExperts, routed_experts

    config = MoEConfig(dim=D, hidden_dim=H, num_experts=6, top_k=2, activation="clamped_swiglu",
                       swiglu_alpha=1.5, swiglu_limit=0.5, expert_bias=True)
    torch.manual_seed(0)
    hf = GptOssExperts(GptOssConfig(hidden_size=D, intermediate_size=H, num_local_experts=6,
                                    swiglu_limit=0.5))
    hf.alpha = 1.5
    ours = GroupedExperts(config, 0, 6)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(std=0.3)
        ours.gate_up_proj.copy_(hf.gate_up_proj.transpose(1, 2))  # theirs (E, D, 2H)
        ours.down_proj.copy_(hf.down_proj.transpose(1, 2))
        ours.gate_up_bias.copy_(hf.gate_up_proj_bias)
        ours.down_bias.copy_(hf.down_proj_bias)
    x, g = torch.randn(11, D), torch.randn(11, D)
    experts = torch.stack([torch.randperm(5)[:2] for _ in range(11)])  # expert 5 gets no row
    weights = torch.rand(11, 2)
    x_hf, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_hf = hf(x_hf, experts, weights)
    y = routed_experts(x_ours, experts, weights, [6], None, ours)
    (y_hf * g).sum().backward()
    (y * g).sum().backward()
    errors: dict[str, float] = {}
    _check("output", y, y_hf, errors)
    _check("input grad", x_ours.grad, x_hf.grad, errors)
    _check("gate_up grad", ours.gate_up_proj.grad, hf.gate_up_proj.grad.transpose(1, 2), errors)
    _check("down grad", ours.down_proj.grad, hf.down_proj.grad.transpose(1, 2), errors)
    _check("gate_up bias grad", ours.gate_up_bias.grad, hf.gate_up_proj_bias.grad, errors)
    _check("down bias grad", ours.down_bias.grad, hf.down_proj_bias.grad, errors)
    clamped = (x @ hf.gate_up_proj[0] + hf.gate_up_proj_bias[0]).abs() > 0.5
    assert clamped.any() and not clamped.all()  # the limit is reached, by some values only


def test_grouped_matmul_and_its_fallback_agree():
    """fp32 rows go through torch._grouped_mm, fp64 through the loop over experts: the same
    numbers (to fp32 rounding), experts left without rows included."""
    from tensorpar.transformer.moe import grouped_linear

    torch.manual_seed(0)
    x, w = torch.randn(9, D), torch.randn(4, 2 * H, D)
    counts = torch.tensor([3, 0, 6, 0])
    expected = torch.cat([x[:3] @ w[0].T, x[3:] @ w[2].T])
    assert max_rel_error(grouped_linear(x, w, counts), expected) < 1e-6
    assert max_rel_error(grouped_linear(x.double(), w.double(), counts), expected) < 1e-6


@pytest.mark.parametrize("kwargs,words", [
    ({"num_experts": 0, "top_k": 1}, "num_experts=0; it must be at least 1"),
    ({"num_experts": 4, "top_k": 0}, "top_k=0; it must be at least 1"),
    ({"num_experts": 4, "top_k": 5}, "top_k=5 is more than num_experts=4"),
    ({"num_experts": 4, "top_k": 2, "router": "relu"}, "router='relu'"),
    ({"num_experts": 4, "top_k": 2, "shared_hidden_dim": -1}, "shared_hidden_dim=-1"),
], ids=["no-experts", "top-k-0", "top-k-above-experts", "router", "shared"])
def test_config_refused_in_one_line(kwargs, words):
    with pytest.raises(ValueError, match=words) as e:
        MoEConfig(dim=D, hidden_dim=H, **kwargs)
    assert "\n" not in str(e.value)


def _refused_body(case: str):
    """The refusal's message on this rank, and the collectives issued before it (none)."""
    config = MoEConfig(dim=D, hidden_dim=H, num_experts=3, top_k=2)
    pairs, _ = _groups(2)
    try:
        with CollectiveCounter() as counter:
            if case == "experts":  # 3 experts over 4 EP ranks
                ParallelMoE(config, tp_group=pairs, ep_group=None)
            elif case == "overlap":  # the TP group (4 ranks) shares 2 with each EP pair
                ParallelMoE(config, tp_group=None, ep_group=pairs)
            else:
                ParallelMoE(config, tp_group=pairs, ep_group=pairs)(torch.randn(2, 3, D + 1))
    except ValueError as e:
        return str(e), dict(counter.counts)
    return None, dict(counter.counts)


@pytest.mark.parametrize("case,words", [
    ("experts", "3 experts over 4 EP ranks"),
    ("overlap", "share 2 ranks with the EP group"),
    ("input", r"input shape \(2, 3, 17\); expected \(B, T, 16\)"),
], ids=["experts", "overlap", "input"])
def test_layer_refused_on_every_rank_before_any_collective(ranks, case, words):
    """Every rank raises the same one line, having issued no collective (none hangs)."""
    import re

    for message, counts in ranks(4).run(_refused_body, case):
        assert message is not None and re.search(words, message) and "\n" not in message, message
        assert counts == {}


def _one_token_body():
    config = MoEConfig(dim=D, hidden_dim=H, **ROUTERS["softmax-norm"])
    dense = _dense(config)
    x = torch.randn(1, 1, D)
    x_ref, x_moe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ref, (balance, _, _) = dense(x_ref)
    (y_ref.sum() + balance).backward()
    y, aux = _layer(dense, None, None, None)(x_moe)
    (y.sum() + aux.balance_loss).backward()
    errors: dict[str, float] = {}
    _check("output", y, y_ref, errors)
    _check("input grad", x_moe.grad, x_ref.grad, errors)
    _check("balance loss", aux.balance_loss, balance, errors)


def test_fewer_tokens_than_tp_ranks(ranks):
    """One token at TP 2 = EP 2: one rank routes it, the other routes none and still joins
    every collective."""
    ranks(2).run(_one_token_body)


def test_routed_experts_take_weights_of_another_dtype():
    """fp32 tokens, bf16 experts' outputs and router weights (under autocast; GPT-OSS's softmax
    in the top values' dtype): the k outputs weighted and summed in the product's dtype, as the
    loop over choices gives, not refused by ``index_add``."""
    from tensorpar.transformer.moe import routed_experts

    torch.manual_seed(0)
    x = torch.randn(5, 4)
    experts = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    weights = torch.rand(5, 2).to(torch.bfloat16)
    scale = torch.tensor([1.0, 2.0, 3.0])  # expert e multiplies its rows by e + 1

    def run(rows, counts):
        return (rows * scale.repeat_interleave(counts).unsqueeze(-1)).to(torch.bfloat16)

    y = routed_experts(x, experts, weights, [3], None, run)
    outs = [(x * scale[experts[:, j]].unsqueeze(-1)).to(torch.bfloat16) for j in range(2)]
    want = sum(outs[j].float() * weights[:, j:j + 1].float() for j in range(2))
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)
