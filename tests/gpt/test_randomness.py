"""Randomness is part of exactness: every dropout mask comes from a stream of its own (seed,
purpose, step, dp rank, tp rank where sharded), a recomputed block replays the masks of its first
forward, and a mask is kept for backward as one byte per element."""

import itertools

import pytest
import torch

from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.parallel.dropout import TensorParallelRNG
from tensorpar.runtime.seeds import derive_seed
from tensorpar.train.config import TrainConfig
from tensorpar.train.loop import train_rank

from tests_common import TINY_GPT, tensorpar_here

MODEL = {"n_layer": 2, "dim": 32, "n_head": 4, "n_kv_head": 2, "hidden_dim": 64,
         "vocab_size": 256, "dropout": 0.1}


def _record_masks(sp: bool, steps: int = 4):
    """Each step: reseed the streams for the step, run a forward, note every dropout site's mask
    (where the output is zero and the input was not)."""
    from tensorpar.parallel.dropout import ParallelDropout

    model = GPT(GPTConfig(**MODEL), sequence_parallel=sp, seed=3)
    masks, step = {}, [0]

    def note(module, args, out):
        site = sum(1 for key in masks if key[0] == step[0])
        masks[(step[0], site)] = (out == 0) & (args[0] != 0)

    for m in model.modules():
        if isinstance(m, ParallelDropout):
            m.register_forward_hook(note)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for s in range(steps):
        step[0] = s
        model.rng.set_step(s)
        model(ids, ids)
    return masks


@pytest.mark.parametrize("n", [2, 4])
def test_no_dropout_mask_repeats_under_sp(ranks, n):
    """TP=n + SP, 4 steps, 2 blocks x 2 sites: the sequence shards' masks are all different,
    across ranks, steps and sites (with offsets added to a seed, rank r at step s would draw rank
    r-1's masks of step s+1)."""
    per_rank = ranks(n).run(_record_masks, True)
    seen = [(r, key, mask) for r, masks in enumerate(per_rank) for key, mask in masks.items()]
    assert len(seen) == n * 4 * 4
    for (ra, ka, a), (rb, kb, b) in itertools.combinations(seen, 2):
        if a.shape == b.shape:
            assert not torch.equal(a, b), f"rank {ra} {ka} and rank {rb} {kb} share a mask"


def test_replicated_masks_equal_across_tp_ranks(ranks):
    """Without SP the residual stream is replicated: every TP rank draws the same mask at each
    (step, site), and no two (step, site) pairs share one."""
    per_rank = ranks(2).run(_record_masks, False)
    assert per_rank[0].keys() == per_rank[1].keys()
    for key, mask in per_rank[0].items():
        assert torch.equal(mask, per_rank[1][key]), key
    for a, b in itertools.combinations(per_rank[0].values(), 2):
        assert not torch.equal(a, b)


def test_stream_seeds_differ_by_every_coordinate():
    """The replicated stream differs across data-parallel replicas and steps; each purpose has
    its own seeds (a hash, never an offset)."""
    a, b = TensorParallelRNG(7, dp_rank=0), TensorParallelRNG(7, dp_rank=1)
    assert a.seeds["replicated"] != b.seeds["replicated"]
    assert a.seeds["sharded"] != b.seeds["sharded"]
    before = dict(a.seeds)
    a.set_step(1)
    assert a.seeds["replicated"] != before["replicated"]
    assert derive_seed(7, "data-order", 1) != derive_seed(7, "dropout-replicated", 1, 0)
    assert derive_seed(7, "init", "a") == derive_seed(7, "init", "a") < 2 ** 63


def _train(out, tp, sp, recompute):
    cfg = TrainConfig(tp=tp, sequence_parallel=sp, steps=6, batch_size=4, seq_len=32,
                      warmup_steps=2, out=out, save_every=100, seed=1, recompute=recompute)
    return train_rank(cfg, GPTConfig(**MODEL), None).get("rows")


@pytest.mark.parametrize("n,sp", [(1, False), (2, False), (2, True)])
def test_recompute_replays_dropout_masks(ranks, tmp_path, n, sp):
    """--recompute --dropout 0.1 trains to the losses and gradient norms of the run that keeps
    its activations, bit for bit: the recomputed blocks draw the same masks."""
    kept = ranks(n).run(_train, str(tmp_path / "kept"), n, sp, False)[0]
    redone = ranks(n).run(_train, str(tmp_path / "redone"), n, sp, True)[0]
    assert len(kept) == len(redone) == 6
    for a, b in zip(redone, kept, strict=True):
        for key in ("loss", "grad_norm"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


def test_dropout_keeps_one_byte_per_element():
    """What autograd saves of a dropout is its bool mask: 1 byte per element of the input."""
    rng = TensorParallelRNG(0)
    x = torch.randn(64, 128, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
        y = rng.dropout(x * 1.0, 0.1, "replicated")
    assert sum(saved) <= x.numel()
    y.sum().backward()
    kept = y.detach() != 0
    assert torch.equal(x.grad[kept], torch.full_like(x.grad[kept], 1 / 0.9))
    assert torch.all(x.grad[~kept] == 0)


def test_a_run_saved_under_the_sequential_dropout_scheme_resumes_with_a_note(tmp_path):
    """A --dropout checkpoint whose manifest records the "hashed" scheme (before each mask was
    seeded on its own) resumes, with one note that its dropout masks differ from the original
    run's (its batches do not)."""
    import json

    from tensorpar.checkpoint.format import find_checkpoint

    run = tmp_path / "run"
    out = tensorpar_here("train", "--tp", 1, "--steps", 2, "--save-every", 2, "--dropout", 0.1,
                         "--out", run, *TINY_GPT)
    assert out.returncode == 0, out.stderr
    manifest = find_checkpoint(run) / "manifest.json"
    saved = json.loads(manifest.read_text())
    assert saved["rng"]["scheme"] == "hashed-keys"
    saved["rng"]["scheme"] = "hashed"
    manifest.write_text(json.dumps(saved))
    out = tensorpar_here("train", "--resume", "--steps", 3, "--out", run)
    assert out.returncode == 0, out.stderr
    assert "draws other dropout masks than the original would have (the same batches)" in \
        out.stdout + out.stderr
