"""Parallel folding: the expert-parallel ranks of an MoE model are taken from the dp x tp ranks
of a pipeline stage (Megatron-core's name for it), so attention keeps its TP and DP while the
routed experts are split over ``ep`` ranks as ``torch.tensor_split`` splits them (6 experts
over 4 ranks: 2, 2, 1, 1).

``check_expert_parallel`` is the rule, in one place for the trainer, the planner and ``verify``.
"""

from __future__ import annotations


def check_expert_parallel(ep: int, tp: int, dp: int, experts: int | None) -> None:
    """ValueError, naming ``--ep`` and the numbers, unless ``ep`` ranks fold into the
    ``dp`` x ``tp`` ranks of a stage (``ep`` divides dp·tp) and every EP rank holds at least one
    of the ``experts`` routed experts (None: a dense model, which takes only ``ep`` 1)."""
    if ep < 1:
        raise ValueError(f"--ep {ep} must be >= 1")
    if ep == 1:
        return
    if experts is None:
        raise ValueError(f"--ep {ep}: the model has no experts; expert parallelism needs an "
                         "MoE model")
    if (dp * tp) % ep:
        raise ValueError(f"--ep {ep} does not divide the dp x tp = {dp} x {tp} = {dp * tp} "
                         "ranks of a stage it borrows its ranks from")
    if ep > experts:
        raise ValueError(f"--ep {ep} is more than the {experts} routed experts: every EP rank "
                         "needs at least one")
