"""The groups a MoE layer runs on, as one value: what the GPT's MoE blocks and ``parallelize``
take, built for ``--ep`` by ``mesh/experts.py``."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class ExpertGroups:
    """One rank's expert-parallel layout.

    ep: the ranks the routed experts are split across. stats: the ranks whose tokens make one
    pass of the router statistics: those holding different tokens (a stage's dp x tp ranks for
    the GPT, whose MoE layers route a TP rank's share; the dp ranks for a Hugging Face model,
    whose TP ranks each route all of their group's tokens; under context parallelism the CP
    ranks too). expert_data: the ranks holding the
    same experts as this one (None: only this one), whose gradients are summed. dp: the
    number of data replicas each rank's loss is scaled by (dp, or dp x cp under context
    parallelism). ep_size: the size of ``ep``.
    """

    ep: ProcessGroup | None
    stats: ProcessGroup | None
    expert_data: ProcessGroup | None
    dp: int = 1
    ep_size: int = 1
