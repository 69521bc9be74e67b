"""What a run says as it starts, with its output in a file: a first line naming the model, the
data, the layout, the steps, where the outputs go and how often a line comes; step 1's line;
then a line every tenth of the run. On a terminal the bar shows no loss before the first
step's."""

from rich.console import Console

from tensorpar.gpt.model import GPTConfig
from tensorpar.train.config import TrainConfig
from tensorpar.train.loop import train_rank
from tensorpar.train.report import ProgressLine

MODEL = GPTConfig(n_layer=1, dim=32, n_head=4, n_kv_head=1, hidden_dim=64)


def test_a_run_in_a_file_says_it_started_and_step_one(tmp_path, capsys):
    """TP=1 in this process, 3 steps: the start line first, then step 1's."""
    out = tmp_path / "run"
    cfg = TrainConfig(tp=1, steps=3, batch_size=2, seq_len=16, warmup_steps=2, save_every=10,
                      out=str(out))
    train_rank(cfg, MODEL, None)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"train tensorpar's GPT on pydoc_data: --tp 1 x --dp 1 (1 rank), steps "
                        f"1-3; outputs in {out} (metrics.jsonl, a checkpoint every 10 steps and "
                        "at the end); a line every step")
    assert lines[1].startswith("step 1/3  loss ")


def test_lines_at_the_first_step_then_every_tenth(capsys):
    """Resumed at step 10 of 50: lines at step 11, at each multiple of 4 (a tenth of the 40
    steps), at the last and at the step with a validation loss."""
    line = ProgressLine(10, 50)
    for step in range(11, 51):
        line.update(step, 1.0, 1.0, val_loss=2.0 if step == 25 else None)
    said = [int(s.split()[1].split("/")[0]) for s in capsys.readouterr().out.splitlines()]
    assert said == [11, 12, 16, 20, 24, 25, 28, 32, 36, 40, 44, 48, 50]


def test_the_bar_starts_without_a_loss(monkeypatch):
    """On a terminal, the bar's loss and speed read "-" until the first step's."""
    monkeypatch.setattr(Console, "is_terminal", property(lambda self: True))
    bar = ProgressLine(0, 10)
    try:
        fields = bar.bar.tasks[0].fields
        assert (fields["loss"], fields["tps"]) == ("loss -", "- tok/s")
        bar.update(1, 2.5, 1000.0)
        assert (fields["loss"], fields["tps"]) == ("loss 2.5000", "1,000 tok/s")
    finally:
        bar.close()
