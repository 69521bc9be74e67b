"""Context parallelism at a long sequence: a rank's memory at cp N against one rank, the
planner's estimate beside it, and the step time, on this CPU with gloo ranks.

Two models (``--model``): ``gpt``, tensorpar's GPT with ``cp_group`` (what ``tensorpar train
--cp`` runs: every rank is given the whole rows and keeps its load-balanced chunks; embedding,
blocks, head and loss; AdamW, fused), or ``blocks``, a stack of the core's blocks as the GPT
builds them (RMSNorm, ``ParallelSelfAttention(cp_group=)`` with rotary positions and GQA,
RMSNorm, SwiGLU ``ParallelMLP``) driven directly, each rank with its ``split_to_cp`` chunks of
one random (1, T, D) sequence, the gradient of the output all ones, no optimizer. One sequence
a step, fp32, the weights whole on every rank (no data-parallel engine: the CP ranks' gradient
sum is not part of what is measured).

Measured on each rank (the largest is reported):

- kept: the bytes saved for backward at the end of forward, each storage once
  (``saved_tensors_hooks``; the parameters left out), against the planner's: the GPT's
  ``Budget.activations`` (``memory.tensorpar_memory``), or the blocks' ``block_terms`` total
  times the layers (and, at cp 1, the rotary tables the blocks share; with CP each block saves
  its own rows of them, a block term);
- peak: the most tensor storage alive during a step (``MemoryMeter``: every storage torch
  allocates, tracked op by op; not the allocator's slack or gloo's buffers), less what was alive
  before the model was built, against the planner's: the GPT's ``Budget.total`` (weights, AdamW
  states and the step's largest moment), or the blocks' kept bytes plus what a block's backward
  adds (``Budget.blocks.inside``);
- step: the median wall time of the steps after the warm-up and the metered one (the meter
  slows a step), each rank with ``torch.get_num_threads()`` threads (the cores divided among
  the ranks).

::

    python benchmarks/context_parallel.py                      # the GPT, T=8192, d=256, cp 1 and 4
    python benchmarks/context_parallel.py --model blocks --cp 1,2,4 --steps 3

The machine's load (``os.getloadavg``, before and after each CP size) is printed beside the
times: on a shared machine the step times say more about the neighbours than about CP.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tensorpar import ParallelMLP, ParallelSelfAttention, RankPool, RMSNorm  # noqa: E402
from tensorpar.gpt.model import GPT, GPTConfig  # noqa: E402
from tensorpar.parallel.context import cp_sizes, split_to_cp  # noqa: E402
from tensorpar.planner.activations import block_terms  # noqa: E402
from tensorpar.planner.memory import tensorpar_memory  # noqa: E402
from tensorpar.planner.meter import MemoryMeter  # noqa: E402
from tensorpar.planner.step import Step  # noqa: E402
from tensorpar.runtime.groups import tp_rank  # noqa: E402
from tensorpar.train.shape import gpt_shape  # noqa: E402
from tensorpar.transformer.context_parallel import CPSequence, cp_size  # noqa: E402
from tensorpar.transformer.rotary import rotary_table  # noqa: E402

MiB = 2 ** 20


class CPBlock(torch.nn.Module):
    """x = x + attn(norm(x)); x = x + mlp(norm(x)), the sequence split over ``cp_group``."""

    def __init__(self, cfg: GPTConfig, tp_group, cp_group):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, group=tp_group)
        self.attn = ParallelSelfAttention(cfg.dim, cfg.n_head, cfg.n_kv_head, bias=False,
                                          group=tp_group, cp_group=cp_group, fused=True)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, group=tp_group)
        self.mlp = ParallelMLP(cfg.dim, cfg.hidden_dim, gated=True, activation="silu",
                               bias=False, group=tp_group, fused=True)

    def forward(self, x, rope, context):
        kw = {} if context is None else {"context": context}
        x = x + self.attn(self.attn_norm(x), rope, **kw)
        return x + self.mlp(self.mlp_norm(x))


def _groups():
    """(tp_group, cp_group): TP of one rank each, CP over every rank (None at one rank)."""
    n = dist.get_world_size()
    tp_group = dist.new_subgroups(1)[0]
    cp_group = dist.new_group(list(range(n))) if n > 1 else None
    return tp_group, cp_group


def _saved_bytes(model: torch.nn.Module, forward) -> int:
    """The bytes ``forward()`` saves for backward, each storage once, ``model``'s parameters
    left out; the graph is let go."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    return sum(saved.values())


