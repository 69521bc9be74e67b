"""``tensorpar train --wandb``: under ``WANDB_MODE=offline`` the run writes an offline W&B run
(``RUN/wandb/offline-run-*``) that holds every metrics.jsonl row's loss, gradient norm and
validation loss, as logged; a resumed run continues the same W&B run (its id in
``RUN/wandb-id``); without wandb installed the flag is one line before any rank starts.

TP=1 in this process (world size 1 is a real case), a one-block GPT for a few steps."""

import json
import sys
from pathlib import Path

import wandb  # noqa: F401  (a dev dependency: missing, this file fails, not skips)

from tensorpar.data.text import default_corpus
from tensorpar.gpt.model import GPTConfig
from tensorpar.train.config import TrainConfig
from tensorpar.train.loop import train_rank

from tests_common import read_metrics, tensorpar_here

MODEL = GPTConfig(n_layer=1, dim=32, n_head=4, n_kv_head=1, hidden_dim=64)


def _train(out: Path, steps: int, resume_from=None) -> None:
    (out.parent / "val.txt").write_text(default_corpus()[:1000])
    cfg = TrainConfig(tp=1, steps=steps, batch_size=2, seq_len=16, warmup_steps=2, seed=3,
                      save_every=2, out=str(out), resume=resume_from is not None, wandb=True,
                      val_data=str(out.parent / "val.txt"))
    train_rank(cfg, MODEL, None if resume_from is None else str(resume_from))


def test_offline_run_holds_the_rows(tmp_path, monkeypatch, capsys):
    """Every row's train/loss, train/grad_norm and val/loss values are in the offline run, the
    numbers written as metrics.jsonl has them; a resume appends to the same run id. The run
    says where the offline run is and the wandb sync line that uploads it."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    _train(out, 2)
    said = capsys.readouterr().out.splitlines()[1]
    assert said.startswith(f"wandb: an offline run in {out / 'wandb' / 'offline-run-'}"), said
    assert f"; upload it with: wandb sync {out / 'wandb' / 'offline-run-'}" in said, said
    run_id = (out / "wandb-id").read_text().strip()
    _train(out, 4, resume_from=out / "step-00000002")
    assert (out / "wandb-id").read_text().strip() == run_id
    logged = b"".join(p.read_bytes() for p in (out / "wandb").glob("offline-run-*/run-*.wandb"))
    # a folder per start, named by the second it started: two starts in one second share one
    folders = [p.name for p in (out / "wandb").glob("offline-run-*")]
    assert folders and all(name.endswith(f"-{run_id}") for name in folders), folders
    for name in (b"train/loss", b"train/grad_norm", b"val/loss"):
        assert name in logged
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        for key in ("loss", "grad_norm") + ("val_loss",) * ("val_loss" in row):
            assert json.dumps(row[key]).encode() in logged, (row["step"], key)
    assert sum("val_loss" in r for r in rows) == 2  # after steps 2 and 4


def test_without_wandb_the_flag_is_one_line(tmp_path, monkeypatch):
    """wandb not importable: ``--wandb`` is refused before any rank starts, naming the pip
    command; exit 2."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import of it now raises ImportError
    out = tensorpar_here("train", "--tp", "1", "--steps", "1", "--wandb", "--out",
                         tmp_path / "r")
    assert out.returncode == 2, out.stderr
    assert "--wandb needs the wandb package" in out.stderr and "pip install wandb" in out.stderr
