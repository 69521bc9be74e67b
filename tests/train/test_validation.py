"""Validation (``--val-data``, ``--eval-every``, ``--eval-batches``): the loss over the held-out
text's consecutive windows of seq-len + 1 tokens, with the weights after a step's update: the
same at every TP and DP size, equal to what transformers computes on the run exported at that
step, and written to metrics.jsonl, the summary and TensorBoard's val/loss."""

import json

import pytest
import torch

from tensorpar.data.packing import ValidationWindows
from tensorpar.data.text import default_corpus, token_ids
from tensorpar.gpt.model import GPTConfig
from tensorpar.train.config import TrainConfig
from tensorpar.train.loop import train_rank

from tests_common import board_scalars, tensorpar_here

MODEL = {"n_layer": 2, "dim": 32, "n_head": 4, "n_kv_head": 2, "hidden_dim": 64}
SEQ, BATCH, STEPS = 32, 4, 4
# 2,000 bytes after the training text's first 40,000: 60 windows of 33 (20 bytes left over),
# 15 batches of 4, dealt unevenly over 3 dp ranks
VAL_TEXT = default_corpus()[40_000:42_000]


@pytest.fixture(scope="module")
def val_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("val") / "val.txt"
    path.write_text(VAL_TEXT)
    return path


def _train(out, val, **flags):
    cfg = TrainConfig(steps=STEPS, batch_size=BATCH, seq_len=SEQ, warmup_steps=2, out=str(out),
                      save_every=STEPS, seed=5, val_data=str(val), **flags)
    return train_rank(cfg, GPTConfig(**MODEL), None).get("rows")


def _val(rows) -> dict[int, float]:
    return {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


@pytest.fixture(scope="module")
def tp1(ranks, val_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp1")
    return out, ranks(1).run(_train, out, val_file, tp=1, eval_every=2, tensorboard=True)[0]


@pytest.mark.parametrize("n,flags", [(2, {"tp": 2}), (2, {"tp": 1, "dp": 2, "dp_mode": "ddp"}),
                                     (4, {"tp": 2, "dp": 2, "dp_mode": "fsdp"})],
                         ids=["tp2", "dp2-ddp", "tp2-dp2-fsdp"])
def test_validation_loss_equal_across_tp_and_dp(ranks, val_file, tmp_path, tp1, n, flags):
    """After steps 2 and 4 (--eval-every 2), the validation loss at TP=2, DP=2 and TP=2 x DP=2
    equals TP=1's to 3e-7 (measured at most 2.9e-8)."""
    rows = ranks(n).run(_train, tmp_path, val_file, eval_every=2, **flags)[0]
    want = _val(tp1[1])
    assert sorted(want) == [2, 4] and sorted(_val(rows)) == [2, 4]
    for step, loss in _val(rows).items():
        assert abs(loss - want[step]) <= 3e-7 * want[step], (step, loss, want[step])


def test_validation_loss_is_what_transformers_computes(tp1, tmp_path):
    """The run exported at step 4 (``export --hf-out``): transformers' mean cross-entropy over
    the same windows (consecutive, non-overlapping, seq-len + 1 tokens, the last partial one
    dropped) equals the run's val_loss of step 4 to 2e-7 (measured 1.8e-8); metrics.jsonl and
    TensorBoard's val/loss have it after steps 2 and 4."""
    import transformers

    run, rows = tp1
    out = tensorpar_here("export", "--ckpt", run, "--hf-out", tmp_path / "hf")
    assert out.returncode == 0, out.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                              dtype=torch.float32).eval()
    ids = torch.tensor(list(VAL_TEXT.encode()))
    windows = ids[:len(ids) // (SEQ + 1) * (SEQ + 1)].view(-1, SEQ + 1)
    assert len(windows) == 60
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits
        want = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                 windows[:, 1:].flatten()).item()
    assert abs(_val(rows)[4] - want) <= 2e-7 * want, (_val(rows)[4], want)
    written = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in written if "val_loss" in r] == [2, 4]
    board = board_scalars(run / "tensorboard")["val/loss"]
    assert board == [(r["step"], pytest.approx(r["val_loss"], rel=1e-7)) for r in written
                     if "val_loss" in r]


def test_windows_and_their_batches():
    """The windows are consecutive and non-overlapping; --eval-batches K keeps the first K
    batches; dealt over 3 dp ranks, every rank gets as many rows, the padding's targets ignored,
    and together they hold each window once."""
    tokens = token_ids(VAL_TEXT)
    windows = ValidationWindows(tokens, SEQ, BATCH)
    every = tokens[:60 * (SEQ + 1)].long().view(60, SEQ + 1)
    assert len(windows) == 60 and torch.equal(every[1], tokens[33:66].long())
    assert len(ValidationWindows(tokens, SEQ, BATCH, batches=2)) == 8
    seen = []
    parts = [list(windows.batches(3, r)) for r in range(3)]
    for batch in zip(*parts, strict=True):
        assert len({x.shape for x, _ in batch}) == 1
        for x, y in batch:
            real = (y != -100).all(1)
            assert ((y == -100).all(1) | real).all()
            seen += [torch.cat([x[i], y[i, -1:]]) for i in range(len(x)) if real[i]]
    assert torch.equal(torch.stack(sorted(seen, key=lambda w: w.tolist())),
                       torch.stack(sorted(every, key=lambda w: w.tolist())))


def test_validation_flags_are_checked_before_any_rank(tmp_path):
    """A missing --val-data file, one shorter than a window, or --eval-every without --val-data:
    one line, exit 2."""
    short = tmp_path / "short.txt"
    short.write_text("too short")
    for flags, message in ((["--val-data", str(tmp_path / "nope.txt")], "no such file"),
                           (["--val-data", str(short)], "not one validation window"),
                           (["--eval-every", "5"], "go with --val-data")):
        out = tensorpar_here("train", "--tp", "1", "--steps", "1", "--out", str(tmp_path / "r"),
                             *flags)
        assert out.returncode == 2 and message in out.stderr, out.stderr
