"""Mixture of Experts: a top-k router, SwiGLU experts split across expert-parallel ranks, shared
experts split like the MLP; dropless (every token reaches every expert it chose).

::

    x (B, T, D) ─┬─ split_tokens (TP) ─> router ─> top-k experts, weights ─┐
                 │                      sort by expert ─> all-to-all (EP) ─> grouped SwiGLU
                 │                      <─ all-to-all back (EP) <───────────┘
                 │    weighted sum of each token's k rows ─> gather_tokens (TP) ─> y_routed
                 └─ shared experts (ParallelMLP: column then row over TP) ──────> y_shared
    y = y_routed + y_shared

Expert parallelism: the E routed experts are cut across the ``ep_group`` as ``tensor_split``
cuts (6 experts over 4 ranks: 2, 2, 1, 1); each rank sends the rows routed to another rank's
experts there, with sizes exchanged first (``parallel/expert_dispatch.py``). Tensor
parallelism: every rank of a TP group holds the same tokens, so each routes and sends only its
``tensor_split`` share of them and the shares are gathered afterwards; the router's weight is
replicated and its gradient summed over the TP group, so it stays equal on every rank. The
ranks of a TP group either all sit in one EP group (they hold different experts) or each in
another (they hold the same experts, whose gradients are then summed over TP as the router's).
Under sequence parallelism the TP ranks already hold different tokens: no split, no gather.

The auxiliary losses are returned, never added: the load-balancing loss as transformers'
``load_balancing_loss_func`` computes it for Mixtral and Qwen3-MoE, ``E * sum_i f_i P_i`` with
f_i the fraction of the k·N choices that went to expert i (the f_i sum to k) and P_i the mean
router probability of expert i; and the z-loss ``mean(logsumexp(logits)^2)``. Their statistics
cover the tokens of every rank of ``stats_group`` (one all-reduce of 2E + 2 numbers, identity in
backward: each rank's gradient is its own tokens' share), so any layout gives the value one rank
running all those tokens gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.parallel.expert_dispatch import (
    combine_from_experts,
    dispatch_to_experts,
    exchange_expert_counts,
    gather_tokens,
    inverse_permutation,
    permute_rows,
    split_tokens,
)
from tensorpar.parallel.mappings import reduce_from_tp, sum_grads_in_backward
from tensorpar.parallel.sharding import ShardSpec, shard_range, shard_sizes
from tensorpar.runtime.groups import tp_rank, tp_size
from tensorpar.transformer.mlp import ParallelMLP

ROUTERS = ("softmax", "sigmoid")
ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class MoEConfig:
    """The shape and routing of one MoE layer."""

    dim: int  # model width D
    hidden_dim: int  # each routed expert's SwiGLU width H
    num_experts: int  # routed experts E
    top_k: int  # experts each token goes to
    router: str = "softmax"  # "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the k chosen weights to sum to 1
    route_scale: float = 1.0  # a factor on the routing weights (DeepSeek-V3's routed_scaling)
    shared_hidden_dim: int = 0  # the shared experts' SwiGLU width, 0 for none
    # the routed experts' gated unit: "silu": silu(gate) * up, gate_up = [gate | up] (Mixtral,
    # Qwen3-MoE); "clamped_swiglu" (GPT-OSS): gate and up interleaved, gate clamped above at
    # swiglu_limit, up to +-swiglu_limit, then (up + 1) * gate * sigmoid(swiglu_alpha * gate)
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    expert_bias: bool = False  # a bias on each routed expert's gate_up and down (GPT-OSS)

    def __post_init__(self):
        for name in ("dim", "hidden_dim", "num_experts", "top_k"):
            if getattr(self, name) < 1:
                raise ValueError(f"MoEConfig: {name}={getattr(self, name)}; it must be at "
                                 "least 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig: top_k={self.top_k} is more than num_experts="
                             f"{self.num_experts}")
        if self.router not in ROUTERS:
            raise ValueError(f"MoEConfig: router={self.router!r}; expected one of {ROUTERS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoEConfig: activation={self.activation!r}; expected one of "
                             f"{ACTIVATIONS}")
        if self.shared_hidden_dim < 0:
            raise ValueError(f"MoEConfig: shared_hidden_dim={self.shared_hidden_dim}; expected "
                             "0 (no shared experts) or more")


@dataclass
class Routing:
    """What the router decided for n tokens."""

    logits: torch.Tensor  # (n, E) float32
    scores: torch.Tensor  # (n, E): each token's probability per expert (the balancing loss's P)
    experts: torch.Tensor  # (n, k) int64: the chosen experts
    weights: torch.Tensor  # (n, k): their weights in the token's output


@dataclass
class MoEAux:
    """A pass's router statistics, over the tokens of every rank of the statistics group."""

    balance_loss: torch.Tensor  # E * sum_i f_i P_i (k when perfectly balanced)
    z_loss: torch.Tensor  # mean over tokens of logsumexp(logits)^2
    expert_load: torch.Tensor  # (E,) tokens routed to each expert (no gradient), for logging

    def loss(self, balance_coef: float, z_coef: float = 0.0) -> torch.Tensor:
        """What the caller adds to its loss: ``balance_coef * balance + z_coef * z``."""
        return balance_coef * self.balance_loss + z_coef * self.z_loss


