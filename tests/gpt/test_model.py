"""The GPT at TP=n against the same GPT on one device: logits, loss, every gradient, collectives;
the KV cache against full recomputation (generation: ``test_generate.py``)."""

import pytest
import torch

from tensorpar.gpt.generate import generate
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.parallel.mappings import gather_from_tp
from tensorpar.runtime.counting import CollectiveCounter

from tests_common import WORLD_SIZES
from tp_check import assert_close, assert_grads, solo_group

# 4 query heads, 2 KV heads (shared between ranks at TP=3 and 4); vocab 50 and hidden 40 are
# uneven over 3 and 4 ranks
TINY = {"vocab_size": 50, "n_layer": 2, "dim": 32, "n_head": 4, "n_kv_head": 2, "hidden_dim": 40}
# ~10x the largest relative error measured over each test's cases (2026-11-27, torch 2.13 CPU)
TOL = {"loss, logits": 1.5e-6,  # measured 1.6e-7 (the logits, one KV head, T=13, TP=2)
       "grad": 6e-6,  # measured 6.6e-7 (an MLP norm's weight, SP, TP=2)
       "cached logits": 2.5e-6}  # measured 2.5e-7 (TP=1)


def _gpt_body(tied, sp, n_kv_head, T):
    cfg = GPTConfig(**(TINY | {"tie_embeddings": tied, "n_kv_head": n_kv_head}))
    dense = GPT(cfg, solo_group(), seed=3)
    model = GPT(cfg, None, sequence_parallel=sp, seed=3)  # built TP-agnostic: same weights
    torch.manual_seed(0)
    ids, targets = torch.randint(0, 50, (2, T)), torch.randint(0, 50, (2, T))
    loss_ref = dense(ids, targets)
    loss_ref.backward()
    with CollectiveCounter() as fwd:
        loss = model(ids, targets)
    with CollectiveCounter() as bwd:
        loss.backward()
    assert_close("loss", loss, loss_ref, TOL["loss, logits"])
    with torch.no_grad():
        logits = gather_from_tp(model(ids), full_size=50) if not sp else None
        if logits is not None:
            assert_close("logits", logits, dense(ids), TOL["loss, logits"])
    assert_grads(dense, model, tol=TOL["grad"])
    return {"forward": dict(fwd.counts), "backward": dict(bwd.counts),
            "kv_shared": model.blocks[0].attn.kv_shared}


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("tied,sp,n_kv_head,T", [(True, False, 2, 12), (False, False, 1, 13),
                                                 (True, True, 2, 12), (False, True, 4, 13)])
def test_gpt_matches_one_device(ranks, n, tied, sp, n_kv_head, T):
    """Same seed, any TP size: the same model. Loss, logits and every gradient shard equal the
    one-device GPT's; the collectives are the prescribed ones: per block one all-reduce each way
    for attention and one for the MLP (SP: all-gather + reduce-scatter), the embedding's
    all-reduce, the loss's one all-gather (statistics and target logits together), and the LM
    head's f in backward. T = 13 splits the sequence unevenly over 2, 3 and 4 ranks: the counts
    stay the same."""
    results = ranks(n).run(_gpt_body, tied, sp, n_kv_head, T)
    if n == 1:
        assert all(r["forward"] == {} and r["backward"] == {} for r in results)
        return
    L = TINY["n_layer"]
    shared = L if results[0]["kv_shared"] else 0  # one all-reduce of shared KV grads per block
    if not sp:
        fwd = {"all_reduce": 2 * L + 1, "all_gather": 1}
        bwd = {"all_reduce": 2 * L + 1 + shared}
    else:  # + norm weight grads (2 per block and the final norm) summed over sequence shards
        fwd = {"reduce_scatter": 2 * L + 1, "all_gather": 2 * L + 2}
        # the column ops (QKV, gate/up per block, the head) gather their input shard again
        bwd = {"all_gather": 4 * L + 2, "reduce_scatter": 2 * L + 1,
               "all_reduce": 2 * L + 1 + shared}
    for r in results:
        assert (r["forward"], r["backward"]) == (fwd, bwd), r


def _cache_body():
    cfg = GPTConfig(**TINY)
    model = GPT(cfg, seed=5).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache(12)
        pieces = [model(ids[:, :4], cache=cache), model(ids[:, 4:7], cache=cache),
                  model(ids[:, 7:8], cache=cache), model(ids[:, 8:9], cache=cache)]
    assert_close("cached logits", torch.cat(pieces, dim=1), full, TOL["cached logits"])
    # greedy decoding with the cache = argmax of a full forward pass at every step
    out = generate(model, ids[:, :3], 8)
    seq = ids[:, :3]
    with torch.no_grad():
        for _ in range(8):
            logits = gather_from_tp(model(seq)[:, -1], full_size=50)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq), (out, seq)


@pytest.mark.parametrize("n", [1, 3])
def test_kv_cache_matches_full_forward(ranks, n):
    """Prefill plus cached steps (of 3, 1 and 1 tokens) give the logits of one full pass, with
    the cache split by heads; greedy decoding equals re-running the whole sequence each step."""
    ranks(n).run(_cache_body)


def test_config_errors_name_the_flags():
    with pytest.raises(ValueError, match="--n-head 5, --n-kv-head 2"):
        GPTConfig(n_head=5, n_kv_head=2, dim=40).check(1)
    with pytest.raises(ValueError, match="even head_dim"):
        GPTConfig(dim=36, n_head=4, n_kv_head=2).check(1)
    with pytest.raises(ValueError, match="every rank needs at least one query head"):
        GPTConfig(n_head=4, n_kv_head=2).check(8)
