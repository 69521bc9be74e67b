"""The Mixture-of-Experts blocks of Hugging Face models (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE,
GPT-OSS), split by the plan style ``moe``::

    block (the model's own)       what happens to it
    gate / router                 kept whole on every rank: it routes all the tokens, so the
                                  choices, the recorded router logits and the model's own
                                  load-balancing loss are the dense model's
    experts                       ExpertParallelExperts: the routed experts cut across the EP
                                  group (default: the TP group) as tensor_split cuts
    shared_expert(s)              style ``mlp``: gate/up column, down row over TP
    shared_expert_gate            whole (Qwen2-MoE's sigmoid gate on the shared expert)
    a dense MLP in its place      style ``mlp`` (a layer without experts)

``ExpertParallelExperts`` takes what the model's experts module takes, (hidden (N, D), chosen
experts (N, k), their weights (N, k)), and returns (N, D). Each TP rank holds the same tokens,
so it takes its ``tensor_split`` share of them and of their weights (``split_tokens``: in
backward the shares' gradients are all-gathered, so the replicated router's gradient is whole
on every rank), sends each row to the rank holding its expert (``routed_experts``, the core's
dispatch), and the shares are all-gathered after (``gather_tokens``). Under sequence
parallelism (``sequence.py``) each TP rank holds and routes its own shard: its rows go to their
experts as they are. ``balancing_loss`` is the models' load-balancing loss with its statistics
summed over the ranks holding different tokens (``train --hf`` with ``--dp`` or ``--cp``). The
weights keep the model's names and layout (GPT-OSS's transposed (E, D, 2H) and its biases too),
sliced on the expert dimension, so a checkpoint or an export finds them under the model's own
names.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.parallel.expert_dispatch import gather_tokens, split_tokens
from tensorpar.parallel.mappings import reduce_from_tp, sum_grads_in_backward
from tensorpar.parallel.sharding import (
    REPLICATED,
    ShardSpec,
    local_parameter,
    shard_range,
    shard_sizes,
)
from tensorpar.runtime.groups import tp_rank, tp_size
from tensorpar.transformer.moe import (
    MoEConfig,
    experts_shared_by_tp,
    routed_experts,
    swiglu_experts,
)

SHARED = ("shared_expert", "shared_experts")  # Qwen2-MoE's, DeepSeek-V3's
# per-expert tensors of a saved checkpoint (transformers writes them apart, Mixtral's with
# its original names): (gate, up, down) child names
PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def experts_config(name: str, m: nn.Module) -> tuple[MoEConfig, bool]:
    """The ``MoEConfig`` of a transformers experts module ``m`` (the parts the routed experts
    use; top_k is the router's, so 1 here) and whether its weights are transposed (GPT-OSS:
    gate_up (E, D, 2H), down (E, H, D)). ValueError naming ``name`` for another layout."""
    gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or \
            gate_up.dim() != 3:
        raise ValueError(f"{name}: style 'moe' needs experts with fused 3-D gate_up_proj and "
                         f"down_proj weights; {type(m).__name__} has "
                         f"{[n for n, _ in m.named_parameters()]}")
    E = gate_up.shape[0]
    transposed = bool(getattr(m, "is_transposed", False))
    D, two_h = (gate_up.shape[1], gate_up.shape[2]) if transposed else \
        (gate_up.shape[2], gate_up.shape[1])
    bias = getattr(m, "gate_up_proj_bias", None) is not None
    if hasattr(m, "limit") and hasattr(m, "alpha"):  # GPT-OSS's clamped SwiGLU
        kw = {"activation": "clamped_swiglu", "swiglu_alpha": float(m.alpha),
              "swiglu_limit": float(m.limit)}
    elif "silu" in (act := type(getattr(m, "act_fn", None)).__name__).lower():
        kw = {}
    else:
        raise ValueError(f"{name}: experts with activation {act}; style 'moe' runs SiLU and "
                         "GPT-OSS's clamped SwiGLU")
    return MoEConfig(dim=D, hidden_dim=two_h // 2, num_experts=E, top_k=1, expert_bias=bias,
                     **kw), transposed


def read_experts(source, name: str, key: str, start: int, stop: int) -> torch.Tensor:
    """Experts [start, stop) of ``name.key`` (gate_up_proj, down_proj or a bias) from a source:
    the fused tensor where it has one, else stacked from the per-expert tensors
    (``experts.i.gate_proj.weight`` and ``up_proj``, or Mixtral's ``w1`` and ``w3``,
    concatenated as [gate | up]; ``down_proj`` / ``w2``) that transformers saves."""
    try:
        return source.read(f"{name}.{key}", 0, start, stop)
    except (KeyError, ValueError):
        if key not in ("gate_up_proj", "down_proj"):
            raise
    for gate, up, down in PER_EXPERT_NAMES:
        children = (gate, up) if key == "gate_up_proj" else (down,)
        try:
            return torch.stack([torch.cat([source.read(f"{name}.{i}.{c}.weight")
                                           for c in children]) for i in range(start, stop)])
        except (KeyError, ValueError):
            continue
    raise ValueError(f"{name}: no {key} in the checkpoint, fused or per expert "
                     f"({', '.join('/'.join(n) for n in PER_EXPERT_NAMES)})")


class ExpertParallelExperts(nn.Module):
    """A transformers experts module whose E experts are cut across ``ep_group``: this rank
    holds experts ``expert_range`` of the model's ``gate_up_proj`` and ``down_proj`` (and GPT-OSS's
    ``gate_up_proj_bias``, ``down_proj_bias``), under their own names and layout.

    tp_group: the ranks that hold the same tokens (the attention's); ep_group: the ranks the
    experts are cut across (default the TP group). When the TP ranks hold the same experts
    (each in another EP group), the experts' gradients are summed over TP in backward.
    sequence_parallel: the TP ranks hold different tokens (their sequence shards), routed and
    sent as they are: no split, no gather.
    """

    def __init__(self, config: MoEConfig, transposed: bool, tensors: dict[str, torch.Tensor],
                 tp_group: ProcessGroup | None, ep_group: ProcessGroup | None,
                 requires_grad: bool = True, sequence_parallel: bool = False):
        super().__init__()
        self.config, self.transposed = config, transposed
        self.tp_group, self.ep_group = tp_group, ep_group
        self.sequence_parallel = sequence_parallel
        ep = tp_size(ep_group)
        self.experts_per_rank = shard_sizes(config.num_experts, ep)
        self.expert_range = shard_range(config.num_experts, ep, tp_rank(ep_group))
        self.experts_shared_by_tp = experts_shared_by_tp(tp_group, ep_group)
        spec = ShardSpec(0, *self.expert_range, config.num_experts)
        # cut over the TP group itself: also a TP shard (checkpoints reshard it as one)
        tp_spec = spec if not self.experts_shared_by_tp and ep == tp_size(tp_group) \
            else REPLICATED
        for key, t in tensors.items():
            p = local_parameter(t, tp_spec, requires_grad)
            p.ep_shard = spec
            setattr(self, key, p)
        self.names = list(tensors)

    def forward(self, hidden: torch.Tensor, experts: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """hidden (N, D), experts (N, k) chosen, weights (N, k) -> (N, D), as the model's own."""
        n, k = experts.shape
        split = tp_size(self.tp_group) > 1 and not self.sequence_parallel
        if split:  # this rank's share of the tokens, with their weights
            both = split_tokens(torch.cat([hidden, weights.to(hidden.dtype)], -1), self.tp_group)
            x, w = both.split([hidden.shape[-1], k], -1)
            a, b = shard_range(n, tp_size(self.tp_group), tp_rank(self.tp_group))
            experts = experts[a:b]
        else:
            x, w = hidden, weights
        params = [getattr(self, key) for key in self.names]
        if self.experts_shared_by_tp:
            params = sum_grads_in_backward(params, self.tp_group)
        if self.transposed:  # GPT-OSS: (E, D, 2H) and (E, H, D) -> nn.Linear's (out, in)
            params[:2] = [t.transpose(1, 2) for t in params[:2]]
        y = routed_experts(x, experts, w, self.experts_per_rank, self.ep_group,
                           lambda rows, counts: swiglu_experts(rows, counts, self.config,
                                                               *params))
        if split:
            y = gather_tokens(y, n, self.tp_group)
        return y.to(hidden.dtype)


def convert_experts(source, name: str, m: nn.Module, tp_group: ProcessGroup | None,
                    ep_group: ProcessGroup | None, dtype,
                    sequence_parallel: bool = False) -> ExpertParallelExperts:
    """The transformers experts module ``m`` (named ``name``) as ``ExpertParallelExperts``,
    this rank's experts read from ``source``."""
    config, transposed = experts_config(name, m)
    if tp_size(ep_group) > config.num_experts:
        raise ValueError(f"{name}: {config.num_experts} experts over {tp_size(ep_group)} EP "
                         "ranks; every EP rank needs at least one expert")
    start, stop = shard_range(config.num_experts, tp_size(ep_group), tp_rank(ep_group))
    keys = ["gate_up_proj", "down_proj"] + \
        (["gate_up_proj_bias", "down_proj_bias"] if config.expert_bias else [])
    tensors = {key: read_experts(source, name, key, start, stop).to(dtype or m.gate_up_proj.dtype)
               for key in keys}
    return ExpertParallelExperts(config, transposed, tensors, tp_group, ep_group,
                                 m.gate_up_proj.requires_grad, sequence_parallel)


def balancing_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                   stats_group: ProcessGroup | None) -> torch.Tensor:
    """The HF MoE models' load-balancing loss (their ``load_balancing_loss_func``, without an
    attention mask) over the tokens of every rank of ``stats_group`` (None: this rank's
    alone): ``E * sum_i f_i P_i``, f_i the top-k choices of expert i and P_i its summed router
    probability, each over every layer's rows (one (N, E) tensor of logits a layer) divided by
    their count. The sums travel in one all-reduce of 2E + 1 numbers, identity in backward
    (each rank's gradient is its tokens' share), so ranks holding different tokens get the
    loss of one rank holding them all."""
    load = prob_sum = 0.0
    rows = 0
    for logits in router_logits:  # (N, E)
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        load = load + torch.bincount(chosen.reshape(-1), minlength=num_experts).float()
        prob_sum = prob_sum + probs.float().sum(0)
        rows += logits.shape[0]
    packed = torch.cat([load, prob_sum, prob_sum.new_tensor([rows])])
    if stats_group is not None:
        packed = reduce_from_tp(packed, stats_group)  # (2E + 1,)
    load, prob_sum = packed[:num_experts].detach(), packed[num_experts:-1]
    tokens = packed[-1].detach()
    return num_experts * torch.sum((load / tokens) * (prob_sum / tokens))


def check_moe_block(name: str, m: nn.Module, ep: int) -> None:
    """ValueError naming ``name`` unless style ``moe`` can split the block over ``ep`` EP ranks
    (the same on every rank, before anything is read)."""
    experts = getattr(m, "experts", None)
    if experts is None:
        return  # a dense MLP: style 'mlp' checks it
    config, _ = experts_config(f"{name}.experts", experts)
    if ep > config.num_experts:
        raise ValueError(f"{name}.experts: {config.num_experts} experts over {ep} EP ranks; "
                         "every EP rank needs at least one expert")
