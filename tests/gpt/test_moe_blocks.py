"""The GPT's MoE blocks on one process: the aux losses reach the gradient as the objective
``cross-entropy + coef x balance + z_coef x z`` (summed over the blocks) gives it, the reported
loss stays the cross-entropy, and loss-free balancing moves each block's selection bias by
``rate x sign(mean load - load)`` after a step."""

import pytest
import torch

from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.gpt.moe_blocks import GPTMoE
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
