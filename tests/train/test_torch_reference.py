"""The GPT trainer against torch's own training loop: ``train`` at TP=2, with a short warmup, a
cosine decay and a clip that bites, takes the steps that a dense copy of the model takes under
``torch.optim.AdamW``, ``torch.optim.lr_scheduler.LambdaLR`` (the schedule written here from its
definition: linear warmup, cosine to lr/10) and ``torch.nn.utils.clip_grad_norm_``: the same
learning rate, loss and gradient norm each step, and the same weights at the end."""

import torch
from safetensors.torch import load_file
from torch_loop import compare_rows, torch_loop

from tensorpar.checkpoint.export import export_dense
from tensorpar.checkpoint.format import find_checkpoint
from tensorpar.data.packing import TokenBatches
from tensorpar.data.text import read_corpus
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.train.config import TrainConfig
from tensorpar.train.gpt_recipe import GPTRecipe
from tensorpar.train.loop import train_model_rank

MODEL = GPTConfig(n_layer=2, dim=32, n_head=4, n_kv_head=2, hidden_dim=64)
# clip 0.5: every step's norm is above it (checked), so clipping acts
CFG = {"steps": 6, "batch_size": 4, "seq_len": 32, "warmup_steps": 2, "lr": 3e-3,
       "grad_clip": 0.5, "weight_decay": 0.1, "seed": 5}
# relative; measured at most 1.8e-7 (losses and gradient norms) and 5.9e-7 (||a - b|| / ||b||
# of a weight tensor after the 6 steps)
TOL, WEIGHT_TOL = 1e-6, 2e-6


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
