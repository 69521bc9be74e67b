"""Property tests (hypothesis) of the composite layers: MLP, attention (MHA, GQA, MQA), the
verification block (embedding, norms, attention, MLP, LM head) and the GPT against dense
references on drawn shapes. How the properties work and the example counts:
``test_properties.py``.
"""

import copy

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from tensorpar import ParallelMLP, ParallelSelfAttention, vocab_parallel_cross_entropy
from tensorpar.cli.verify import ParallelBlock, expected_collectives
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.transformer.mlp import ACTIVATIONS
from tensorpar.transformer.reference import BlockConfig, DenseAttention, DenseBlock, DenseMLP
from tensorpar.transformer.rotary import rotary_table

from test_properties import (
    PROPERTY,
    assert_within,
    compare,
    grad_scores,
    score,
    seq,
    shapes,
    width,
)
from tp_check import shard, solo_group

# each test's floor (see test_properties.py): ~10x the largest error measured over its
# well-conditioned examples (2026-11-27, torch 2.13 CPU)
FLOOR = {"mlp": 8e-6,  # measured 7.7e-7 (the input gradient, TP=2)
         "attention": 1e-5,  # measured 1.1e-6 (k_proj's gradient, TP=3)
         "block": 1e-5,  # measured 9.6e-7 (a norm weight's gradient, TP=1)
         "gpt": 8e-6}  # measured 8.0e-7 (v_proj's gradient, TP=3)


@st.composite
def heads(draw, n: int) -> tuple[int, int]:
    """(query heads, KV heads): at least n query heads, KV heads any divisor (MHA to MQA)."""
    h = draw(st.integers(n, 8))
    return h, draw(st.sampled_from([k for k in range(1, h + 1) if h % k == 0]))


# -- MLP and attention -----------------------------------------------------------------------------


@st.composite
def mlp_cases(draw) -> dict:
    c = draw(shapes())
    return c | {"d": draw(width(1)), "hidden": draw(width(c["n"])), "gated": draw(st.booleans()),
                "act": draw(st.sampled_from(["gelu", "gelu_tanh", "relu", "silu"])),
                "bias": draw(st.booleans()), "fused": draw(st.booleans()),
                "keep": c["sp"] and draw(st.booleans())}


def _mlp_body(c):
    torch.manual_seed(c["seed"])
    dense = DenseMLP(c["d"], c["hidden"], c["gated"], c["bias"], ACTIVATIONS[c["act"]])
    mlp = ParallelMLP.from_dense(dense.up, dense.down, dense.gate, c["act"], c["sp"],
                                 fused=c["fused"], keep_gathered_input=c["keep"])
    return compare(dense, mlp, torch.randn(c["b"], c["t"], c["d"]), seq(c["sp"]), seq(c["sp"]))


@settings(max_examples=45, **PROPERTY)
@given(c=mlp_cases())
def test_parallel_mlp(ranks, c):
    """Hidden units split (unevenly), gated or not, any activation, fused or plain, SP or not:
    the dense MLP."""
    assert_within(ranks(c["n"]).run(_mlp_body, c), c, FLOOR["mlp"])


@st.composite
def attention_cases(draw) -> dict:
    c = draw(shapes())
    h, kv = draw(heads(c["n"]))
    hd = draw(st.integers(1, 4))
    return c | {"d": draw(width(1)), "heads": h, "kv": kv, "hd": hd,
                "rope": hd % 2 == 0 and draw(st.booleans()), "causal": draw(st.booleans()),
                "bias": draw(st.booleans()), "fused": draw(st.booleans()),
                "keep": c["sp"] and draw(st.booleans())}


class WithRope(nn.Module):
    """Calls the attention with rotary tables for the T positions (or none)."""

    def __init__(self, attn: nn.Module, rope):
        super().__init__()
        self.attn, self.rope = attn, rope

    def forward(self, x):
        return self.attn(x, self.rope)


def _attention_body(c):
    torch.manual_seed(c["seed"])
    dense = DenseAttention(c["d"], c["heads"], c["kv"], c["hd"], c["bias"], c["causal"])
    attn = ParallelSelfAttention.from_dense(
        dense.q_proj, dense.k_proj, dense.v_proj, dense.o_proj, c["heads"], c["kv"],
        c["causal"], c["sp"], fused=c["fused"], keep_gathered_input=c["keep"])
    rope = rotary_table(c["hd"], 0, c["t"]) if c["rope"] else None
    x = torch.randn(c["b"], c["t"], c["d"])
    return compare(WithRope(dense, rope), WithRope(attn, rope), x, seq(c["sp"]), seq(c["sp"]))