def rank_run(kind: str, cfg: GPTConfig, seq: int, steps: int) -> dict:
    """One rank's kept bytes, peak and step times (module docstring)."""
    tp_group, cp_group = _groups()
    with MemoryMeter() as before:  # what the pool's rank holds already: not the step's
        pass
    torch.manual_seed(0)
    if kind == "gpt":
        model = GPT(cfg, tp_group, seed=0, cp_group=cp_group)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ids = torch.randint(0, cfg.vocab_size, (1, seq))

        def forward():
            return model(ids, ids)

        def step():
            model(ids, ids).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        model = torch.nn.ModuleList(CPBlock(cfg, tp_group, cp_group) for _ in range(cfg.n_layer))
        x = split_to_cp(torch.randn(1, seq, cfg.dim), cp_group)  # this rank's chunks
        rope = rotary_table(cfg.head_dim, 0, seq, cfg.rope_theta)
        context = CPSequence(seq) if cp_group is not None else None

        def forward():
            y = x
            for block in model:
                y = block(y, rope, context)
            return y

        def step():
            y = forward()
            y.backward(torch.ones_like(y))
            model.zero_grad(set_to_none=True)

    step()  # the warm-up: AdamW's states exist from here on, as in steady training
    with MemoryMeter() as meter:
        step()
    kept = _saved_bytes(model, forward)
    times = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    # the GPT's peak with its weights and AdamW states (as the planner's total); the blocks'
    # above what the step began with (their kept bytes and backward's)
    base = before.entry_bytes if kind == "gpt" else meter.entry_bytes
    return {"kept": kept, "peak": meter.peak_bytes - base,
            "step_s": statistics.median(times), "tokens": cp_sizes(seq, cp_size(cp_group))[
                tp_rank(cp_group) if cp_group is not None else 0],
            "threads": torch.get_num_threads()}


def planned(kind: str, cfg: GPTConfig, seq: int, cp: int) -> dict:
    """The planner's kept bytes and peak at ``cp`` (fp32, CPU; module docstring), and the
    masks of all layers."""
    step = Step(gpt_shape(cfg), seq=seq, dtype="fp32", cp=cp)
    mem = tensorpar_memory(step)
    mask = cfg.n_layer * block_terms(step)["attention mask"]
    if kind == "gpt":
        return {"kept": mem.activations, "peak": mem.total, "mask": mask}
    rope = 4 * seq * cfg.head_dim if cp == 1 else 0  # the shared fp32 tables (module docstring)
    kept = cfg.n_layer * block_terms(step)["total"] + rope
    return {"kept": kept, "peak": kept + mem.blocks.inside, "mask": mask}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt", "blocks"), default="gpt")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-kv-head", type=int, default=2)
    p.add_argument("--cp", default="1,4", help="CP sizes, comma-separated (1: one rank)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    args = p.parse_args()
    cfg = GPTConfig(n_layer=args.n_layer, dim=args.dim, n_head=args.n_head,
                    n_kv_head=args.n_kv_head)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores; {args.model} d={cfg.dim}, "
          f"{cfg.n_layer} layers, {cfg.n_head}/{cfg.n_kv_head} heads, hidden {cfg.hidden_dim}, "
          f"T={args.seq}, fp32")
    rows = []
    for cp in (int(c) for c in args.cp.split(",")):
        load = os.getloadavg()[0]
        with RankPool(cp, backend="gloo") as pool:
            got = pool.run(rank_run, args.model, cfg, args.seq, args.steps)
        worst = max(got, key=lambda r: r["peak"])
        plan = planned(args.model, cfg, args.seq, cp)
        rows.append((cp, worst, plan, max(r["step_s"] for r in got), load,
                     os.getloadavg()[0]))
    base = rows[0]
    print(f"{'cp':>3} {'tokens':>7} {'kept MiB':>9} {'planned':>9} {'err':>6} "
          f"{'peak MiB':>9} {'planned':>9} {'err':>6} {'mask MiB':>9} {'peak/cp1':>9} "
          f"{'step s':>7} {'x cp1':>6} {'threads':>7} {'load':>10}")
    for cp, r, plan, step_s, load0, load1 in rows:
        print(f"{cp:>3} {r['tokens']:>7} {r['kept'] / MiB:>9.1f} {plan['kept'] / MiB:>9.1f} "
              f"{plan['kept'] / r['kept'] - 1:>+6.1%} {r['peak'] / MiB:>9.1f} "
              f"{plan['peak'] / MiB:>9.1f} {plan['peak'] / r['peak'] - 1:>+6.1%} "
              f"{plan['mask'] / MiB:>9.1f} {r['peak'] / base[1]['peak']:>9.3f} "
              f"{step_s:>7.2f} {step_s / base[3]:>6.2f} {r['threads']:>7} "
              f"{load0:>4.1f}-{load1:<4.1f}")


if __name__ == "__main__":
    main()
