"""``tensorpar train --check-collectives``: the trainer's layouts run with every collective
compared across the ranks (op, shapes and dtypes) before it runs, and pass: (tp 2, pp 2) with
1F1B's point-to-point sends, (tp 2, dp 2) under FSDP2, TP=2 with gradient accumulation (and
LoRA: tests/hf/test_lora_train.py). A checked run's steps are the unchecked run's, bit for bit
(the check compares, it changes nothing)."""

import pytest

from tests_common import TINY_GPT, read_metrics, tensorpar_here

# 2 blocks; pipelined runs need untied embeddings and at least pp micro-batches (4 here)
FLAGS = [*TINY_GPT, "--n-layer", "2", "--no-tie-embeddings", "--steps", "3", "--batch-size",
         "8", "--micro-batch-size", "2"]
LAYOUTS = {
    "tp2-pp2": ["--tp", "2", "--pp", "2"],
    "tp2-dp2-fsdp": ["--tp", "2", "--dp", "2", "--dp-mode", "fsdp"],
    "tp2-accumulation": ["--tp", "2"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checked_run_passes_with_the_unchecked_steps(tmp_path, layout):
    """The checked run exits 0 with the unchecked run's rows."""
    rows = {}
    for flag in ("--check-collectives", "--no-check-collectives"):
        out = tmp_path / flag.strip("-")
        done = tensorpar_here("train", flag, *LAYOUTS[layout], *FLAGS, "--out", out)
        assert done.returncode == 0, done.stderr
        rows[flag] = [{k: r[k] for k in ("step", "loss", "grad_norm")} for r in read_metrics(out)]
    assert len(rows["--check-collectives"]) == 3
    assert rows["--check-collectives"] == rows["--no-check-collectives"]