@settings(max_examples=70, **PROPERTY)
@given(c=attention_cases())
def test_parallel_attention(ranks, c):
    """Query heads split (unevenly), KV heads split or shared between ranks (GQA, MQA), biases,
    rotary positions, causal or not, fused or plain, SP or not: the dense attention."""
    assert_within(ranks(c["n"]).run(_attention_body, c), c, FLOOR["attention"])


# -- the verification block and the GPT ------------------------------------------------------------


@st.composite
def block_cases(draw) -> dict:
    c = draw(shapes())
    h, kv = draw(heads(c["n"]))
    cfg = BlockConfig(vocab_size=draw(st.integers(c["n"], 40)), dim=h * draw(st.integers(1, 4)),
                      num_heads=h, num_kv_heads=kv, hidden_dim=draw(width(c["n"])),
                      seq_len=c["t"], batch_size=c["b"])
    return c | {"cfg": cfg}


def _block_body(c):
    cfg = c["cfg"]
    torch.manual_seed(c["seed"])
    dense = DenseBlock(cfg)
    exact = copy.deepcopy(dense).double()
    ids = torch.randint(cfg.vocab_size, (cfg.batch_size, cfg.seq_len))
    targets = torch.randint(cfg.vocab_size, (cfg.batch_size, cfg.seq_len))
    ref = []
    for model in (dense, exact):
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        ref.append((logits.detach(), loss.detach()))
    (logits, loss), (logits64, loss64) = ref
    block = ParallelBlock(dense, c["sp"], None)
    with CollectiveCounter() as fwd:
        logits_local = block(ids)
        loss_tp = vocab_parallel_cross_entropy(logits_local, targets, vocab_size=cfg.vocab_size)
    with CollectiveCounter() as bwd:
        loss_tp.backward()
    scores = {"logits": score(logits_local, logits, logits64, lambda t: shard(t, -1)),
              "loss": score(loss_tp, loss, loss64)}
    counts = {"forward": dict(fwd.counts), "backward": dict(bwd.counts)}
    return scores | grad_scores(dense, exact, block), counts


@settings(max_examples=30, **PROPERTY)
@given(c=block_cases())
def test_parallel_block(ranks, c):
    """Embedding, RMSNorm, GQA attention, LayerNorm, SwiGLU MLP, LM head and the vocab-parallel
    loss (``tensorpar verify``'s model): logits, loss and every gradient equal the dense block's,
    with exactly the collectives the Megatron scheme prescribes."""
    results = ranks(c["n"]).run(_block_body, c)
    assert_within([errors for errors, _ in results], c, FLOOR["block"])
    expected = expected_collectives(c["cfg"], c["n"], c["sp"])
    assert all(counts == expected for _, counts in results), (results[0][1], expected)


@st.composite
def gpt_cases(draw) -> dict:
    c = draw(shapes())
    h, kv = draw(heads(c["n"]))
    cfg = {"vocab_size": draw(st.integers(c["n"], 40)), "n_layer": draw(st.integers(1, 2)),
           "dim": h * draw(st.sampled_from([2, 4])), "n_head": h, "n_kv_head": kv,
           "hidden_dim": draw(width(c["n"])), "tie_embeddings": draw(st.booleans())}
    return c | {"cfg": cfg, "fused": draw(st.booleans()), "recompute": draw(st.booleans()),
                "keep": c["sp"] and draw(st.booleans())}


def _gpt_body(c):
    cfg = GPTConfig(**c["cfg"])
    dense = GPT(cfg, solo_group(), seed=c["seed"])  # weights depend on the seed only
    exact = GPT(cfg, solo_group(), seed=c["seed"]).double()
    model = GPT(cfg, None, c["sp"], seed=c["seed"], fused=c["fused"], recompute=c["recompute"],
                keep_gathered_input=c["keep"])
    torch.manual_seed(c["seed"])
    ids = torch.randint(cfg.vocab_size, (c["b"], c["t"]))
    targets = torch.randint(cfg.vocab_size, (c["b"], c["t"]))
    ref = []
    for m in (dense, exact, model):
        loss = m(ids, targets)
        loss.backward()
        with torch.no_grad():
            ref.append((m(ids), loss.detach()))
    (logits, loss), (logits64, loss64), (logits_local, loss_tp) = ref
    scores = {"logits": score(logits_local, logits, logits64, lambda t: shard(t, -1)),
              "loss": score(loss_tp, loss, loss64)}
    return scores | grad_scores(dense, exact, model)


@settings(max_examples=20, **PROPERTY)
@given(c=gpt_cases())
def test_gpt(ranks, c):
    """The whole GPT (rotary, GQA, SwiGLU, tied or untied head, fused or plain, recomputed or
    not, SP or not) at TP=n: loss, logits and every gradient equal the one-device GPT's."""
    assert_within(ranks(c["n"]).run(_gpt_body, c), c, FLOOR["gpt"])
