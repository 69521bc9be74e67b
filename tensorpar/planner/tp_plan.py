"""The plan of one model at a TP size: one row of ``tensorpar plan`` (``plan_memory``), its
weights, gradients, optimizer states and activations (``memory.tensorpar_memory``) under data
parallelism (``data_parallel.dp_memory``), the step's peak and whether it fits a device; and
``step_memory``, one rank's step in a precision, from which ``pipeline.py`` plans its stages."""

from __future__ import annotations

from tensorpar.parallel.context import check_cp_split
from tensorpar.parallel.sharding import check_expert_parallel
from tensorpar.planner.activations import paper_activations
from tensorpar.planner.data_parallel import check_dp, dp_memory
from tensorpar.planner.memory import DTYPES, RECOMPUTE, rank_params, tensorpar_memory
from tensorpar.planner.step import BlockBudget, Budget, Step
from tensorpar.transformer.attention import head_shards


def check_step(step: Step) -> None:
    """ValueError, naming the flag and the numbers, for a step the planner cannot describe."""
    if step.dtype not in DTYPES:
        raise ValueError(f"dtype {step.dtype!r}: expected one of {', '.join(DTYPES)}")
    if step.recompute not in RECOMPUTE:
        raise ValueError(f"recompute {step.recompute!r}: expected one of {', '.join(RECOMPUTE)}")
    check_dp(step.dp, step.dp_mode)
    check_expert_parallel(step.ep, step.tp, step.dp, 0 if step.shape.moe is None
                          else step.shape.moe.experts, step.cp)
    if step.batch % step.dp:
        raise ValueError(f"--batch {step.batch} does not split over --dp {step.dp}: each copy "
                         "takes batch/dp sequences")
    check_cp_split(step.seq, step.cp, "--cp")


def check_shape(step: Step) -> None:
    """ValueError for a TP size the heads refuse, or sequence parallelism with fewer tokens
    than ranks."""
    head_shards(step.shape.n_head, step.shape.n_kv_head, step.tp, 0)
    if step.sequence_parallel and step.seq < step.tp:
        raise ValueError(f"--seq {step.seq} is shorter than --tp {step.tp}: sequence "
                         "parallelism needs at least one token per rank")


def plan_memory(step: Step, device_memory: float | None = None, reserve: float = 0.10) -> dict:
    """One row of ``tensorpar plan``: per-rank bytes by component, the total and whether it fits
    ``device_memory`` less ``reserve``; the step's batch in one pass per copy (its
    micro-batches are ``pipeline.plan_pipeline``'s).

    ``step.optimizer``: AdamW's implementation (``ADAMW``; tensorpar's trainer uses "fused").
    ``step.device``: "cpu" or "cuda", the kernels whose saved tensors differ
    (``tensorpar_memory``). Weights, gradients and optimizer states follow ``step.dtype``
    (``memory``'s docstring). "activations" is what tensorpar's GPT keeps for backward at the
    end of forward, "activations_paper" the Korthikanti et al. formula for comparison. "total"
    is the step's peak: weights + optimizer states + the largest moment ("peak_bytes" at
    "peak_at": the activations and the loss backward's temporaries, a block's backward, or the
    gradients and the optimizer's temporaries). ``step.dp``, ``step.dp_mode``: data
    parallelism by FSDP2 ("fsdp") or DDP ("ddp") (``data_parallel.dp_memory``); the batch is
    the step's, each copy takes batch/dp sequences; "dp_buffers" is DDP's buckets or FSDP2's
    gathered weights and gradient buffers at the peak.
    """
    check_step(step)
    check_shape(step)
    step = step.replace(micro_batches=1)
    # gradients are allocated during backward and freed after the step, activations freed
    # during backward: they never peak together, so the total is weights + optimizer states +
    # the largest moment of the step (loss backward, a block's backward, the optimizer step)
    mem = dp_memory(step, step_memory(step))
    dp = step.dp
    row = {"model": step.shape.name, "tp": step.tp, "cp": step.cp, "dp": dp,
           "dp_mode": step.dp_mode if step.dp_ranks > 1 else None, "dtype": step.dtype,
           "sequence_parallel": step.sequence_parallel, "recompute": step.recompute,
           "batch": step.batch, "seq": step.seq, "device": step.device,
           "params_per_rank": rank_params(step.shape, step.tp, 0, step.ep)["total"],
           "weights": mem.weights, "grads": mem.grads, "optimizer": mem.optimizer,
           "activations": mem.activations, "dp_buffers": mem.dp_buffers,
           "peak_bytes": mem.peak_extra, "peak_at": mem.peak_at,
           # under CP every term is a rank's tokens' share (its queries' scores against all
           # keys too): the formula over cp
           "activations_paper": round(paper_activations(step.shape, step.tp, step.batch // dp,
                                                        step.seq, step.sequence_parallel,
                                                        step.recompute) / step.cp),
           "total": mem.total}
    if step.shape.moe is not None:
        row["ep"] = step.ep
    if device_memory is not None:
        row["usable"] = round(device_memory * (1 - reserve))
        row["fits"] = row["total"] <= row["usable"]
    return row


def step_memory(step: Step) -> Budget:
    """TP rank 0's step of one pass (``step.micro`` sequences) without data parallelism, as
    ``memory.tensorpar_memory`` returns it, in ``step.dtype`` (``DTYPES``): "bf16" is
    Megatron-style mixed precision, made from tensorpar's autocast numbers (below);
    "recompute" "selective" is "none" (no s x s scores are kept anyway). ``plan_memory`` adds
    data parallelism and makes the row; ``pipeline.py`` reads a stage's pieces from it."""
    mem = tensorpar_memory(step.replace(
        dtype="fp32" if step.dtype == "fp32" else "bf16-autocast",
        recompute="full" if step.recompute == "full" else "none"))
    if step.dtype != "bf16":
        return mem
    params = rank_params(step.shape, step.tp, 0, step.ep)
    p = params["total"]
    # Megatron-style: bf16 weights and grads, fp32 master weights and moments. The same
    # moments as tensorpar's autocast, less the bf16 weight copies each of them holds (the
    # bf16 weights replace them) and with half-size gradients at the optimizer step. An
    # estimate: the activations are autocast's (fp32 residual stream and norms), a little
    # above a fully bf16 model's.
    peaks = {k: v - mem.copies[k] for k, v in mem.peaks.items()}
    peaks["optimizer step"] += 2 * p - mem.grads
    b, c = mem.blocks, mem.block_copies
    blocks = BlockBudget(b.between - c.between, b.inside - c.inside, b.kept - c.kept)
    return mem.replace(dtype="bf16", weights=2 * p, grads=2 * p,
                       optimizer=12 * p + 4 * params["tensors"],
                       activations=mem.activations - mem.copies["activations"], peaks=peaks,
                       blocks=blocks)