class TopKRouter(nn.Module):
    """Scores every expert for each token and keeps the top k.

    softmax: p = softmax(x W^T); the k largest, renormalised to sum to 1 when
        ``norm_topk_prob``. sigmoid (DeepSeek-V3): s = sigmoid(x W^T); the k largest of
        s + ``selection_bias`` are chosen, but the weights are s itself (renormalised when
        ``norm_topk_prob``): the bias moves selection only. The bias is a buffer, moved by the
        caller (loss-free balancing), never by the optimizer.
    """

    def __init__(self, config: MoEConfig, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.dim, device=device,
                                               dtype=dtype))
        if device != "meta":
            nn.init.normal_(self.weight, std=config.dim ** -0.5)
        self.weight.tp_shard = ShardSpec(None)
        if config.router == "sigmoid":
            self.register_buffer("selection_bias", torch.zeros(config.num_experts, device=device))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> Routing:
        """x: (n, D). weight: the router weight to use (``self.weight`` wrapped for its
        gradient sum, from the MoE block)."""
        c = self.config
        logits = F.linear(x, self.weight if weight is None else weight).float()  # (n, E)
        if c.router == "softmax":
            scores = torch.softmax(logits, dim=-1)
            weights, experts = torch.topk(scores, c.top_k, dim=-1)
            balance_scores = scores
        else:
            scores = torch.sigmoid(logits)
            experts = torch.topk(scores.detach() + self.selection_bias, c.top_k, dim=-1)[1]
            weights = scores.gather(1, experts)
            balance_scores = scores / scores.sum(-1, keepdim=True)
        if c.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if c.route_scale != 1.0:
            weights = weights * c.route_scale
        return Routing(logits, balance_scores, experts, weights.to(x.dtype))


def router_statistics(routing: Routing, num_experts: int,
                      group: ProcessGroup | None = None) -> MoEAux:
    """The balancing loss, the z-loss and the expert load over the tokens of every rank of
    ``group``: one all-reduce of (load, probability sums, sum of lse^2, token count),
    identity in backward."""
    logits, experts = routing.logits, routing.experts
    load = torch.bincount(experts.reshape(-1), minlength=num_experts).to(logits.dtype)
    lse2 = torch.logsumexp(logits, dim=-1).pow(2).sum()
    count = logits.new_tensor([logits.shape[0]])
    packed = torch.cat([load, routing.scores.sum(0), lse2.view(1), count])
    packed = reduce_from_tp(packed, group)  # (2E + 2,)
    load, prob_sum = packed[:num_experts].detach(), packed[num_experts:2 * num_experts]
    lse2, tokens = packed[-2], packed[-1].detach()
    balance = num_experts * torch.sum((load / tokens) * (prob_sum / tokens))
    return MoEAux(balance, lse2 / tokens, load)


