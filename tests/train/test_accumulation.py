"""Gradient accumulation (``--micro-batch-size``): a step run as several forward and backward
passes equals the same step run as one pass, to fp32 rounding: the losses, the gradient norms
and the weights after several steps, at TP 1, 2 and 4, with sequence parallelism, with
recompute, under FSDP2 and DDP (the gradients reduced over dp once a step), and for a loss with
ignored targets (the mean over the step's tokens, not a mean of per-pass means)."""

import pytest
import torch
from safetensors.torch import load_file

from tensorpar.checkpoint.export import export_dense
from tensorpar.checkpoint.format import find_checkpoint
from tensorpar.data.packing import TokenBatches
from tensorpar.data.text import load_text
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.planner.comm import predicted_comm
from tensorpar.planner.data_parallel import dp_comm
from tensorpar.train.config import TrainConfig, passes
from tensorpar.train.gpt_recipe import GPTRecipe
from tensorpar.train.loop import train_model_rank

MODEL = GPTConfig(n_layer=2, dim=32, n_head=4, n_kv_head=2, hidden_dim=64)
STEPS, BATCH = 6, 8
# relative; measured at most 1.8e-7 (losses), 1.6e-7 (gradient norms) and 1.8e-6 (weights,
# with ignored targets; 4e-7 without) over these cases
TOL = 2e-6  # the losses and the gradient norms
WEIGHT_TOL = 1e-5  # ||a - b|| / ||b|| of every weight tensor after the 6 steps


def ignored(targets: torch.Tensor) -> torch.Tensor:
    """The targets with those whose byte is a multiple of 3 ignored (-100): a third of them,
    unevenly over the passes, as prompt masking and padding leave a real batch."""
    return torch.where(targets % 3 == 0, -100, targets)


def _train(out, micro, recipe, ignoring=False, **flags):
    """A run on this rank; ``ignoring``: its batches' targets pass through ``ignored``."""
    cfg = TrainConfig(steps=STEPS, batch_size=BATCH, micro_batch_size=micro, seq_len=32,
                      warmup_steps=2, out=str(out), save_every=STEPS, seed=3, **flags)
    batch = TokenBatches.batch
    if ignoring:
        TokenBatches.batch = lambda self, step: (lambda x, y: (x, ignored(y)))(*batch(self, step))
    try:
        result = train_model_rank(cfg, recipe, None)
    finally:
        TokenBatches.batch = batch
    return result.get("rows"), result["comm"]


def _weights(run) -> dict[str, torch.Tensor]:
    return load_file(export_dense(find_checkpoint(run), run / "dense.safetensors"))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * abs(b)


def _same_step(whole, accumulated, what):
    assert [r["step"] for r in whole] == [r["step"] for r in accumulated] == \
        list(range(1, STEPS + 1)), what
    for a, b in zip(accumulated, whole, strict=True):
        for key in ("loss", "grad_norm"):
            assert _close(a[key], b[key]), f"{what}: step {a['step']} {key} {a[key]} vs {b[key]}"


def _same_weights(run_a, run_b, what):
    """Every weight tensor within TOL of the other run's, as ||a - b|| / ||b||. (Elementwise, a
    weight whose gradient is near zero moves by AdamW's lr * g / (|g| + eps), where a rounding
    difference in g shows at 1e-5 of the tensor's largest element after 6 steps.)"""
    a, b = _weights(run_a), _weights(run_b)
    assert a.keys() == b.keys()
    for name in a:
        err = ((a[name] - b[name]).norm() / b[name].norm()).item()
        assert err <= WEIGHT_TOL, f"{what}: {name} differs by {err:.2e} (relative)"


