"""The GPT's MoE blocks on one process: the aux losses reach the gradient as the objective
``cross-entropy + coef x balance + z_coef x z`` (summed over the blocks) gives it, the reported
loss stays the cross-entropy, and loss-free balancing moves each block's selection bias by
``rate x sign(mean load - load)`` after a step; checkpoints keep that bias (loaded at TP 2)."""

import json

import pytest
import torch
import torch.distributed as dist

from tensorpar.checkpoint.format import find_checkpoint
from tensorpar.checkpoint.load import load_checkpoint
from tensorpar.checkpoint.save import save_checkpoint
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.gpt.moe_blocks import GPTMoE
from tensorpar.parallel.ownership import ShardOwnership
from tensorpar.train.config import TrainConfig
from tensorpar.train.gpt_recipe import GPTRecipe
from tensorpar.train.moe import MoETraining
from tensorpar.transformer.moe import ParallelMoE

SMALL = {"vocab_size": 64, "n_layer": 1, "dim": 16, "n_head": 2, "n_kv_head": 1,
         "hidden_dim": 16, "moe_experts": 6, "moe_top_k": 2}
TOL = 1e-6  # relative; measured 6e-8 (the router weights' gradients)


def _batch():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (2, 8), generator=g)
    return x, torch.roll(x, -1, 1)


@pytest.mark.slow  # the first MoE step of a process takes seconds to warm up
def test_aux_losses_reach_the_gradient(monkeypatch):
    """Each router's gradient equals that of CE + sum over blocks of the weighted aux losses,
    computed by hand from the core layer's returned ``MoEAux``; the loss is the CE alone."""
    cfg = GPTConfig(**SMALL, moe_aux_coef=0.3, moe_z_coef=0.05)
    x, y = _batch()
    model = GPT(cfg, seed=1)
    loss = model(x, y)
    loss.backward()
    got = [b.mlp.router.weight.grad.clone() for b in model.blocks]

    auxes = []

    def plain(self, h, seq_len=None):  # the layer's output, its aux kept with its graph
        out, aux = ParallelMoE.forward(self, h, seq_len)
        auxes.append(aux)
        return out

    monkeypatch.setattr(GPTMoE, "forward", plain)
    ref = GPT(cfg, seed=1)
    ce = ref(x, y)
    total = ce + sum(a.loss(cfg.moe_aux_coef, cfg.moe_z_coef) for a in auxes)
    total.backward()
    assert abs(loss.item() - ce.item()) <= TOL * ce.item()
    for i, block in enumerate(ref.blocks):
        want = block.mlp.router.weight.grad
        assert (got[i] - want).norm() <= TOL * want.norm(), i
    assert len(auxes) == cfg.n_layer


@pytest.mark.slow
def test_loss_free_balancing_moves_the_bias():
    """After a finite step each block's selection bias is rate x sign(mean load - load) of the
    step's loads; the metrics give the aux term and [fewest, most] per block."""
    cfg = GPTConfig(**SMALL, moe_router="sigmoid", moe_balance="bias", moe_bias_rate=0.1)
    train = TrainConfig(tp=1, batch_size=2, seq_len=8)
    moe = MoETraining.setup(train, GPTRecipe(cfg), None, None)
    model = GPT(cfg, seed=1)
    moe.attach(model, 1)  # one pass a step
    x, y = _batch()
    model(x, y).backward()
    loads = {i: layer.records[0].expert_load.clone() for i, layer in moe.layers.items()}
    row = moe.end_step(True)
    for i, layer in moe.layers.items():
        want = 0.1 * torch.sign(loads[i].mean() - loads[i])
        assert torch.equal(layer.router.selection_bias, want.float()), i
        assert row["expert_load"][i] == [int(loads[i].min()), int(loads[i].max())]
        assert int(loads[i].sum()) == 2 * 8 * cfg.moe_top_k
        assert layer.records == []
    assert row["aux_loss"] > 0


def _biases(model) -> list[torch.Tensor]:
    return [b.mlp.router.selection_bias.clone() for b in model.blocks]


def _load_at_tp(path: str, cfg: GPTConfig) -> list[torch.Tensor]:
    """A rank's selection biases after loading ``path`` into the GPT split over every rank."""
    model = GPT(cfg, dist.group.WORLD)
    load_checkpoint(path, model)
    return _biases(model)


def _saved_biases(path) -> tuple[GPTConfig, list[torch.Tensor]]:
    """A GPT with the sigmoid router whose selection biases some steps of loss-free balancing
    moved, saved at TP 1 under ``path``: (its config, its biases)."""
    cfg = GPTConfig(**SMALL | {"n_layer": 2}, moe_router="sigmoid", moe_balance="bias")
    model = GPT(cfg, seed=1)
    for i, block in enumerate(model.blocks):
        block.mlp.router.selection_bias.copy_(torch.linspace(-0.3, 0.2, 6) * (i + 1))
    save_checkpoint(path, 1, model, ShardOwnership.gather(model), meta={"config": {}})
    return cfg, _biases(model)


def test_checkpoints_keep_the_selection_bias(tmp_path):
    """The selection bias is saved (whole: split_dim None) and loads; a checkpoint without it
    (written before it was kept) loads too, the bias left as the model has it."""
    cfg, want = _saved_biases(tmp_path)
    path = find_checkpoint(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    entry = manifest["tensors"]["blocks.1.mlp.router.selection_bias"]
    assert entry["split_dim"] is None and entry["shape"] == [6]
    fresh = GPT(cfg, seed=2)
    load_checkpoint(path, fresh)
    assert all(torch.equal(a, b) for a, b in zip(_biases(fresh), want, strict=True))
    for i in range(cfg.n_layer):
        del manifest["tensors"][f"blocks.{i}.mlp.router.selection_bias"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    older = GPT(cfg, seed=2)
    load_checkpoint(path, older, check_hashes=False)
    assert all(not b.any() for b in _biases(older))


@pytest.mark.slow
def test_selection_bias_loads_at_tp2(ranks, tmp_path):
    """Saved at TP 1, the selection bias loads whole on both ranks of TP 2."""
    cfg, want = _saved_biases(tmp_path)
    for got in ranks(2).run(_load_at_tp, str(find_checkpoint(tmp_path)), cfg):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