def _grouped_mm_fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm takes fp32/bf16/fp16 with every row 16-byte aligned."""
    align = 16 // x.element_size()
    return (hasattr(torch, "_grouped_mm") and x.dtype in (torch.float32, torch.bfloat16,
                                                          torch.float16)
            and x.shape[-1] % align == 0 and w.shape[1] % align == 0)


class _ContiguousGrad(torch.autograd.Function):
    """forward: identity, backward: the gradient made contiguous (``_grouped_mm`` needs it)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """(M, K) rows grouped by expert, ``counts[g]`` rows for expert g, times each expert's
    (N, K) weight ``w[g]`` transposed, plus its bias ``bias[g]`` (G, N) when given -> (M, N).
    One ``torch._grouped_mm`` where it runs; a loop over the experts for the dtypes it lacks
    (fp64)."""
    if _grouped_mm_fits(x, w):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        y = _ContiguousGrad.apply(torch._grouped_mm(x, w.transpose(1, 2), offs=offsets))
    else:
        pieces = torch.split(x, counts.tolist())
        y = torch.cat([p @ w[g].T for g, p in enumerate(pieces)])
    return y if bias is None else y + torch.repeat_interleave(bias, counts, dim=0)


def expert_activation(gate_up: torch.Tensor, config: MoEConfig) -> torch.Tensor:
    """(M, 2H) -> (M, H): the routed experts' gated unit (``MoEConfig.activation``)."""
    if config.activation == "silu":
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]  # GPT-OSS: interleaved
    gate = gate.clamp(max=config.swiglu_limit)
    up = up.clamp(min=-config.swiglu_limit, max=config.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * config.swiglu_alpha))


def swiglu_experts(x: torch.Tensor, counts: torch.Tensor, config: MoEConfig,
                   gate_up: torch.Tensor, down: torch.Tensor,
                   gate_up_bias: torch.Tensor | None = None,
                   down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """(M, D) rows grouped by expert, ``counts`` of each -> (M, D): each expert's gated unit,
    with gate_up (G, 2H, D), down (G, D, H) and the optional biases (G, 2H), (G, D)."""
    hidden = expert_activation(grouped_linear(x, gate_up, counts, gate_up_bias), config)
    return grouped_linear(hidden, down, counts, down_bias)


class GroupedExperts(nn.Module):
    """Routed SwiGLU experts ``[start, stop)`` of E, in transformers' fused layout:
    ``gate_up_proj`` (E_local, 2H, D) (gate rows first, then up; interleaved for
    ``clamped_swiglu``) and ``down_proj`` (E_local, D, H), with ``config.expert_bias`` also
    ``gate_up_bias`` (E_local, 2H) and ``down_bias`` (E_local, D); each tagged ``ep_shard``
    (dim 0 of the E experts)."""

    def __init__(self, config: MoEConfig, start: int, stop: int, *, device=None, dtype=None):
        super().__init__()
        self.config = config
        n, d, h = stop - start, config.dim, config.hidden_dim
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * h, d, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(n, d, h, device=device, dtype=dtype))
        if device != "meta":
            nn.init.normal_(self.gate_up_proj, std=d ** -0.5)
            nn.init.normal_(self.down_proj, std=h ** -0.5)
        if config.expert_bias:
            self.gate_up_bias = nn.Parameter(torch.zeros(n, 2 * h, device=device, dtype=dtype))
            self.down_bias = nn.Parameter(torch.zeros(n, d, device=device, dtype=dtype))
        for p in self.parameters():
            p.ep_shard = ShardSpec(0, start, stop, config.num_experts)

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                params: list[torch.Tensor] | None = None) -> torch.Tensor:
        """x: (M, D) rows grouped by local expert, ``counts`` (E_local,) of them each -> (M, D).
        params: the weights (then the biases) to use, wrapped for a gradient sum; default the
        module's own."""
        return swiglu_experts(x, counts, self.config, *(params or list(self.parameters())))


