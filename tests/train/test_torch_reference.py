"""The GPT trainer against torch's own training loop: ``train`` at TP=2, with a short warmup, a
cosine decay and a clip that bites, takes the steps that a dense copy of the model takes under
``torch.optim.AdamW``, ``torch.optim.lr_scheduler.LambdaLR`` (the schedule written here from its
definition: linear warmup, cosine to lr/10) and ``torch.nn.utils.clip_grad_norm_``: the same
learning rate, loss and gradient norm each step, and the same weights at the end."""

import math

import torch
from safetensors.torch import load_file

from tensorpar.checkpoint.export import export_dense
from tensorpar.checkpoint.format import find_checkpoint
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.train.config import TrainConfig
from tensorpar.train.data import TokenBatches, read_corpus
from tensorpar.train.gpt_recipe import GPTRecipe
from tensorpar.train.loop import train_model_rank

MODEL = GPTConfig(n_layer=2, dim=32, n_head=4, n_kv_head=2, hidden_dim=64)
# clip 0.5: every step's norm is above it (checked), so clipping acts
CFG = dict(steps=6, batch_size=4, seq_len=32, warmup_steps=2, lr=3e-3, grad_clip=0.5,
           weight_decay=0.1, seed=5)
# relative; measured at most 1.8e-7 (losses and gradient norms) and 5.9e-7 (||a - b|| / ||b||
# of a weight tensor after the 6 steps)
TOL, WEIGHT_TOL = 1e-6, 2e-6


def schedule(step: int, cfg: TrainConfig) -> float:
    """The documented schedule as a factor of lr: linear warmup, cosine to a tenth."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    frac = min(1.0, (step - cfg.warmup_steps) / (cfg.steps - cfg.warmup_steps))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * frac))


def torch_loop(cfg: TrainConfig, model: torch.nn.Module, batches, loss_of):
    """Train ``model`` for cfg.steps with torch's AdamW (no decay on vectors), LambdaLR and
    clip_grad_norm_; its (lr, loss, grad norm) each step."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s, cfg))
    rows = []
    for step in range(cfg.steps):
        x, y = batches.batch(step)[:2]
        loss = loss_of(model, x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(decay + rest, cfg.grad_clip)
        rows.append((sched.get_last_lr()[0], loss.item(), norm.item()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return rows


def compare_rows(rows, want, tol, what=""):
    """The trainer's metrics rows against ``torch_loop``'s; the worst relative error."""
    assert len(rows) == len(want) > 0
    worst = 0.0
    for row, (lr, loss, norm) in zip(rows, want, strict=True):
        assert math.isclose(row["lr"], lr, rel_tol=1e-12), (what, row, lr)
        for key, value in (("loss", loss), ("grad_norm", norm)):
            err = abs(row[key] - value) / abs(value)
            worst = max(worst, err)
            assert err <= tol, f"{what} step {row['step']} {key}: {row[key]} vs {value} ({err:.1e})"
    return worst


def _gpt_loss(model, x, y):
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def test_gpt_trainer_equals_torchs_loop(ranks, tmp_path):
    """TP=2's steps are those of the dense GPT (TP=1, the same seed) under torch's optimizer,
    scheduler and clipping; the clip acts on every step."""
    cfg = TrainConfig(tp=2, out=str(tmp_path), save_every=CFG["steps"], **CFG)
    rows = ranks(2).run(train_model_rank, cfg, GPTRecipe(MODEL), None)[0]["rows"]
    dense = GPT(MODEL, None, seed=cfg.seed)
    data = read_corpus(cfg.data, GPTRecipe(MODEL).tokenizer())
    batches = TokenBatches(data.tokens, cfg.seq_len, cfg.batch_size, cfg.seed, data.digest)
    want = torch_loop(cfg, dense, batches, _gpt_loss)
    assert all(norm > cfg.grad_clip for _, _, norm in want), want
    compare_rows(rows, want, TOL)
    mine = load_file(export_dense(find_checkpoint(tmp_path), tmp_path / "dense.safetensors"))
    theirs = dense.state_dict()
    assert sorted(mine) == sorted(k for k in theirs if k in mine) and mine
    for name, w in mine.items():
        err = ((w - theirs[name]).norm() / theirs[name].norm()).item()
        assert err <= WEIGHT_TOL, f"{name} differs by {err:.2e} (relative)"
