"""Generation: a batch of prompts of different lengths (left padding, attention mask, rotary
positions per sequence) equals each prompt alone; greedy and seeded sampling (plain, top-k,
top-p) give the same tokens at every TP size; top-k and top-p keep the tokens a dense reference
keeps, without gathering the logits; end-of-text; clear errors, also through the CLI."""

import dataclasses
import math
import subprocess
import sys

import pytest
import torch

from tensorpar.checkpoint.save import save_checkpoint
from tensorpar.cli.main import main
from tensorpar.gpt.generate import format_completions, generate, generate_rank, left_pad
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.gpt.sampling import check_sampling, kept_tokens, pick_token
from tensorpar.parallel.mappings import gather_from_tp
from tensorpar.parallel.ownership import ShardOwnership
from tensorpar.parallel.sharding import shard_range
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.runtime.groups import tp_rank, tp_size

from tests_common import tensorpar_here
from tp_check import assert_close

# one KV head (shared by every rank at TP > 1); vocab 50 is uneven over 3 and 4 ranks
TINY = {"vocab_size": 50, "n_layer": 2, "dim": 32, "n_head": 4, "n_kv_head": 1, "hidden_dim": 40,
        "tie_embeddings": False}
PROMPTS = [[5, 1, 9], [3, 8, 8, 2, 40, 7, 11], [42], [13, 0, 0, 27, 6]]


def _model():
    model = GPT(GPTConfig(**TINY), seed=11)
    with torch.no_grad():  # a sharper head: the greedy path is then not decided by near-ties
        model.lm_head.weight.mul_(20)
    return model


def _batch_body():
    model = _model()
    ids, mask = left_pad(PROMPTS)
    T = ids.shape[1]
    with torch.no_grad():
        padded = gather_from_tp(model(ids, attention_mask_BS=mask), full_size=50)
        for b, p in enumerate(PROMPTS):
            alone = gather_from_tp(model(torch.tensor([p])), full_size=50)
            # ~10x the largest relative error measured: 2.4e-7 (TP=1; 2026-11-27)
            assert_close(f"logits of prompt {b}", padded[b, T - len(p):], alone[0], 2.5e-6)
    out = generate(model, ids, 12, attention_mask_BT=mask)
    for b, p in enumerate(PROMPTS):
        alone = generate(model, torch.tensor([p]), 12)
        assert out[b, T:].tolist() == alone[0, len(p):].tolist(), b
        assert out[b, :T - len(p)].tolist() == [0] * (T - len(p))  # the padding stays
    return out.tolist()


@pytest.mark.parametrize("n", [1, 3])
def test_batch_equals_each_prompt_alone(ranks, n):
    """Prompts of lengths 3, 7, 1 and 5, left-padded into one batch: each one's logits equal its
    logits alone (padding never attended, rotary positions from 0 at its first token) and its
    greedy tokens are exactly those it gets alone, also at TP=3 (heads and vocab uneven)."""
    results = ranks(n).run(_batch_body)
    assert all(r == results[0] for r in results)


# name: (temperature, top_k, top_p)
SETTINGS = {"greedy": (0.0, 0, 1.0), "sampled": (0.9, 0, 1.0), "top_k_1": (0.9, 1, 1.0),
            "top_k_5": (0.9, 5, 1.0), "top_p": (0.9, 0, 0.8), "top_k_top_p": (1.3, 8, 0.7)}


def _tokens_body():
    model = _model()
    ids, mask = left_pad(PROMPTS)
    out = {name: generate(model, ids, 12, t, seed=4, attention_mask_BT=mask, top_k=k,
                          top_p=p).tolist() for name, (t, k, p) in SETTINGS.items()}
    same_length = torch.tensor([[1, 2, 3, 4], [7, 7, 7, 7]])  # no mask: the fused causal path
    out["same_length"] = generate(model, same_length, 12, 0.9, seed=4).tolist()
    return out


def test_tokens_equal_across_tp(ranks):
    """Greedy, plain sampling, top-k, top-p and both, on a padded batch and on prompts of one
    length: the same tokens at TP=1, 2, 3 and 4 (the Gumbel noise is drawn alike for the whole
    vocabulary on every rank). top-k 1 samples the greedy tokens; top-k and top-p change the
    sample."""
    outs = {n: ranks(n).run(_tokens_body) for n in (1, 2, 3, 4)}
    ref = outs[1][0]
    for n, results in outs.items():
        for r in results:
            for name in ref:
                assert r[name] == ref[name], f"TP={n} {name}: {r[name]} vs {ref[name]}"
    assert ref["top_k_1"] == ref["greedy"] != ref["sampled"]
    assert ref["top_k_5"] != ref["sampled"] and ref["top_p"] != ref["sampled"]
    new = [t for row in ref["same_length"] for t in row[4:]]
    assert len(set(new)) >= 6  # not a degenerate repeat


def _dense_kept(scores, k, p):
    """The reference: top-k keeps scores >= the k-th largest; top-p, on what top-k kept, keeps a
    token when the probability of the tokens scoring strictly more is below p."""
    s = scores.double()
    if k:
        s = s.masked_fill(s < s.topk(k).values[:, -1:], -math.inf)
    prob = s.softmax(-1)
    above = (prob[:, None, :] * (s[:, None, :] > s[:, :, None])).sum(-1)  # (B, V)
    return (above < p) & (prob > 0)


