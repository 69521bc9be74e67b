"""How a model's blocks are cut into pipeline stages, and what a pipeline layout may be.

The same arithmetic over layers as ``sharding.py`` over widths: L blocks over S = pp · v stages
(v = ``--pp-virtual`` stages per pipeline rank) are cut as ``torch.tensor_split`` cuts L
(consecutive, sizes differing by at most one, the larger first), and stage s runs on pipeline
rank s % pp (torch's loop placement for interleaved schedules)::

    L = 5, pp = 2, v = 1    stage 0: blocks 0-2 (rank 0)   stage 1: blocks 3-4 (rank 1)
    L = 8, pp = 2, v = 2    stage 0: 0-1 (rank 0)  1: 2-3 (rank 1)  2: 4-5 (rank 0)  3: 6-7 (rank 1)

``check_pipeline`` is the one place that says which layouts torch's schedules take: the trainer,
the planner, ``verify --pp`` and the GPT's split call it, so their messages agree. It names the
trainer's flags; a step's micro-batches are its gradient accumulation passes, (--batch-size /
--dp) / --micro-batch-size.
"""

from __future__ import annotations

from tensorpar.parallel.sharding import shard_range

MICRO_BATCHES = "micro-batches = --batch-size / --dp / --micro-batch-size"


def stage_blocks(n_layer: int, stages: int) -> list[range]:
    """The blocks of each of ``stages`` stages: consecutive, as ``torch.tensor_split`` cuts
    ``n_layer`` (sizes differ by at most one, the larger first)."""
    return [range(*shard_range(n_layer, stages, s)) for s in range(stages)]


def rank_stages(pp: int, virtual: int, rank: int) -> list[int]:
    """The stages pipeline rank ``rank`` runs: rank, rank + pp, ... (torch's loop placement)."""
    return [rank + k * pp for k in range(virtual)]


def check_pipeline(pp: int, virtual: int, n_layer: int, micro_batches: int | None = None) -> None:
    """ValueError, naming the flags and numbers, for a pipeline torch's schedules refuse: ``pp``
    ranks of ``virtual`` stages each over ``n_layer`` blocks, ``micro_batches`` a step (None:
    the split alone). Before any rank starts."""
    if pp < 1 or virtual < 1:
        raise ValueError(f"--pp {pp} and --pp-virtual {virtual} must be >= 1")
    if micro_batches is not None and micro_batches < 1:
        raise ValueError(f"{micro_batches} micro-batches per step: there must be at least one "
                         f"({MICRO_BATCHES})")
    if pp == 1:
        if virtual > 1:
            raise ValueError(f"--pp-virtual {virtual} interleaves pipeline stages: give --pp")
        return
    if pp * virtual > n_layer:
        raise ValueError(f"--n-layer {n_layer} cannot be cut into {pp * virtual} pipeline "
                         f"stages (--pp {pp} x --pp-virtual {virtual}): each stage needs a block")
    if micro_batches is None:
        return
    if micro_batches < pp:
        raise ValueError(f"--pp {pp} needs at least {pp} micro-batches per step to keep every "
                         f"stage busy (1F1B), but the step has {micro_batches}: lower "
                         f"--micro-batch-size ({MICRO_BATCHES})")
    rounds = max(1, micro_batches // pp)
    if virtual > 1 and micro_batches % rounds:
        raise ValueError(f"--pp-virtual {virtual}: the interleaved schedule runs the "
                         f"{micro_batches} micro-batches in {rounds} rounds; make them a "
                         f"multiple of --pp {pp} ({MICRO_BATCHES})")


def mark_stage_copy(p) -> None:
    """Mark ``p`` as a pipeline stage's copy of a parameter another stage holds too (the last
    stage's copy of a tied embedding table, its head): the other stage's is the one the gradient
    norm counts and a checkpoint saves; the trainer keeps both equal (their gradients summed
    over the embedding group before the optimizer steps). FSDP2 replaces parameters: mark
    again after it."""
    p.stage_copy = True


def is_stage_copy(p) -> bool:
    """Whether ``p`` is a stage's copy of a parameter another stage holds (``mark_stage_copy``)."""
    return getattr(p, "stage_copy", False)
