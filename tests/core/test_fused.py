"""The fused path (QKV, gate/up and the head as one op each, backward collective overlapped)
against the plain layers: same loss, same gradients, same collectives, in fp32 and under bf16
autocast."""

import pytest
import torch

from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.parallel.fused import fused_column
from tensorpar.runtime.counting import CollectiveCounter

from tp_check import assert_close

CFG = {"vocab_size": 50, "n_layer": 2, "dim": 32, "n_head": 4, "n_kv_head": 2, "hidden_dim": 40}


def _step(model, ids, targets, autocast):
    with CollectiveCounter() as counter, torch.autocast("cpu", torch.bfloat16,
                                                        enabled=autocast):
        loss = model(ids, targets)
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss, grads, dict(counter.counts), dict(counter.bytes)


def _fused_vs_plain_body(sp, n_kv_head, autocast):
    cfg = GPTConfig(**(CFG | {"n_kv_head": n_kv_head, "tie_embeddings": False}))
    torch.manual_seed(0)
    ids, targets = torch.randint(0, 50, (2, 12)), torch.randint(0, 50, (2, 12))
    plain = _step(GPT(cfg, None, sp, seed=3, fused=False), ids, targets, autocast)
    fused = _step(GPT(cfg, None, sp, seed=3, fused=True), ids, targets, autocast)
    tol = 1e-2 if autocast else 1e-5  # bf16 matmuls in a different grouping
    assert_close("loss", fused[0], plain[0], tol)
    for name, g in plain[1].items():
        assert_close(f"grad {name}", fused[1][name], g, tol if "norm" not in name else 5e-2)
    assert fused[2:] == plain[2:], (fused[2:], plain[2:])  # same collectives, same bytes
    return fused[2]


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("sp,n_kv_head,autocast", [(False, 2, False), (True, 1, False),
                                                   (False, 2, True), (True, 4, True)])
def test_fused_gpt_equals_plain(ranks, n, sp, n_kv_head, autocast):
    """GPT(fused=True) and GPT(fused=False) compute the same loss and gradients and issue the
    same collectives with the same payloads (fp32, and bf16 autocast whose backward all-reduce
    stays in fp32 like the plain path's)."""
    ranks(n).run(_fused_vs_plain_body, sp, n_kv_head, autocast)


def test_fused_column_one_rank():
    """World size 1 (no process group at all): the fused op equals the separate linears, input and
    weight gradients included, with a bias on only some of the weights."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, requires_grad=True)
    ws = [torch.randn(n, 8, requires_grad=True) for n in (6, 3, 3)]
    bias = torch.randn(3, requires_grad=True)
    y = torch.cat(fused_column(x, ws, [None, bias, None]), -1)
    ref = torch.cat([x @ ws[0].T, x @ ws[1].T + bias, x @ ws[2].T], -1)
    assert_close("output", y, ref)
    g = torch.randn_like(ref)
    got = torch.autograd.grad(y, [x, *ws, bias], g)
    want = torch.autograd.grad(ref, [x, *ws, bias], g)
    for a, b in zip(got, want, strict=True):
        assert_close("grad", a, b)
    with pytest.raises(ValueError, match="expected activations"):
        fused_column(x[0], ws)
    with pytest.raises(ValueError, match="3 weights but 1 biases"):
        fused_column(x, ws, [bias])