def _kept_body():
    n, rank = tp_size(), tp_rank()
    gen = torch.Generator().manual_seed(0)
    halves = torch.log(0.5 ** torch.arange(1.0, 51.0))[torch.randperm(50, generator=gen)]
    ties = torch.zeros(50).index_fill(0, torch.tensor([4, 21, 40]), 2.0)  # 3 tied leaders
    dense = torch.cat([halves[None], ties[None], 3 * torch.randn(4, 50, generator=gen)])
    v0, v1 = shard_range(50, n, rank)
    counts = {}
    for k, p in [(5, 1.0), (0, 0.7), (0, 0.8), (0, 0.95), (8, 0.5), (2, 1e-6), (49, 0.999)]:
        with CollectiveCounter() as comm:
            keep = kept_tokens(dense[:, v0:v1], 50, k, p)
        got = gather_from_tp(keep.float(), full_size=50).bool()
        assert torch.equal(got, _dense_kept(dense, k, p)), (k, p, got.sum(-1))
        counts[(k, p)] = (dict(comm.counts), dict(comm.bytes))
    # the row of halves: 1/2, 1/4, 1/8 ... so top-p 0.7 keeps 2 tokens and 0.8 keeps 3
    assert _dense_kept(dense, 0, 0.7)[0].sum() == 2 and _dense_kept(dense, 0, 0.8)[0].sum() == 3
    assert _dense_kept(dense, 2, 1.0)[1].sum() == 3  # ties with the 2nd are kept
    # sampling draws from the kept set, with the renormalized probabilities: 4000 draws at once
    rows = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log().expand(4000, 4)
    logits = torch.full((4000, 50), -30.0).index_copy(1, torch.tensor([3, 20, 37, 49]), rows)
    drawn = pick_token(logits[:, v0:v1], v0, 50, 1.0, torch.Generator().manual_seed(7),
                       top_k=3)
    freq = torch.bincount(drawn, minlength=50)[[3, 20, 37, 49]] / 4000
    # seeded draws: 0.009 off (2026-11-27); 0.03 is ~4 standard deviations (0.008 at 4/9)
    assert torch.allclose(freq, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0]), atol=0.03), freq
    # top-k 1 and a tiny top-p are greedy; top-k of the whole vocabulary and top-p 1 are plain
    def draw(**kw):  # the same noise each time
        return pick_token(dense[:, v0:v1], v0, 50, 0.8, torch.Generator().manual_seed(3), **kw)

    untied = [0, 2, 3, 4, 5]  # row 1's three tied leaders all stay
    greedy = dense.argmax(-1)[untied]
    assert torch.equal(draw(top_k=1)[untied], greedy)
    assert torch.equal(draw(top_p=1e-6)[untied], greedy)
    assert torch.equal(draw(top_k=50, top_p=1.0), draw())
    assert not torch.equal(draw()[untied], greedy)
    return counts, drawn.tolist()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_kept_set_matches_dense_reference(ranks, n):
    """top-k, top-p and both on vocab-split scores keep exactly the dense reference's tokens
    (known halves, tied leaders, random rows). The logits are never gathered: top-k all-gathers
    k scores per row and rank, top-p all-reduces the max, the normalizer and 4 rounds of 255
    partial sums. 4000 draws with top-k 3 follow the renormalized probabilities."""
    results = ranks(n).run(_kept_body)
    assert all(r[1] == results[0][1] for r in results)
    if n == 1:
        assert all(c == {} for c, _ in results[0][0].values())
        return
    B = 6
    for (k, p), (counts, nbytes) in results[0][0].items():
        gathers = 1 if k else 0
        assert counts.get("all_gather", 0) == gathers, (k, p, counts)
        assert nbytes.get("all_gather", 0) <= n * B * k * 4  # k float32 scores per row and rank
        assert counts.get("all_reduce", 0) == (0 if p == 1 else 2 + 4), (k, p, counts)


def _eos_body():
    model = _model()
    ids, mask = left_pad(PROMPTS)
    T = ids.shape[1]
    free = generate(model, ids, 12, attention_mask_BT=mask)
    eos = free[0, T + 2].item()  # the third token row 0 makes
    out = generate(model, ids, 12, attention_mask_BT=mask, eos_id=eos)
    ends = []
    for b in range(len(PROMPTS)):
        new = free[b, T:].tolist()
        end = new.index(eos) + 1 if eos in new else 12
        ends.append(end)
        assert out[b, T:].tolist() == new[:end] + [eos] * (out.shape[1] - T - end), b
    assert out.shape[1] == T + max(ends)  # stopped when every row had ended
    alone = generate(model, torch.tensor([PROMPTS[0]]), 12, eos_id=eos)
    assert alone[0, len(PROMPTS[0]):].tolist() == free[0, T:T + 3].tolist()
    return out.tolist()


