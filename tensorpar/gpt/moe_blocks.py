"""The GPT's Mixture-of-Experts feed-forward (``--moe-experts E``): each block's MLP becomes the
core's ``ParallelMoE`` (``transformer/moe.py``), each routed expert a SwiGLU of ``--hidden-dim``,
``--moe-shared-experts S`` shared experts one SwiGLU of S x ``--hidden-dim`` split by TP.

Where it is split (beside ``model.py``'s table)::

    blocks.i.mlp.router.weight              replicated    (E, D), its gradient summed over TP
    blocks.i.mlp.experts.gate_up_proj       by expert     experts [e0, e1) of the EP group
    blocks.i.mlp.experts.down_proj          by expert
    blocks.i.mlp.shared.{gate,up,down}      column / row  as the dense MLP

The auxiliary losses are added through the gradient, not the loss's value (as Megatron's
auxiliary-loss scaler does): a pass's ``--moe-aux-coef x balance + --moe-z-coef x z`` is attached
to the block's output by an identity whose backward hands it the gradient ``aux_weight`` (the
trainer's dp / passes: each pass weighs 1 / passes of the step, and data parallelism averages
over dp while each rank holds its tokens' share), so the reported loss stays the cross-entropy
and pipeline stages need nothing more than their activations. Each pass's statistics (over the
tokens of every rank of the stage) are kept in ``records`` for the trainer's metrics and for
loss-free balancing (``--moe-balance bias``, DeepSeek-V3: the sigmoid router's selection bias
moved after each step by ``rate x sign(mean load - load)``, the loads those of every rank).
"""

from __future__ import annotations

import torch

from tensorpar.parallel.sharding import REPLICATED, ShardSpec
from tensorpar.transformer.expert_groups import ExpertGroups
from tensorpar.transformer.moe import ROUTERS, MoEAux, MoEConfig, ParallelMoE

BALANCE_MODES = ("aux", "bias")


def check_moe(cfg) -> None:
    """The ``--moe-*`` flags of a ``GPTConfig``: one line naming the numbers."""
    if cfg.moe_experts < 0:
        raise ValueError(f"--moe-experts {cfg.moe_experts} must be >= 0 (0: dense MLP blocks)")
    if not cfg.moe_experts:
        return
    if not 1 <= cfg.moe_top_k <= cfg.moe_experts:
        raise ValueError(f"--moe-top-k {cfg.moe_top_k} must be between 1 and --moe-experts "
                         f"{cfg.moe_experts}")
    if cfg.moe_router not in ROUTERS:
        raise ValueError(f"--moe-router {cfg.moe_router}: expected one of {', '.join(ROUTERS)}")
    if cfg.moe_balance not in BALANCE_MODES:
        raise ValueError(f"--moe-balance {cfg.moe_balance}: expected "
                         f"{' or '.join(BALANCE_MODES)}")
    if cfg.moe_balance == "bias" and cfg.moe_router != "sigmoid":
        raise ValueError("--moe-balance bias moves the sigmoid router's selection bias: add "
                         "--moe-router sigmoid")
    for flag in ("moe_shared_experts", "moe_aux_coef", "moe_z_coef", "moe_bias_rate"):
        if not getattr(cfg, flag) >= 0:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(cfg, flag)} must be >= 0")


def moe_config(cfg) -> MoEConfig:
    """The core layer's config of a ``GPTConfig`` with experts."""
    return MoEConfig(dim=cfg.dim, hidden_dim=cfg.hidden_dim, num_experts=cfg.moe_experts,
                     top_k=cfg.moe_top_k, router=cfg.moe_router,
                     shared_hidden_dim=cfg.moe_shared_experts * cfg.hidden_dim)


def recomputing() -> bool:
    """Whether this forward runs inside a backward (activation recomputation's replay)."""
    return torch._C._current_graph_task_id() != -1


class _AttachAux(torch.autograd.Function):
    """forward: y itself; backward: y's gradient, and 1 for the (already weighted) aux loss."""

    @staticmethod
    def forward(ctx, y, aux):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=torch.float32, device=grad.device)


class GPTMoE(ParallelMoE):
    """A block's MoE feed-forward: returns the output alone, its aux loss attached to it.

    experts: the EP, statistics and expert-data groups (``mesh/experts.py``); None: the
    experts split over the TP group, the statistics over it (a model that generates)."""

    # the sigmoid router's selection bias (loss-free balancing moves it): in checkpoints,
    # whole, as the router's weight (checkpoint/format.py)
    checkpointed_buffers = ("router.selection_bias",)

    def __init__(self, cfg, sequence_parallel: bool, group, experts: ExpertGroups | None,
                 device=None):
        ep = group if experts is None else experts.ep
        stats = group if experts is None else experts.stats
        super().__init__(moe_config(cfg), group, ep, stats, sequence_parallel, device=device)
        start, stop = self.expert_range
        whole = stop - start == cfg.moe_experts
        for p in (self.experts.gate_up_proj, self.experts.down_proj):
            p.tp_shard = REPLICATED if whole else ShardSpec(0, start, stop, cfg.moe_experts)
        self.balance_coef, self.z_coef = cfg.moe_aux_coef, cfg.moe_z_coef
        self.aux_weight = 1.0  # the trainer's dp / passes
        self.records: list[MoEAux] = []  # this step's passes, detached

    def materialize(self, device=None) -> None:
        """The buffers of a model built on the meta device (the selection bias at zero)."""
        if self.config.router == "sigmoid":
            self.router.selection_bias = torch.zeros(self.config.num_experts,
                                                     device=device or "cpu")

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        y, aux = super().forward(x, seq_len)
        if not (self.training and torch.is_grad_enabled()):
            return y
        if not recomputing():
            self.records.append(MoEAux(aux.balance_loss.detach(), aux.z_loss.detach(),
                                       aux.expert_load))
        loss = aux.loss(self.balance_coef, self.z_coef)
        if loss.requires_grad and (self.balance_coef or self.z_coef):
            y = _AttachAux.apply(y, loss * self.aux_weight)
        return y

    def take_records(self) -> list[MoEAux]:
        records, self.records = self.records, []
        return records

    @torch.no_grad()
    def move_bias(self, load: torch.Tensor, rate: float) -> None:
        """Loss-free balancing: the selection bias moved by ``rate x sign(mean - load)``."""
        self.router.selection_bias += rate * torch.sign(load.mean() - load).to(
            self.router.selection_bias)


def moe_layers(model: torch.nn.Module) -> dict[int, GPTMoE]:
    """The model's MoE feed-forwards by block index (a pipeline rank's blocks only)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, GPTMoE):
            found[int(name.split("blocks.")[-1].split(".")[0])] = module
    return found
