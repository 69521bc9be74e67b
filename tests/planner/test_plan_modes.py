"""The planner against measurement in every training mode at TP=2: sequence parallelism,
dropout, bf16 autocast and full recomputation, each alone, dropout with recomputation, and all
combined (what ``tensorpar train`` prints as planned against measured peak and collectives)."""

import contextlib
import itertools

import pytest
import torch

from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.parallel.ownership import ShardOwnership, clip_grad_norm_
from tensorpar.planner.comm import predicted_comm
from tensorpar.planner.memory import tensorpar_memory
from tensorpar.planner.meter import MemoryMeter
from tensorpar.planner.step import Step
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.train.shape import gpt_shape

CFG = {"vocab_size": 256, "n_layer": 2, "dim": 64, "n_head": 4, "n_kv_head": 2}
B, T = 4, 32
# (sequence_parallel, dropout, bf16, recompute): none, each alone, dropout recomputed (the
# recomputation then runs each MLP's exit again), all together
MODES = [m for m in itertools.product([False, True], repeat=4) if sum(m) in (0, 1, 4)] + \
    [(False, True, False, True)]


def _measure(modes):
    out = []
    with MemoryMeter() as before:  # what this pool's rank holds from earlier tests: not ours
        pass
    for sp, dropout, bf16, recompute in modes:
        model = GPT(GPTConfig(**CFG, dropout=0.1 if dropout else 0.0), None, sp, seed=0,
                    recompute=recompute)
        ownership = ShardOwnership.gather(model)
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        ids = torch.randint(0, CFG["vocab_size"], (B, T))
        for step in range(2):  # the second step, measured: AdamW states exist, as in
            model.rng.set_step(step)  # steady training (the meter's scan costs a second)
            with (MemoryMeter() if step else contextlib.nullcontext()) as mem, \
                    CollectiveCounter() as comm:
                with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                    loss = model(ids, ids)
                loss.backward()
                clip_grad_norm_(model, ownership, 1.0)
                counted = {k: dict(getattr(comm, k)) for k in ("counts", "bytes", "ring_bytes")}
                opt.step()
                opt.zero_grad(set_to_none=True)
        out.append((mem.peak_bytes - before.entry_bytes, counted))
    return out


def test_planned_peak_within_10_percent_in_every_mode(ranks):
    """TP=2, on both ranks: the predicted peak of a step is within 10% of the measured one, and
    the predicted collectives are the counted ones exactly, with SP, dropout, bf16 and
    recompute, each and combined."""
    results = ranks(2).run(_measure, MODES)
    for rank, per_mode in enumerate(results):
        for (sp, dropout, bf16, recompute), (got, counted) in zip(MODES, per_mode, strict=True):
            shape = gpt_shape(GPTConfig(**CFG, dropout=0.1 if dropout else 0.0))
            planned = tensorpar_memory(Step(shape, 2, B, T, "bf16-autocast" if bf16 else "fp32",
                                            sp, "full" if recompute else "none",
                                            dropout=dropout), rank).total
            what = f"rank {rank} sp={sp} dropout={dropout} bf16={bf16} recompute={recompute}"
            # measured (2 runs, 2026-11-27, torch 2.13 CPU): 4.4% off at most (no mode on)
            assert got == pytest.approx(planned, rel=0.10), (what, got, planned,
                                                              planned / got - 1)
            comm = predicted_comm(shape, B, T, 2, sp, "bf16" if bf16 else "fp32",
                                  "full" if recompute else "none")
            assert counted == {k: comm[k] for k in ("counts", "bytes", "ring_bytes")}, what