def test_stop_at_end_of_text(ranks):
    """A row ends at eos_id (then repeats it); generation stops once every row has ended."""
    results = ranks(2).run(_eos_body)
    assert results[0] == results[1]


def test_bad_arguments():
    model = GPT(GPTConfig(**TINY), seed=1)
    ids = torch.tensor([[0, 1, 2]])
    for kw, message in [({"top_k": -1}, "--top-k -1 must be a whole number >= 0"),
                        ({"top_p": 0.0}, r"--top-p 0.0 must be in \(0, 1\]"),
                        ({"top_p": 1.5}, r"--top-p 1.5 must be in \(0, 1\]"),
                        ({"temperature": -1.0}, "need --temperature -1.0 >= 0")]:
        with pytest.raises(ValueError, match=message):
            generate(model, ids, 4, **kw)
    with pytest.raises(ValueError, match="must pad on the left"):
        generate(model, ids, 4, attention_mask_BT=torch.tensor([[1, 1, 0]]))
    check_sampling(0.0, 7, 0.5)  # top-k and top-p with greedy: accepted, no effect
    assert left_pad([[4, 5], [6]], pad_id=9)[0].tolist() == [[4, 5], [9, 6]]
    assert format_completions(["a", "b\nc"]) == "a\n--- 2\nb\nc\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A one-layer byte GPT saved at TP=1 (random weights, a sharpened head)."""
    cfg = GPTConfig(n_layer=1, dim=32, n_head=4, n_kv_head=1, tie_embeddings=False)
    model = GPT(cfg, seed=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    run = tmp_path_factory.mktemp("gen")
    save_checkpoint(run, 1, model, ShardOwnership.gather(model),
                    meta={"config": dataclasses.asdict(cfg), "tokenizer": "bytes"})
    return run


def _tensorpar(*args):
    """stdout as written (no newline translation: random bytes may hold a carriage return)."""
    out = subprocess.run([sys.executable, "-m", "tensorpar", *map(str, args)],
                         capture_output=True, timeout=300)
    return out.returncode, out.stdout.decode(), out.stderr.decode()


def _split(stdout, n):
    """The CLI's texts: separated by lines ``--- 2``, ``--- 3`` ..."""
    parts = [stdout.removesuffix("\n")]
    for i in range(2, n + 1):
        parts[-1:] = parts[-1].split(f"\n--- {i}\n", 1)
    assert len(parts) == n, stdout
    return parts


def test_cli_several_prompts(ckpt, tmp_path):
    """``--prompt`` twice and ``--prompt-file``, sampled with top-k and top-p at TP=2: the texts
    of one batch at TP=1, in prompt order, each starting with its prompt."""
    prompts = ["Hi", "The quick brown", "a", "def f(x):"]
    (tmp_path / "p.txt").write_text("a\n\ndef f(x):\n")
    rc, stdout, stderr = _tensorpar(
        "generate", "--tp", 2, "--ckpt", ckpt, "--prompt", prompts[0], "--prompt", prompts[1],
        "--prompt-file", tmp_path / "p.txt", "--max-new-tokens", 10, "--temperature", 0.8,
        "--top-k", 20, "--top-p", 0.9, "--seed", 5)
    assert rc == 0, stderr
    texts = generate_rank(str(ckpt), prompts, 10, 0.8, 5, top_k=20, top_p=0.9)
    assert stdout == format_completions(texts)
    assert _split(stdout, 4) == texts
    assert all(t.startswith(p) for t, p in zip(texts, prompts, strict=True))
    assert texts != generate_rank(str(ckpt), prompts, 10, 0.8, 5)  # top-k/top-p arrived


@pytest.mark.parametrize("flags,message", [
    (["--top-k", "-1"], "--top-k -1 must be a whole number >= 0"),
    (["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
    (["--top-p", "nan"], "--top-p nan must be in (0, 1]"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0 must be >= 1"),
    (["--prompt", ""], "prompt 2 of 2 is empty"),
])
def test_cli_bad_values(ckpt, capsys, flags, message):
    """One clear line, exit 2, before any rank starts."""
    assert main(["generate", "--ckpt", str(ckpt), "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorpar generate: ") and message in err, err
    assert err.count("\n") == 1


def test_cli_export_is_not_a_checkpoint(ckpt, tmp_path, capsys):
    """``--ckpt`` given the file ``tensorpar export`` wrote: one line saying it is an export and
    how to use it, exit 2, no traceback."""
    from tensorpar.checkpoint.export import export_dense

    dense = export_dense(ckpt, tmp_path / "dense.safetensors")
    assert main(["generate", "--ckpt", str(dense), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err == (f"tensorpar generate: {dense} is an export (a dense safetensors file "
                   "written by tensorpar export), not a checkpoint: give --ckpt the run "
                   "directory it came from, or generate --hf a folder written by tensorpar "
                   "export --hf-out\n"), err


def test_cli_bad_top_p_exits_2(ckpt):
    out = tensorpar_here("generate", "--ckpt", ckpt, "--prompt", "x", "--top-p", 0)
    rc, stderr = out.returncode, out.stderr
    assert rc == 2 and "--top-p 0.0 must be in (0, 1]" in stderr and "Traceback" not in stderr
