"""The trainer's side of a Mixture-of-Experts model (``--moe-experts``, ``--ep``): the expert
groups of the layout (``mesh/experts.py``), each pass's auxiliary-loss weight, the expert
gradients' reduction, loss-free balancing and the step's MoE metrics.

A step's objective is the cross-entropy (the mean over the step's target tokens) plus, for each
MoE layer, the mean over the step's passes of ``--moe-aux-coef x balance + --moe-z-coef x z``,
each pass's statistics over the pass's tokens on every rank of the stage. So each pass weighs
1 / passes; each rank's share is weighted by dp (x cp) more, since data (and context)
parallelism averages the gradients over those ranks while each holds only its tokens' part of
the sum. ``metrics.jsonl`` gets ``aux_loss`` (that sum over the layers, the mean over passes)
and ``expert_load``: for each MoE layer [fewest, most] tokens routed to one expert in the step
(every rank's tokens). The summary shows both (``moe_rows``), and the measured step's
expert-parallel collectives beside ``planner/moe_comm.py``'s count (calls exactly; bytes as
measured beside the even-routing expectation: routing decides them).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from rich.table import Table

from tensorpar.gpt.moe_blocks import moe_layers
from tensorpar.mesh.experts import expert_groups
from tensorpar.planner.moe_comm import expected_calls, moe_comm
from tensorpar.planner.step import Step
from tensorpar.runtime.groups import tp_size
from tensorpar.runtime.output import human_bytes
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

    def attach(self, net: torch.nn.Module, passes: int, pp_group=None) -> None:
        """Find the model's MoE layers and give each its aux-loss weight, replicas / passes
        (the ranks holding other tokens, dp x cp, over which the step's gradient is averaged;
        the step's forward and backward passes on each rank, ``train/config.py``'s ``passes``)."""
        self.layers, self.pp_group = moe_layers(net), pp_group
        weight = self.groups.dp / passes
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


def moe_rows(table: Table, rows: list[dict], comm: dict, step: Step) -> None:
    """Add the MoE rows (nothing for a dense model or a run without steps)."""
    done = [r for r in rows if r.get("aux_loss") is not None]
    if step.shape.moe is None or not done:
        return
    table.add_row("MoE aux loss (first -> final step)",
                  f"{done[0]['aux_loss']:.5f} -> {done[-1]['aux_loss']:.5f} (the balancing "
                  "and z-losses times their coefficients, summed over the layers)")
    loads = done[-1].get("expert_load") or []
    table.add_row("expert load (final step, tokens)",
                  "; ".join(f"block {i}: {lo}-{hi}" for i, (lo, hi) in enumerate(loads))
                  + " (fewest-most routed to one expert)")
    want = expected_calls(step)
    predicted = moe_comm(step)
    for label, kind in (("ep", "all_to_all"), ("stats", "all_reduce")):
        if not want.get(kind):
            continue
        got = comm.get(label, {})
        calls = got.get("counts", {}).get(kind, 0)
        verdict = "as counted" if calls == want[kind] else f"analytic count {want[kind]}"
        what = "EP all_to_all" if label == "ep" else "router statistics all_reduce"
        table.add_row(f"{what} per step",
                      f"{calls} calls ({verdict}), {human_bytes(got.get('bytes', {}).get(kind, 0))}"
                      f" payload (even routing: {human_bytes(predicted['bytes'].get(kind, 0))})")