def _group_ranks(group: ProcessGroup | None) -> list[int]:
    return dist.get_process_group_ranks(dist.group.WORLD if group is None else group)


def experts_shared_by_tp(tp_group: ProcessGroup | None, ep_group: ProcessGroup | None) -> bool:
    """Whether the TP ranks hold the same experts (each in another EP group: True) or different
    ones (all in one EP group: False); any other overlap is refused. No collective."""
    if tp_size(tp_group) == 1:
        return False
    tp_ranks, ep_ranks = set(_group_ranks(tp_group)), set(_group_ranks(ep_group))
    inside = tp_ranks & ep_ranks
    if inside == tp_ranks:
        return False
    if len(inside) == 1:
        return True
    raise ValueError(f"ParallelMoE: the TP group's ranks {sorted(tp_ranks)} share {len(inside)} "
                     f"ranks with the EP group {sorted(ep_ranks)}; expected all of them or only "
                     "this rank")


def _expert_major(recv_counts: torch.Tensor) -> torch.Tensor:
    """Rows received grouped by source then expert, ``recv_counts`` (S, J) of each -> the
    permutation that groups them by expert then source."""
    flat = recv_counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # where chunk (s, j) starts, source-major
    lengths, starts = recv_counts.t().reshape(-1), starts.view_as(recv_counts).t().reshape(-1)
    chunk_start = torch.cumsum(lengths, 0) - lengths  # where it goes, expert-major
    shift = torch.repeat_interleave(starts - chunk_start, lengths)
    return torch.arange(int(lengths.sum()), device=flat.device) + shift


