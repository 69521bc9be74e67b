"""What a training run's summary compares its measurements with, planned in one call
(``plan_run``): each rank's peak tensor memory, and one step's TP collectives, dp collectives
and pipeline transfers, as the planner counts them for the ``Step`` the run took
(``Step.from_train_config``)."""

from __future__ import annotations

from dataclasses import dataclass

from tensorpar.parallel.stages import rank_stages, stage_blocks
from tensorpar.planner.comm import lora_sites, predicted_comm
from tensorpar.planner.data_parallel import dp_comm, dp_memory
from tensorpar.planner.memory import tensorpar_memory
from tensorpar.planner.pipeline import (
    add_transfers,
    plan_pipeline,
    rank_dp_comm,
    rank_tp_comm,
    step_transfers,
    tied_sync,
)
from tensorpar.planner.step import Step


@dataclass(frozen=True)
class RankPlace:
    """Where a rank sits in the layout."""

    tp_rank: int = 0
    dp_rank: int = 0
    pp_rank: int = 0


@dataclass(frozen=True)
class RunPlan:
    """The planner's numbers for a run: "peaks" (bytes, one per rank asked for, in order),
    "tp_comm" (rank 0's TP collectives of a step, ``comm.predicted_comm``; with pipeline stages
    those of rank 0's, ``pipeline.rank_tp_comm``), "dp_comm" (TP rank 0's dp collectives,
    ``data_parallel.dp_comm``; with pipeline stages ``pipeline.rank_dp_comm``) and "pp"
    (pipeline rank 0's sends, receives and all-reduces over the pipeline,
    ``pipeline.step_transfers``, and a tied table's gradient sum, ``pipeline.tied_sync``)."""

    peaks: list[int]
    tp_comm: dict
    dp_comm: dict
    pp: dict


def plan_run(step: Step, places: list[RankPlace]) -> RunPlan:
    """The planner's numbers for the ranks at ``places`` of a run of ``step``: with pipeline
    stages each pipeline rank's peak (``plan_pipeline``); without, ``tensorpar_memory`` of one
    pass (LoRA's adapters counted) under data parallelism (``dp_memory``)."""
    if step.pp > 1:
        stages = plan_pipeline(step)["stages"]
        peaks = [stages[p.pp_rank]["total"] for p in places]
    else:
        peaks = [dp_memory(step, tensorpar_memory(step, p.tp_rank), p.tp_rank, p.dp_rank).total
                 for p in places]
    if step.pp > 1:  # pipeline rank 0: its stages' blocks and the embedding
        ranges = stage_blocks(step.shape.n_layer, step.pp * step.virtual)
        layers = sum(len(ranges[s]) for s in rank_stages(step.pp, step.virtual, 0))
        tp_comm = rank_tp_comm(step, layers, True, False)
        dp = rank_dp_comm(step, layers, True, False)
    else:
        # bf16 under FSDP2: the gathered weights, and so the activations, travel in bf16
        bf16_params = step.autocast and step.fsdp
        # LoRA: transformers' checkpointing makes the embedding's output take a gradient
        lora = None if step.lora is None else lora_sites(
            step.shape, step.lora.rank, step.lora.targets, step.lora.dropout > 0,
            input_grad=step.recompute == "full")
        tp_comm = predicted_comm(
            step.shape, step.micro, step.seq, step.tp, step.sequence_parallel,
            "fp32" if step.dtype == "fp32" else "bf16", step.recompute,
            passes=step.micro_batches, bf16_params=bf16_params, lora=lora)
        dp = dp_comm(step.shape, step.tp, step.dp, step.dp_mode, rank=0,
                     passes=step.micro_batches, bf16_params=bf16_params)
    pp = step_transfers(step.pp, step.virtual, step.micro_batches, 0, step.micro, step.seq,
                        step.shape.dim, step.tp, step.sequence_parallel)
    return RunPlan(peaks, tp_comm, dp, add_transfers(pp, tied_sync(step, 0)))
