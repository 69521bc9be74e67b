"""``tensorpar plan --config RUN`` and ``RUN/step-N``: a run's folder (as ``generate`` and
``export`` take it) plans the step its run trained, from the settings its checkpoint's manifest
keeps (precision, TP size, batch, sequence, passes), and a flag given explicitly wins."""

import argparse
import json

import pytest

from tensorpar.cli import plan as plan_cli
from tensorpar.gpt.model import GPTConfig
from tensorpar.train.config import TrainConfig
from tensorpar.train.gpt_recipe import GPTRecipe
from tensorpar.train.loop import train_model_rank

MODEL = GPTConfig(vocab_size=256, n_layer=2, dim=32, n_head=2, n_kv_head=2, hidden_dim=64)


def _train(cfg):
    train_model_rank(cfg, GPTRecipe(MODEL), None)


@pytest.fixture(scope="module")
def run(ranks, tmp_path_factory):
    """An fp32 run at TP=2 of 8 sequences of 32 tokens a step, in passes of 2, recomputed."""
    out = tmp_path_factory.mktemp("run") / "gpt"
    cfg = TrainConfig(tp=2, steps=1, batch_size=8, micro_batch_size=2, seq_len=32, dtype="fp32",
                      recompute=True, warmup_steps=1, save_every=1, out=str(out), seed=1)
    ranks(2).run(_train, cfg)
    return out


def _plan_json(capsys, *argv) -> dict:
    ap = argparse.ArgumentParser()
    plan_cli.add_parser(ap.add_subparsers())
    args = ap.parse_args(["plan", *argv, "--json"])
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


def test_a_run_folder_plans_its_own_step(run, capsys):
    """The run's folder and its checkpoint plan the same step: fp32, TP=2, 4 passes of 2
    sequences of 32 tokens, recomputed (not plan's defaults: bf16, one pass, 2048 tokens)."""
    step_dir = next(run.glob("step-*"))
    for config in (run, step_dir):
        got = _plan_json(capsys, "--config", str(config))
        assert (got["dtype"], got["tp"], got["batch"], got["seq"], got["micro_batches"],
                got["micro_batch"], got["recompute"]) == ("fp32", 2, 8, 32, 4, 2, "full"), got


def test_flags_given_win_over_the_runs(run, capsys):
    """--dtype, --micro-batch-size and --seq-len given replace the run's; the rest stays."""
    got = _plan_json(capsys, "--config", str(run), "--dtype", "bf16-autocast",
                     "--micro-batch-size", "4", "--seq-len", "16")
    assert (got["dtype"], got["tp"], got["batch"], got["seq"], got["micro_batches"],
            got["recompute"]) == ("bf16-autocast", 2, 8, 16, 2, "full"), got
    rows = _plan_json(capsys, "--config", str(run), "--tp", "1,2")  # TP rows: one pass each
    assert [(r["tp"], r["dtype"], r["batch"], r["seq"]) for r in rows["rows"]] == \
        [(1, "fp32", 8, 32), (2, "fp32", 8, 32)], rows["rows"]
