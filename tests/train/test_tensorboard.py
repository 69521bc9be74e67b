"""``tensorpar train --tensorboard``: the scalars in ``RUN/tensorboard/`` are the rows of
``metrics.jsonl``, step for step, read back as TensorBoard reads them; a resumed run continues the
curve without a step twice; without tensorboard the flag is one line before any rank starts.

The runs are TP=1 in this process (no process group: world size 1 is a real case), a one-block
GPT for a few steps, so the file takes seconds."""

import ast
import shutil
import sys
from pathlib import Path

import numpy as np

import tensorpar
from tensorpar.checkpoint.format import find_checkpoint
from tensorpar.gpt.model import GPTConfig
from tensorpar.train.config import TrainConfig
from tensorpar.train.loop import train_rank
from tensorpar.train.report import Metrics, TensorBoardSink

from tests_common import TINY_GPT, board_scalars, read_metrics, tensorpar_here

MODEL = GPTConfig(n_layer=1, dim=32, n_head=4, n_kv_head=1, hidden_dim=64)


def _train(out: Path, steps: int, resume_from=None) -> None:
    cfg = TrainConfig(tp=1, steps=steps, batch_size=2, seq_len=16, warmup_steps=2, seed=3,
                      lr_decay_steps=8, save_every=4, out=str(out),
                      resume=resume_from is not None,
                      tensorboard=True)
    train_rank(cfg, MODEL, None if resume_from is None else str(resume_from))


def _assert_board_is_metrics(run: Path) -> None:
    """Every number of every metrics.jsonl row is the scalar train/KEY at its step (float32, as
    TensorBoard stores it), and nothing else is there."""
    rows = read_metrics(run)
    board = board_scalars(run / "tensorboard")
    keys = sorted(k for k in rows[0] if k != "step")
    assert sorted(board) == [f"train/{k}" for k in keys]
    for key in keys:
        want = [(r["step"], float(np.float32(r[key]))) for r in rows]
        assert board[f"train/{key}"] == want, key


def test_scalars_equal_metrics_and_resume_appends(tmp_path, capsys):
    """A run of 6 steps (checkpoints at 4 and 6): the scalars equal metrics.jsonl and the last
    line names the directory. Killed after step 6 but resumed from step 4 (the step-6 checkpoint
    removed) to step 8: one event file more, steps 1-8 once each, and steps 5 and 6 show the
    resumed run's values (its own tokens/s and step times), as metrics.jsonl does."""
    run = tmp_path / "run"
    _train(run, 6)
    last = " ".join(capsys.readouterr().out.split())  # rich wraps the line at 80 columns
    assert f"tensorboard: {run / 'tensorboard'}" in last
    _assert_board_is_metrics(run)
    first = {tag: dict(v) for tag, v in board_scalars(run / "tensorboard").items()}

    shutil.rmtree(run / "step-00000006")  # as if killed during the save of step 6
    ckpt = find_checkpoint(run)
    assert ckpt.name == "step-00000004"
    _train(run, 8, resume_from=ckpt)
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 9))
    _assert_board_is_metrics(run)
    again = dict(board_scalars(run / "tensorboard")["train/step_time_s"])
    assert [again[s] == first["train/step_time_s"][s] for s in (4, 5, 6)] == [True, False, False]


def test_each_row_is_flushed_and_skipped_values_left_out(tmp_path):
    """A row's scalars are on disk once ``write`` returns (a run killed after it keeps them),
    before ``close``; a skipped step's None and its reason are not scalars."""
    metrics = Metrics(tmp_path / "metrics.jsonl", 0, [TensorBoardSink(tmp_path / "tensorboard", 0)])
    metrics.write({"step": 1, "loss": 5.5, "lr": 1e-3, "grad_norm": 2.0})
    metrics.write({"step": 2, "loss": None, "lr": 2e-3, "grad_norm": None,
                   "skipped": "non-finite: loss nan, gradient norm nan"})
    board = board_scalars(tmp_path / "tensorboard")
    metrics.close()
    assert board == {"train/loss": [(1, 5.5)], "train/grad_norm": [(1, 2.0)],
                     "train/lr": [(1, float(np.float32(1e-3))), (2, float(np.float32(2e-3)))]}
    metrics.close()  # idempotent: the trainer closes it on every way out


def test_missing_tensorboard_is_one_line_before_any_rank(tmp_path, monkeypatch):
    """Without tensorboard (its import made to fail), ``--tensorboard`` exits 2 with one line
    naming the pip command, raised in the launcher: no rank started, no run directory made."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    out = tmp_path / "run"
    r = tensorpar_here("train", "--tp", "1", "--steps", "2", *TINY_GPT, "--out", out,
                       "--tensorboard")
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "pip install tensorboard" in r.stderr, r.stderr
    assert r.stderr.startswith("tensorpar train: --tensorboard needs the tensorboard package")
    assert not out.exists()


def test_tensorboard_imported_only_inside_functions():
    """No tensorpar module imports tensorboard when it is imported: only ``--tensorboard`` loads
    it (read from the source, so the other tests' imports do not count)."""
    for path in Path(tensorpar.__file__).parent.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:  # module level only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any("tensorboard" in n for n in names), f"{path}: {ast.unparse(node)}"