class ParallelMoE(nn.Module):
    """A dropless MoE layer: routed experts split across ``ep_group``, shared experts split by
    TP, the routing the same as one device's.

    tp_group: the ranks that hold the same tokens (the attention's TP group); None: the world.
    ep_group: the ranks the routed experts are split across; None: the world.
    stats_group: the ranks whose tokens make one pass of the router statistics (every rank
        holding other tokens: TP ranks each route their share, so the TP group is part of it);
        None: the world.
    sequence_parallel: x is this TP rank's (B, T_r, D) sequence shard.
    """

    def __init__(self, config: MoEConfig, tp_group: ProcessGroup | None = None,
                 ep_group: ProcessGroup | None = None, stats_group: ProcessGroup | None = None,
                 sequence_parallel: bool = False, *, device=None, dtype=None):
        super().__init__()
        ep = tp_size(ep_group)
        if ep > config.num_experts:
            raise ValueError(f"ParallelMoE: {config.num_experts} experts over {ep} EP ranks; "
                             "every EP rank needs at least one expert")
        self.config, self.sequence_parallel = config, sequence_parallel
        self.tp_group, self.ep_group, self.stats_group = tp_group, ep_group, stats_group
        self.experts_per_rank = shard_sizes(config.num_experts, ep)
        self.expert_range = shard_range(config.num_experts, ep, tp_rank(ep_group))
        self.experts_shared_by_tp = experts_shared_by_tp(tp_group, ep_group)
        kw = {"device": device, "dtype": dtype}
        self.router = TopKRouter(config, **kw)
        self.experts = GroupedExperts(config, *self.expert_range, **kw)
        self.shared = None if not config.shared_hidden_dim else ParallelMLP(
            config.dim, config.shared_hidden_dim, gated=True, activation="silu", bias=False,
            sequence_parallel=sequence_parallel, group=tp_group, **kw)

    @classmethod
    def from_dense(cls, config: MoEConfig, router_weight: torch.Tensor,
                   gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                   shared: tuple[nn.Linear, nn.Linear, nn.Linear] | None = None,
                   tp_group: ProcessGroup | None = None, ep_group: ProcessGroup | None = None,
                   stats_group: ProcessGroup | None = None,
                   sequence_parallel: bool = False,
                   expert_biases: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> ParallelMoE:
        """From the dense weights: the router's (E, D), the experts' (E, 2H, D) and (E, D, H)
        (transformers' fused layout) and, with ``config.expert_bias``, their biases (E, 2H)
        and (E, D), of which this rank keeps its experts, and the shared experts' (gate, up,
        down) linears, split by ``ParallelMLP.from_dense``."""
        want = {"router_weight": (config.num_experts, config.dim),
                "gate_up_proj": (config.num_experts, 2 * config.hidden_dim, config.dim),
                "down_proj": (config.num_experts, config.dim, config.hidden_dim)}
        for name, t in zip(want, (router_weight, gate_up_proj, down_proj), strict=True):
            if tuple(t.shape) != want[name]:
                raise ValueError(f"ParallelMoE.from_dense: {name} is {tuple(t.shape)}, the "
                                 f"config gives {want[name]}")
        if (expert_biases is not None) != config.expert_bias:
            raise ValueError(f"ParallelMoE.from_dense: expert_bias={config.expert_bias} but "
                             f"expert biases {'given' if expert_biases else 'missing'}")
        if (shared is not None) != bool(config.shared_hidden_dim):
            raise ValueError(f"ParallelMoE.from_dense: shared_hidden_dim="
                             f"{config.shared_hidden_dim} but shared experts "
                             f"{'given' if shared is not None else 'missing'}")
        moe = cls(config, tp_group, ep_group, stats_group, sequence_parallel, device="meta",
                  dtype=router_weight.dtype)
        moe.router.weight = nn.Parameter(router_weight.detach().clone())
        moe.router.weight.tp_shard = ShardSpec(None)
        if config.router == "sigmoid":
            moe.router.selection_bias = torch.zeros(config.num_experts,
                                                    device=router_weight.device)
        start, stop = moe.expert_range
        dense_experts = [("gate_up_proj", gate_up_proj), ("down_proj", down_proj)]
        if expert_biases is not None:
            dense_experts += list(zip(("gate_up_bias", "down_bias"), expert_biases, strict=True))
        for name, dense in dense_experts:
            p = nn.Parameter(dense.detach()[start:stop].clone())
            p.ep_shard = ShardSpec(0, start, stop, config.num_experts)
            setattr(moe.experts, name, p)
        if shared is not None:
            gate, up, down = shared
            moe.shared = ParallelMLP.from_dense(up, down, gate, activation="silu",
                                                sequence_parallel=sequence_parallel,
                                                group=tp_group)
        return moe

    def forward(self, x: torch.Tensor, seq_len: int | None = None
                ) -> tuple[torch.Tensor, MoEAux]:
        """x: (B, T, D), or under SP this rank's (B, T_r, D) shard of T = ``seq_len`` tokens.
        Returns the output shaped like x and the pass's ``MoEAux``."""
        if x.dim() != 3 or x.shape[-1] != self.config.dim:
            raise ValueError(f"ParallelMoE: input shape {tuple(x.shape)}; expected (B, T, "
                             f"{self.config.dim})")
        tokens = x.reshape(-1, x.shape[-1])  # (N, D)
        mine = tokens if self.sequence_parallel else split_tokens(tokens, self.tp_group)
        params = [self.router.weight]
        if self.experts_shared_by_tp:
            params += list(self.experts.parameters())
        router_w, *expert_ws = sum_grads_in_backward(params, self.tp_group)
        routing = self.router(mine, router_w)
        aux = router_statistics(routing, self.config.num_experts, self.stats_group)
        y = routed_experts(mine, routing.experts, routing.weights, self.experts_per_rank,
                           self.ep_group, lambda rows, counts: self.experts(rows, counts,
                                                                          expert_ws or None))
        if not self.sequence_parallel:
            y = gather_tokens(y, tokens.shape[0], self.tp_group)
        y = y.view_as(x)
        if self.shared is not None:
            y = y + self.shared(x, seq_len)
        return y, aux


def routed_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                   experts_per_rank: list[int], ep_group: ProcessGroup | None,
                   run) -> torch.Tensor:
    """x: (n, D) tokens, each sent to its k chosen ``experts`` (n, k) -> (n, D): the k outputs
    weighted by ``weights`` (n, k) and summed. The E = sum(experts_per_rank) experts are cut
    across ``ep_group`` in that many consecutive ones per rank; ``run(rows, counts)`` computes
    this rank's experts on rows grouped by local expert, ``counts`` (E_local,) of each."""
    n, k = experts.shape
    chosen = experts.reshape(-1)  # (n k,): token t's choices at t k .. t k + k - 1
    order = torch.argsort(chosen, stable=True)  # grouped by expert, so by EP rank too
    token = order // k  # (n k,): the token of each sorted row
    rows = x.index_select(0, token)  # (n k, D)
    counts = torch.bincount(chosen, minlength=sum(experts_per_rank))  # (E,)
    if tp_size(ep_group) == 1:
        out = run(rows, counts)
    else:
        recv = exchange_expert_counts(counts, experts_per_rank, ep_group)  # (S, J)
        send_sizes = [int(c.sum()) for c in counts.split(experts_per_rank)]
        recv_sizes = recv.sum(1).tolist()
        arrived = dispatch_to_experts(rows, send_sizes, recv_sizes, ep_group)
        perm = _expert_major(recv)
        done = run(permute_rows(arrived, perm), recv.sum(0))
        back = permute_rows(done, inverse_permutation(perm))  # grouped by source again
        out = combine_from_experts(back, send_sizes, recv_sizes, ep_group)
    # each sorted row weighted and added to its token: token t's k rows in expert order, the
    # order of the dense model's loop over experts
    weighted = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1)  # (n k, D)
    # in the product's dtype (fp32 tokens with bf16 router weights under autocast: fp32)
    return x.new_zeros(n, x.shape[-1], dtype=weighted.dtype).index_add(0, token, weighted)


