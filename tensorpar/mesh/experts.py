"""Expert parallelism folded into the layout: the groups a MoE layer runs on, as one value.

``--ep N`` takes its ranks from the dp x tp ranks of a pipeline stage, consecutive in (dp, tp)
row-major order (rank index i = d * tp + t within the stage)::

    stage of dp 2 x tp 2, --ep 4      ep groups     [0 1 2 3]       (a TP group inside one)
                                      expert-data   [0] [1] [2] [3] (each expert held once)
    stage of dp 2 x tp 2, --ep 2      ep groups     [0 1] [2 3]     (= the TP groups)
                                      expert-data   [0 2] [1 3]     (the same experts)
    stage of dp 2 x tp 1, --ep 2      ep groups     [0 1]           (across the dp ranks)

So a TP group is inside one EP group (``--ep`` a multiple of ``--tp``), or at ``--ep 1`` each of
its ranks is in another (the experts then replicated, their gradients summed over TP by the layer
and over dp like every dense weight). Attention, embeddings and norms keep their TP and DP.

Under context parallelism (``--cp``) the CP ranks hold different tokens, as the dp ranks do: a
stage's ranks are then its dp x cp x tp ranks in (dp, cp, tp) row-major order, and everything
above reads "dp x cp" for "dp" (an EP group may span CP ranks; the expert-data ranks and the
router statistics cover them).

Above ``--ep 1`` the routed experts are held once across the EP group and replicated over the
"expert-data" ranks (dp x tp / ep of them, the same expert range each): FSDP2 and DDP leave them
out (``ignored``), and :func:`reduce_expert_grads` sums their gradients over the expert-data
ranks once a step, divided by dp (x cp: each rank's loss is scaled by that, as the gradients'
average over the replicas expects). The router statistics of a pass count every token of the stage
(``stats``: all its dp x tp ranks), so any layout equals one rank taking the same passes.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.mesh.mesh import cp_size
from tensorpar.parallel.sharding import check_expert_parallel, is_expert_split
from tensorpar.transformer.expert_groups import ExpertGroups


def stage_ranks(mesh, run_group: ProcessGroup | None) -> list[list[int]]:
    """Each pipeline stage's ranks in (dp, cp, tp) row-major order (one list without a
    pipeline), the dims found by the mesh's names: one list per index of "pp"."""
    if mesh is None:
        return [dist.get_process_group_ranks(run_group or dist.group.WORLD)
                if dist.is_initialized() else [0]]
    names = list(mesh.mesh_dim_names)
    inner = [n for n in ("dp", "cp", "tp") if n in names]
    outer = [n for n in names if n not in inner]
    grid = mesh.mesh.permute(*(names.index(n) for n in outer + inner))  # (..outer, dp, tp)
    width = math.prod(mesh.mesh.shape[names.index(n)] for n in inner)
    return grid.reshape(-1, width).tolist()


def expert_groups(ep: int, tp: int, dp: int, mesh=None,
                  run_group: ProcessGroup | None = None) -> ExpertGroups:
    """This rank's ``ExpertGroups`` for ``--ep ep`` (collective: every rank creates every group,
    in the same order, as ``new_group`` requires); with a "cp" dim in ``mesh`` the CP ranks count
    as data replicas (``ExpertGroups.dp`` is then dp x cp)."""
    cp = cp_size(mesh)
    check_expert_parallel(ep, tp, dp, None, cp)  # the experts: the recipe checks them
    if not dist.is_initialized():
        return ExpertGroups(None, None, None, dp * cp, ep)
    me = dist.get_rank()
    stages = stage_ranks(mesh, run_group)

    def mine(lists: list[list[int]]) -> ProcessGroup | None:
        found = None
        for ranks in lists:
            group = dist.new_group(ranks)
            if me in ranks:
                found = group
        return found

    stats = mine(stages)
    ep_lists = [s[i:i + ep] for s in stages for i in range(0, len(s), ep)]
    ep_group = mine(ep_lists)
    width = len(stages[0]) // ep
    data_lists = [s[j::ep] for s in stages for j in range(ep)] if width > 1 else []
    expert_data = mine(data_lists) if data_lists else None
    return ExpertGroups(ep_group, stats, expert_data, dp * cp, ep)


def split_expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if is_expert_split(p)]


@torch.no_grad()
def reduce_expert_grads(model: nn.Module, groups: ExpertGroups | None) -> None:
    """The step's expert gradients: summed over the expert-data ranks, divided by dp."""
    if groups is None or groups.ep_size == 1:
        return
    for p in split_expert_params(model):
        if p.grad is None:
            continue
        if groups.expert_data is not None:
            dist.all_reduce(p.grad, group=groups.expert_data)
        if groups.dp > 1:
            p.grad.div_(groups.dp)


def ignore_experts_in_ddp(module: nn.Module) -> None:
    """Leave ``module``'s split experts out of the DDP wrapper made next (their gradients are
    reduced over the expert-data ranks instead; their shapes may differ between ranks)."""
    from torch.nn.parallel import DistributedDataParallel

    names = [name for name, p in module.named_parameters() if is_expert_split(p)]
    if names:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
