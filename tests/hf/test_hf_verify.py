"""``verify --hf`` (``run_verify_hf``) on every family the README lists, on the shared gloo ranks;
splits a family cannot take refused up front with a ValueError naming the module."""

import accelerate  # noqa: F401  (a dev dependency: missing, this file fails, not skips)
import pytest
import torch
import torch.distributed as dist
import transformers
from hf_split import assert_split, planned_collectives  # noqa: E402

from tensorpar.cli.verify_hf import run_verify_hf  # noqa: E402
from tensorpar.hf.parallelize import parallelize  # noqa: E402
from tensorpar.hf.pretrained import from_pretrained  # noqa: E402
from tensorpar.runtime.counting import CollectiveCounter  # noqa: E402

# the largest relative error in verify's table (its own verdict allows 1e-5), ~10x the largest
# measured over these cases (2026-11-27, torch 2.13 CPU)
TOL_OUT = 5e-6  # hidden states, logits, loss: measured 5.4e-7 (Gemma2)
TOL_GRAD = 1e-5  # gradients: measured 1.0e-6 (Qwen2's layer 1)
FAMILIES = ["gpt2", "llama", "mistral", "qwen2-tied", "qwen3", "gemma", "gemma2", "granite",
            "starcoder2", "cohere", "smollm3", "gpt_neox"]


def _split_too(verify, path, *args):
    """``verify_hf_rank``'s result, with the bytes this rank holds once the split of every layer
    is checked (``assert_split``, on a second load) and the collectives that split implies."""
    result = verify(path, *args)
    dense = transformers.AutoModelForCausalLM.from_pretrained(path)
    result |= assert_split(from_pretrained(path), dense)
    result["planned"] = planned_collectives(dense, dist.get_world_size())
    return result


def _verify(ranks, capsys, path, n):
    """run_verify_hf's verdict and table, its ranks taken from the test pool; each rank checks
    its split, and the collectives verify counted (one forward, one backward) are the planned
    ones; the errors of the table within ``TOL_OUT`` and ``TOL_GRAD``."""
    results = []

    def run(fn, k, *args):
        results[:] = ranks(k).run(_split_too, fn, *args)
        return results

    ok = run_verify_hf(str(path), n, run=run)
    for rank, r in enumerate(results):
        assert r["held"] < r["dense"], (rank, r["held"], r["dense"])
        assert (r["forward"], r["backward"]) == r["planned"], (
            f"rank {rank}: forward {r['forward']}, backward {r['backward']}; the split implies "
            f"{r['planned']}")
        for name, out, grad in r["rows"]:
            assert (out or 0.0) <= TOL_OUT and (grad or 0.0) <= TOL_GRAD, (rank, name, out, grad)
    return ok, capsys.readouterr().out


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_hf_every_family(ranks, hf_dirs, capsys, family):
    """At TP=2 every layer is split, each rank holding its share, with the collectives that
    implies; every hidden state, the logits, the loss and every gradient equal the dense model's
    (``TOL_OUT``, ``TOL_GRAD``), greedy tokens identical (GPT-2: the Conv1D weights' gradients
    transposed, the fused q|k|v compared block by block)."""
    ok, out = _verify(ranks, capsys, hf_dirs / family, 2)
    assert ok, out
    for text in ("layer 0", "layer 1", "logits", "loss", "identical", "rank 1: parameters"):
        assert text in out, out


def test_verify_hf_gpt2_uneven(ranks, hf_dirs, capsys):
    """GPT-2 at TP=3: 4 heads dealt 2, 1, 1 in each block of the fused q|k|v, MLP 80 split
    27, 27, 26; still exact, every layer split unevenly."""
    ok, out = _verify(ranks, capsys, hf_dirs / "gpt2", 3)
    assert ok, out


NEOX_QKV = "gpt_neox.layers.0.attention.query_key_value"


def _refused_body(path, how):
    """The error and the collectives issued up to it, on this rank."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    dense = transformers.AutoModelForCausalLM.from_pretrained(path) if how == "convert" else None
    with CollectiveCounter() as counted, pytest.raises(ValueError) as err:
        from_pretrained(path) if how == "load" else parallelize(dense)
    return str(err.value), dict(counted.counts)


@pytest.mark.parametrize("how", ["load", "convert"])
def test_uneven_heads_refused_up_front(ranks, hf_dirs, how):
    """GPT-NeoX splits its per-head fused q|k|v with the plain column style: 4 heads over 3 ranks
    would cut heads apart (the forward's reshape fails, or worse). from_pretrained and
    parallelize refuse it with a ValueError naming the module and the numbers, the same on every
    rank, before any collective (and, loading, before reading weights)."""
    results = ranks(3).run(_refused_body, str(hf_dirs / "gpt_neox"), how)
    messages = {msg for msg, _ in results}
    assert len(messages) == 1, messages
    msg = messages.pop()
    assert msg.startswith(f"{NEOX_QKV}: style 'column'") and "4 heads over 3 ranks" in msg, msg
    for _, counts in results:
        assert counts == {}, counts


def test_verify_hf_refuses_uneven_neox(ranks, hf_dirs):
    """``verify --hf`` on GPT-NeoX at TP=3 is that one-line ValueError, not a forward crash."""
    with pytest.raises(ValueError, match=rf"^{NEOX_QKV}: .* 4 heads over 3 ranks"):
        run_verify_hf(str(hf_dirs / "gpt_neox"), 3,
                      run=lambda fn, k, *args: ranks(k).run(fn, *args))


def test_more_ranks_than_heads_names_the_module(hf_configs):
    """Style 'attention' over more ranks than heads: the error names the attention module."""
    model = transformers.AutoModelForCausalLM.from_config(hf_configs["llama"])
    from tensorpar.hf.plans import check_split

    with pytest.raises(ValueError, match=r"^model.layers.0.self_attn: num_heads=4 cannot be "
                                         r"split over 5 ranks"):
        check_split(model, "model.layers.0.self_attn", "attention", 5)
    check_split(model, "model.layers.0.self_attn", "attention", 4)  # 4 ranks: fine