def moe_collective_counts(tp: int, ep: int, stats: int, shared: bool,
                          sequence_parallel: bool = False) -> dict[str, dict[str, int]]:
    """The collectives of one forward and one backward of ``ParallelMoE`` at TP size ``tp``,
    EP size ``ep`` and ``stats`` ranks in the statistics group (under SP, ``seq_len`` given),
    for an input that requires grad: {"forward": {kind: calls}, "backward": {...}}.

    EP: the counts' all-to-all, the rows' and their way back (forward), both reversed
    (backward). TP: the gathered outputs (forward) and input gradients (backward), one
    all-reduce summing the router's (and shared experts') gradients; the shared experts as the
    MLP. Statistics: one all-reduce forward."""
    fwd: dict[str, int] = {}
    bwd: dict[str, int] = {}

    def add(d, kind, calls=1):
        d[kind] = d.get(kind, 0) + calls

    if ep > 1:
        add(fwd, "all_to_all", 3)
        add(bwd, "all_to_all", 2)
    if stats > 1:
        add(fwd, "all_reduce")
    if tp > 1:
        add(bwd, "all_reduce")  # the router's gradient sum (the experts' in it when shared)
        if not sequence_parallel:
            add(fwd, "all_gather")
            add(bwd, "all_gather")
        if shared and sequence_parallel:
            add(fwd, "all_gather"), add(fwd, "reduce_scatter")
            add(bwd, "all_gather", 2), add(bwd, "reduce_scatter")
        elif shared:
            add(fwd, "all_reduce"), add(bwd, "all_reduce")
    return {"forward": fwd, "backward": bwd}
