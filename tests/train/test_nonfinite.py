"""A diverging run (``--lr 1e6``): the first non-finite step stops the run before the optimizer
applies it, naming the step and the first non-finite gradient; no checkpoint ever holds a
non-finite tensor; ``--skip-nonfinite N`` skips up to N such steps, counted in metrics.jsonl."""

import re

import torch
from safetensors.torch import load_file

from tests_common import TINY_GPT, read_metrics, tensorpar_cli, tensorpar_here

DIVERGE = ["--tp", 2, "--lr", "1e6", "--grad-clip", 0, "--save-every", 1, "--steps", 8]


def _all_finite(run) -> bool:
    files = list(run.glob("step-*/*.safetensors"))
    assert files
    return all(bool(t.isfinite().all()) for f in files for t in load_file(f).values())


def test_nonfinite_step_stops_the_run(tmp_path):
    # a process: its whole output, the ranks' included, is one line
    out = tensorpar_cli("train", *DIVERGE, "--out", tmp_path, *TINY_GPT)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    line = re.search(r"step (\d+): loss \S+, gradient norm (nan|inf); first non-finite gradient: "
                     r"(\S+) \(rank \d\); stopped before the optimizer applied it; the newest "
                     r"checkpoint, \S+, holds the weights before it; --skip-nonfinite N skips "
                     r"up to N such steps", out.stderr)
    assert line, out.stderr
    step = int(line.group(1))
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, step))
    assert _all_finite(tmp_path)


def test_skip_nonfinite_counts_and_then_stops(tmp_path):
    out = tensorpar_here("train", *DIVERGE, "--skip-nonfinite", 2, "--out", tmp_path, *TINY_GPT)
    assert out.returncode == 1 and "after skipping 2 such steps" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    rows = read_metrics(tmp_path)
    skipped = [r for r in rows if r.get("skipped")]
    assert len(skipped) == 2 and all(r["loss"] is None or r["grad_norm"] is None
                                     for r in skipped)
    assert all(r["skipped"].startswith("non-finite: loss") for r in skipped)
    assert _all_finite(tmp_path)
    assert torch.isfinite(torch.tensor([r["loss"] for r in rows if not r.get("skipped")])).all()