CASES = {  # (ranks, flags, micro)
    "tp1": (1, {"tp": 1}, 2),
    "tp2": (2, {"tp": 2}, 2),
    "tp4": (4, {"tp": 4}, 4),
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}, 2),
    "tp2-recompute": (2, {"tp": 2, "recompute": True}, 1),
    "tp2-dp2-fsdp": (4, {"tp": 2, "dp": 2, "dp_mode": "fsdp"}, 2),
    "tp2-dp2-ddp": (4, {"tp": 2, "dp": 2, "dp_mode": "ddp"}, 2),
    "tp1-dp2-ddp": (2, {"tp": 1, "dp": 2, "dp_mode": "ddp"}, 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_accumulated_step_equals_one_pass(ranks, tmp_path, case):
    """6 AdamW steps of 8 sequences, as one pass and as passes of ``micro`` sequences per dp
    rank: every loss and gradient norm within 2e-6, every final weight within 1e-5 (relative);
    the summary's collectives are a whole step's, the planner's count with the passes."""
    n, flags, micro = CASES[case]
    pool = ranks(n)
    whole, _ = pool.run(_train, tmp_path / "whole", None, GPTRecipe(MODEL), **flags)[0]
    rows, comm = pool.run(_train, tmp_path / "acc", micro, GPTRecipe(MODEL), **flags)[0]
    _same_step(whole, rows, case)
    _same_weights(tmp_path / "whole", tmp_path / "acc", case)
    cfg = TrainConfig(batch_size=BATCH, micro_batch_size=micro, **flags)
    k, dp = passes(cfg), cfg.dp or 1
    assert k == BATCH // dp // micro > 1
    shape = GPTRecipe(MODEL).shape()
    if cfg.tp > 1:  # TP's collectives: each pass's, the gradient norm's once
        want = predicted_comm(shape, micro, 32, cfg.tp, cfg.sequence_parallel,
                              recompute="full" if cfg.recompute else "none", passes=k)
        assert comm["counts"] == want["counts"] and comm["bytes"] == want["bytes"], case
    if dp > 1:  # dp's: DDP's buckets and FSDP2's reduce-scatters once, FSDP2's gathers a pass
        want = dp_comm(shape, cfg.tp, dp, cfg.dp_mode, rank=0, passes=k)
        assert comm["dp"]["counts"] == want["counts"], (case, comm["dp"], want["counts"])


def _loss_of_passes(micro: int) -> tuple[float, float]:
    """Step 1's loss with ignored targets, at the initial weights: the mean over the batch's
    tokens, and the mean of the per-pass means (what a trainer that averages passes reports)."""
    batches = TokenBatches.from_text(load_text(None)[0], 32, BATCH, 3)
    x, y = batches.batch(0)
    model = GPT(MODEL, seed=3)
    with torch.no_grad():
        whole = model(x, ignored(y)).item()
        parts = [model(x[i:i + micro], ignored(y[i:i + micro])).item()
                 for i in range(0, BATCH, micro)]
    return whole, sum(parts) / len(parts)


@pytest.mark.parametrize("n,flags", [(1, {"tp": 1}), (4, {"tp": 2, "dp": 2, "dp_mode": "fsdp"})])
def test_ignored_targets_mean_over_the_steps_tokens(ranks, tmp_path, n, flags):
    """With a third of the targets ignored, unevenly over the passes: the accumulated run equals
    the one-pass run (losses, norms, weights), and its first loss is the mean over the step's
    tokens, which here differs from a mean of per-pass means by 10 times the tolerance or more
    (5.9e-4 relative)."""
    pool = ranks(n)
    micro = 2
    whole, _ = pool.run(_train, tmp_path / "whole", None, GPTRecipe(MODEL), True, **flags)[0]
    rows, _ = pool.run(_train, tmp_path / "acc", micro, GPTRecipe(MODEL), True, **flags)[0]
    _same_step(whole, rows, f"ignored {flags}")
    _same_weights(tmp_path / "whole", tmp_path / "acc", f"ignored {flags}")
    token_mean, mean_of_means = _loss_of_passes(micro)
    assert _close(rows[0]["loss"], token_mean), (rows[0]["loss"], token_mean)
    assert abs(mean_of_means - token_mean) > 10 * TOL * token_mean, (mean_of_means, token_mean)


def test_micro_batch_that_does_not_divide_is_one_line():
    """--micro-batch-size must divide each dp rank's share of the batch: refused before any rank."""
    with pytest.raises(ValueError, match="--micro-batch-size 3 does not divide the 4 sequences"):
        TrainConfig(tp=1, dp=2, batch_size=8, micro_batch_size=3).check()
