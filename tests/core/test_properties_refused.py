"""Property tests (hypothesis): what the parallel layers refuse, they refuse on every rank with
the same ValueError (the ranks return the message instead of raising, so the pool stays
healthy): split sizes smaller than the TP size, head counts that cannot be split, and, under
sequence parallelism, a sequence shorter than the TP size (fewer tokens than ranks). How the
properties are run and the example counts: ``test_properties.py``.
"""

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tensorpar import (
    ColumnParallelLinear,
    ParallelSelfAttention,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.parallel.mappings import scatter_to_sequence

from test_properties import PROPERTY, width


def message_of(build, *args) -> str | None:
    """The ValueError's message, None when nothing was raised."""
    try:
        build(*args)
    except ValueError as e:
        return str(e)
    return None


def assert_refused(messages: list, pattern: str) -> None:
    """Every rank raised the same ValueError, and it says ``pattern``."""
    assert messages[0] is not None, "nothing was raised"
    assert all(m == messages[0] for m in messages), messages
    assert pattern in messages[0], messages[0]


def _refused_body(kind, size):
    layers = {"column": lambda: ColumnParallelLinear(4, size),
              "row": lambda: RowParallelLinear(size, 4),
              "embedding": lambda: VocabParallelEmbedding(size, 4)}
    return message_of(layers[kind])


@settings(max_examples=20, **PROPERTY)
@given(n=st.sampled_from([2, 3, 4]), data=st.data(),
       kind=st.sampled_from(["column", "row", "embedding"]))
def test_fewer_features_than_ranks_refused(ranks, n, data, kind):
    """A split dimension smaller than the TP size raises the same ValueError on every rank."""
    size = data.draw(st.integers(1, n - 1), label="size")
    assert_refused(ranks(n).run(_refused_body, kind, size), f"={size} cannot be split over {n}")


def _short_sequence_body(kind, b, t, d):
    torch.manual_seed(0)
    if kind == "embedding":
        return message_of(VocabParallelEmbedding(16, d, sequence_parallel=True),
                          torch.randint(16, (b, t)))
    if kind == "row":
        layer = RowParallelLinear(8, d, input_is_parallel=False, sequence_parallel=True)
        return message_of(layer, torch.randn(b, t, 8))
    return message_of(scatter_to_sequence, torch.randn(b, t, d))


@settings(max_examples=15, **PROPERTY)
@given(n=st.sampled_from([2, 3, 4]), data=st.data(), b=st.integers(1, 3), d=width(1),
       kind=st.sampled_from(["embedding", "row", "scatter"]))
def test_short_sequence_refused(ranks, n, data, b, d, kind):
    """Sequence parallelism refuses a sequence with fewer tokens than ranks, with the same
    ValueError on every rank, where the length is known (the SP embedding, the row layer's
    reduce-scatter, scatter_to_sequence). Any longer length works, uneven shards included
    (``test_properties.py`` draws them)."""
    t = data.draw(st.integers(1, n - 1), label="t")
    messages = ranks(n).run(_short_sequence_body, kind, b, t, d)
    assert_refused(messages, f"sequence length {t} is shorter than the TP size {n}")


# -- heads and the GPT ---------------------------------------------------------------------------


def _heads_body(kind, d, h, kv):
    if kind == "attention":
        return message_of(ParallelSelfAttention, d, h, kv)
    return message_of(GPT, GPTConfig(vocab_size=8, n_layer=1, dim=d, n_head=h, n_kv_head=kv,
                                     hidden_dim=8))


@st.composite
def bad_heads(draw) -> dict:
    """Query heads fewer than ranks or not a multiple of the KV heads (the multiple is checked
    first); or heads that split but a width that does not divide into them (the GPT also needs
    an even head_dim for its rotary positions, and checks the width first)."""
    n, h, kv = draw(st.sampled_from([1, 2, 3, 4])), draw(st.integers(1, 8)), draw(st.integers(1, 8))
    kind = draw(st.sampled_from(["attention", "gpt"]))
    if h % kv or h < n:
        d = 4 * h
        pattern = (f"num_heads={h} must be a positive multiple of num_kv_heads={kv}" if h % kv
                   else f"num_heads={h} cannot be split over {n} ranks")
    else:
        hd, rest = draw(st.integers(1, 4)), draw(st.integers(0, h - 1))
        d = h * hd + rest
        assume(rest or (kind == "gpt" and hd % 2))
        pattern = (f"dim={d} does not divide by num_heads={h}" if kind == "attention" else
                   f"--dim {d} must divide by --n-head {h} into an even head_dim")
    return {"n": n, "h": h, "kv": kv, "d": d, "pattern": pattern, "kind": kind}


@settings(max_examples=30, **PROPERTY)
@given(c=bad_heads())
def test_unsplittable_heads_refused(ranks, c):
    """ParallelSelfAttention and the GPT refuse head counts and widths that cannot be split,
    with the same ValueError on every rank."""
    messages = ranks(c["n"]).run(_heads_body, c["kind"], c["d"], c["h"], c["kv"])
    assert_refused(messages, c["pattern"])


def _gpt_short_body(t):
    cfg = GPTConfig(vocab_size=16, n_layer=1, dim=8, n_head=4, n_kv_head=2, hidden_dim=8)
    model = GPT(cfg, None, sequence_parallel=True, seed=0)
    return message_of(model, torch.randint(16, (2, t)))


@settings(max_examples=6, **PROPERTY)
@given(n=st.sampled_from([2, 3, 4]), data=st.data())
def test_gpt_refuses_short_sequence(ranks, n, data):
    """Under SP the GPT refuses a sequence shorter than the TP size, the same ValueError on
    every rank (uneven lengths train: ``test_properties_blocks.py``, ``tests/gpt``)."""
    t = data.draw(st.integers(1, n - 1), label="t")
    messages = ranks(n).run(_gpt_short_body, t)
    assert_refused(messages, f"sequence length {t} is shorter than the TP size {n}")
