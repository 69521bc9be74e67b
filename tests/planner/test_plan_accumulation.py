"""The planner under gradient accumulation (``--micro-batch-size``), against the peak the trainer
measures: the passes before the last leave the step's gradients held through its backward
(unsharded under FSDP2, in ``param.grad`` without data parallelism and under DDP), which one
pass's plan alone would miss by about one copy of the gradients."""

import pytest

from tensorpar.gpt.model import GPTConfig
from tensorpar.planner.expected import RankPlace, plan_run
from tensorpar.planner.step import Step
from tensorpar.train.config import TrainConfig
from tensorpar.train.gpt_recipe import GPTRecipe
from tensorpar.train.loop import train_model_rank

STEPS = 3
MODEL = GPTConfig(vocab_size=256, n_layer=2, dim=64, n_head=4, n_kv_head=2, hidden_dim=176)


def _cfg(out, micro, **flags) -> TrainConfig:
    return TrainConfig(steps=STEPS, batch_size=8, micro_batch_size=micro, seq_len=64,
                       warmup_steps=1, out=str(out), save_every=STEPS, seed=3, **flags)


def _sizes(out, micro, flags):
    """This rank's run; every rank's sizes and measured peaks (the lead's gathered list)."""
    return train_model_rank(_cfg(out, micro, **flags), GPTRecipe(MODEL), None)["sizes"]


def _check(sizes, cfg):
    step = Step.from_train_config(cfg, GPTRecipe(MODEL).shape())
    plan = plan_run(step, [RankPlace(s.get("tp_rank", r), s.get("dp_rank", 0))
                           for r, s in enumerate(sizes)])
    for r, (s, planned) in enumerate(zip(sizes, plan.peaks, strict=True)):
        planned += s.get("data_bytes", 0)
        assert planned == pytest.approx(s["peak_memory"], rel=0.05), \
            (r, cfg.micro_batch_size, planned / s["peak_memory"] - 1)


@pytest.mark.parametrize("micro", [1, 2])
def test_accumulation_planned_within_5_percent(ranks, tmp_path, micro):
    """TP=2, 8 sequences in passes of 1 and 2: each rank's planned peak within 5% of the
    measured (measured, torch 2.13 CPU: +0.8% and +1.3% on the default GPT; -12.8% and -11.1%
    before the held gradients were counted)."""
    sizes = ranks(2).run(_sizes, tmp_path, micro, {"tp": 2})[0]
    _check(sizes, _cfg(tmp_path, micro, tp=2))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_accumulation_under_dp_planned_within_5_percent(ranks, tmp_path, mode):
    """TP=2 x DP=2, passes of 2: FSDP2's unsharded accumulated gradients, DDP's in param.grad
    beside its buckets, within 5% of the measured peak on every rank."""
    sizes = ranks(4).run(_sizes, tmp_path, 2, {"tp": 2, "dp": 2, "dp_mode": mode})[0]
    _check(sizes, _cfg(tmp_path, 2, tp=2, dp=2, dp_mode=mode))
