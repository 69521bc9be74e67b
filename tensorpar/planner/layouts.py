"""What a layout needs per rank: one row of ``tensorpar plan`` for a model at (tp, dp), its
weights, gradients, optimizer states and activations (``memory.tensorpar_memory``) under data
parallelism (``data_parallel.dp_memory``), the step's peak and whether it fits a device; and
``step_memory``, one rank's step in a precision, from which ``pipeline.py`` plans its stages."""

from __future__ import annotations

from tensorpar.planner.activations import paper_activations
from tensorpar.planner.data_parallel import check_dp, dp_memory
from tensorpar.planner.memory import DTYPES, RECOMPUTE, rank_params, tensorpar_memory
from tensorpar.planner.shapes import ModelShape
from tensorpar.transformer.attention import head_layout


def check_step(dtype: str, recompute: str, batch: int, dp: int, dp_mode: str) -> None:
    """ValueError, naming the flag and the numbers, for a step the planner cannot describe."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r}: expected one of {', '.join(RECOMPUTE)}")
    check_dp(dp, dp_mode)
    if batch % dp:
        raise ValueError(f"--batch {batch} does not split over --dp {dp}: each copy takes "
                         "batch/dp sequences")


def plan_memory(shape: ModelShape, tp: int, batch: int, seq: int, dtype: str = "bf16",
                sequence_parallel: bool = False, recompute: str = "none",
                device_memory: float | None = None, reserve: float = 0.10,
                optimizer: str = "fused", dropout: bool = False, device: str = "cpu",
                dp: int = 1, dp_mode: str = "fsdp") -> dict:
    """One row of ``tensorpar plan``: per-rank bytes by component, the total and whether it fits.

    optimizer: AdamW's implementation (``ADAMW``; tensorpar's trainer uses "fused"). device:
    "cpu" or "cuda", the kernels whose saved tensors differ (``tensorpar_memory``). Weights,
    gradients and optimizer states follow ``dtype`` (module docstring). "activations" is
    what tensorpar's GPT keeps for backward at the end of forward, "activations_paper" the
    Korthikanti et al. formula for comparison. "total" is the step's peak: weights + optimizer
    states + the largest moment ("peak_bytes" at "peak_at": the activations and the loss
    backward's temporaries, a block's backward, or the gradients and the optimizer's temporaries).
    dp, dp_mode: data parallelism over ``dp`` copies by FSDP2 ("fsdp") or DDP ("ddp")
    (``data_parallel.dp_memory``); ``batch`` is the step's, each copy takes batch/dp sequences;
    "dp_buffers" is DDP's buckets or FSDP2's gathered weights and gradient buffers at the peak.
    """
    check_step(dtype, recompute, batch, dp, dp_mode)
    head_layout(shape.n_head, shape.n_kv_head, tp, 0)  # raises for a TP size the heads refuse
    if sequence_parallel and seq < tp:
        raise ValueError(f"--seq {seq} is shorter than --tp {tp}: sequence parallelism needs at "
                         "least one token per rank")
    mem = step_memory(shape, tp, batch // dp, seq, dtype, sequence_parallel, recompute,
                      optimizer, dropout, device)
    p = rank_params(shape, tp)["total"]
    # gradients are allocated during backward and freed after the step, activations freed
    # during backward: they never peak together, so the total is weights + optimizer states +
    # the largest moment of the step (loss backward, a block's backward, the optimizer step)
    mem = dp_memory(shape, tp, dp, dp_mode, mem, 2 if dtype == "bf16" else 4,
                    12 if dtype == "bf16" else 8, device=device, optimizer=optimizer)
    row = {"model": shape.name, "tp": tp, "dp": dp, "dp_mode": dp_mode if dp > 1 else None,
           "dtype": dtype, "sequence_parallel": sequence_parallel, "recompute": recompute,
           "batch": batch, "seq": seq, "device": device, "params_per_rank": p,
           "weights": mem["weights"], "grads": mem["grads"], "optimizer": mem["optimizer"],
           "activations": mem["activations"], "dp_buffers": mem["dp_buffers"],
           "peak_bytes": mem["peak_extra"], "peak_at": mem["peak_at"],
           "activations_paper": paper_activations(shape, tp, batch // dp, seq, sequence_parallel,
                                                  recompute),
           "total": mem["total"]}
    if device_memory is not None:
        row["usable"] = round(device_memory * (1 - reserve))
        row["fits"] = row["total"] <= row["usable"]
    return row


def step_memory(shape: ModelShape, tp: int, batch: int, seq: int, dtype: str = "bf16",
                sequence_parallel: bool = False, recompute: str = "none",
                optimizer: str = "fused", dropout: bool = False, device: str = "cpu") -> dict:
    """One TP rank's step of ``batch`` sequences without data parallelism, as
    ``memory.tensorpar_memory`` returns it, in ``dtype`` (``DTYPES``): "bf16" is Megatron-style
    mixed precision, made from tensorpar's autocast numbers (below); "recompute" "selective" is
    "none" (no s x s scores are kept anyway). ``plan_memory`` adds data parallelism and makes the
    row; ``pipeline.py`` reads a stage's pieces from it."""
    rec = "full" if recompute == "full" else "none"
    mem = tensorpar_memory(shape, tp, batch, seq, sequence_parallel,
                           "fp32" if dtype == "fp32" else "bf16-autocast", rec,
                           optimizer=optimizer, dropout=dropout, device=device)
    params = rank_params(shape, tp)
    p = params["total"]
    if dtype == "bf16":
        # Megatron-style: bf16 weights and grads, fp32 master weights and moments. The same
        # moments as tensorpar's autocast, less the bf16 weight copies each of them holds (the
        # bf16 weights replace them) and with half-size gradients at the optimizer step. An
        # estimate: the activations are autocast's (fp32 residual stream and norms), a little
        # above a fully bf16 model's.
        peaks = {k: v - mem["copies"][k] for k, v in mem["peaks"].items()}
        peaks["optimizer step"] += 2 * p - mem["grads"]
        blocks = mem["blocks"] | {k: mem["blocks"][k] - mem["blocks"]["copies"][k]
                                  for k in ("between", "inside", "kept")}
        mem = mem | {"dtype": "bf16", "weights": 2 * p, "grads": 2 * p,
                     "optimizer": 12 * p + 4 * params["tensors"],
                     "activations": mem["activations"] - mem["copies"]["activations"],
                     "peaks": peaks, "blocks": blocks}
        mem["peak_at"] = max(peaks, key=peaks.get)
        mem["peak_extra"] = peaks[mem["peak_at"]]
        mem["total"] = mem["weights"] + mem["optimizer"] + mem["peak_extra"]
    return mem
