"""The trainer's side of a Mixture-of-Experts model (``--moe-experts``, ``--ep``): the expert
groups of the layout (``mesh/experts.py``), each pass's auxiliary-loss weight, the expert
gradients' reduction, loss-free balancing and the step's MoE metrics.

A step's objective is the cross-entropy (the mean over the step's target tokens) plus, for each
MoE layer, the mean over the step's passes of ``--moe-aux-coef x balance + --moe-z-coef x z``,
each pass's statistics over the pass's tokens on every rank of the stage. So each pass weighs
1 / passes; each rank's share is weighted by dp more, since data parallelism averages the
gradients over dp while each rank holds only its tokens' part of the sum. ``metrics.jsonl``
gets ``aux_loss`` (that sum over the layers, the mean over passes) and ``expert_load``: for
each MoE layer [fewest, most] tokens routed to one expert in the step (every rank's tokens).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tensorpar.gpt.moe_blocks import moe_layers
from tensorpar.mesh.experts import expert_groups
from tensorpar.runtime.groups import tp_size
from tensorpar.train.config import passes
from tensorpar.transformer.expert_groups import ExpertGroups


class MoETraining:
    """One rank's MoE bookkeeping for a run (None of it for a dense model: ``setup``)."""

    def __init__(self, cfg, model_cfg, groups: ExpertGroups):
        self.cfg, self.model_cfg, self.groups = cfg, model_cfg, groups
        self.layers: dict = {}
        self.pp_group = None

    @classmethod
    def setup(cls, cfg, recipe, mesh, run_group) -> MoETraining | None:
        """The run's MoE side (collective: builds the expert groups), or None: a dense model."""
        model_cfg = getattr(recipe, "model_cfg", None)
        if not getattr(model_cfg, "moe_experts", 0):
            return None
        groups = expert_groups(cfg.ep, cfg.tp, cfg.dp or 1, mesh, run_group)
        return cls(cfg, model_cfg, groups)

    def attach(self, net: torch.nn.Module, pp_group=None) -> None:
        """Find the model's MoE layers and give each its aux-loss weight, dp / passes."""
        self.layers, self.pp_group = moe_layers(net), pp_group
        weight = (self.cfg.dp or 1) / passes(self.cfg)
        for layer in self.layers.values():
            layer.aux_weight = weight

    def counted(self) -> dict:
        """The groups whose collectives the measured step counts: "ep" (the all-to-alls),
        "stats" (the router statistics' all-reduce)."""
        g = self.groups
        return ({"ep": g.ep} if g.ep_size > 1 else {}) | \
            ({"stats": g.stats} if tp_size(g.stats) > 1 else {})

    @torch.no_grad()
    def end_step(self, finite: bool) -> dict:
        """The step's metrics (the same on every rank), the records cleared; after a finite
        step with ``--moe-balance bias``, each layer's selection bias moved by its loads."""
        c, L = self.model_cfg, self.model_cfg.n_layer
        E = c.moe_experts
        # per block: [aux term, loads (E)]; zeros for blocks another pipeline rank holds
        table = torch.zeros(L, 1 + E, dtype=torch.float64)
        for i, layer in self.layers.items():
            records = layer.take_records()
            if not records:
                continue
            load = sum(r.expert_load.double().cpu() for r in records)
            aux = sum(float(r.loss(c.moe_aux_coef, c.moe_z_coef)) for r in records)
            table[i, 0], table[i, 1:] = aux / len(records), load
            if finite and c.moe_balance == "bias":
                layer.move_bias(load.to(layer.router.selection_bias.device), c.moe_bias_rate)
        if self.pp_group is not None and tp_size(self.pp_group) > 1:
            device = next(iter(self.layers.values())).router.weight.device if self.layers \
                else torch.device("cpu")
            moved = table.to(device)
            dist.all_reduce(moved, group=self.pp_group)
            table = moved.cpu()
        return {"aux_loss": float(table[:, 0].sum()),
                "expert_load": [[int(row[1:].min()), int(row[1:].max())] for row in table]}
