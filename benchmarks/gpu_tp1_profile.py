"""One GPU, TP=1: where tensorpar's GPT and the same model in plain PyTorch spend their GPU time.

Run from the repository root on a machine with a CUDA GPU::

    PYTHONPATH=. python benchmarks/gpu_tp1_profile.py [--out DIR] [--shape dim,L,H,KV,V,T,B]

Contenders, from the same weights on the same batch, bf16 autocast, torch's fused AdamW:

    dense        DenseLlama (tensorpar/bench/work.py), eager
    tensorpar    tensorpar's GPT at world size 1 (fused column ops), eager
    tp-gather    the same with K/V heads gathered by index (index_select, whose backward is a
                 scatter-add), as attention.py did before it repeated them like the dense model

For each: the median of ``--steps`` timed steps (after 3 warmup ones; the contenders take turns
step by step, so a drift of the GPU hits all alike), then torch.profiler over 2 more steps. It
prints the step times and a table of GPU time per step by operator (the profiler's top-level
aten ops) where the contenders differ by more than 0.2 ms, and writes the full tables to
``--out``. The default shape is the 837M-parameter Llama of the README's GPU table.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from tensorpar.bench.workload import DenseLlama, Workload, dense_state, make_optimizer
from tensorpar.gpt.model import GPT

CONTENDERS = ("dense", "tensorpar", "tp-gather")


def build(name: str, work: Workload, state: dict, dev: torch.device) -> torch.nn.Module:
    if name == "dense":
        return DenseLlama(work, state).to(dev)
    model = GPT(work.gpt_config(), None, seed=work.seed, device=dev)
    if name == "tp-gather":
        for block in model.blocks:
            block.attn._kv_repeat = None  # the index_select path
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2048,16,16,4,32000,2048,8",
                    help="dim,layers,heads,kv_heads,vocab,seq_len,batch")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to try the script")
    args = ap.parse_args()
    dim, L, H, KV, V, T, B = (int(x) for x in args.shape.split(","))
    work = Workload(dim=dim, n_head=H, n_kv_head=KV, n_layer=L, vocab_size=V, seq_len=T,
                     batch_size=B)
    dev = torch.device(args.device)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    gen = torch.Generator().manual_seed(0)
    ids, tg = (torch.randint(0, V, (B, T), generator=gen).to(dev) for _ in range(2))
    state = dense_state(work)
    models = {n: build(n, work, state, dev) for n in CONTENDERS}
    opts = {n: make_optimizer(m.parameters(), work) for n, m in models.items()}

    def step(name: str) -> float:
        sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = models[name](ids, tg)
        loss.backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    times = collections.defaultdict(list)
    for s in range(3 + args.steps):
        for name in CONTENDERS:
            t = step(name)
            if s >= 3:
                times[name].append(t)
    med = {n: statistics.median(ts) * 1e3 for n, ts in times.items()}
    for n in CONTENDERS:
        print(f"{n:10s} step {med[n]:8.2f} ms (median of {args.steps}; min "
              f"{min(times[n]) * 1e3:.2f}, max {max(times[n]) * 1e3:.2f})  "
              f"x{med['dense'] / med[n]:.4f} of dense's speed", flush=True)

    per_op: dict[str, dict[str, float]] = {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in CONTENDERS:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step(name)
        ka = prof.key_averages()
        per_op[name] = {e.key: e.self_device_time_total / 2 / 1e3 for e in ka
                        if e.key.startswith("aten::") and e.self_device_time_total > 0}
        (out / f"profile_{name}.txt").write_text(
            ka.table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70))
    ops = sorted(set().union(*per_op.values()),
                 key=lambda k: -max(abs(per_op[n].get(k, 0) - per_op["dense"].get(k, 0))
                                    for n in CONTENDERS))
    lines = ["| aten op (GPU ms per step) | " + " | ".join(CONTENDERS) + " |",
             "|---|" + "---|" * len(CONTENDERS)]
    for k in ops:
        vals = [per_op[n].get(k, 0.0) for n in CONTENDERS]
        if max(vals) - min(vals) > 0.2:
            lines.append(f"| {k} | " + " | ".join(f"{v:.2f}" for v in vals) + " |")
    lines.append("| all aten ops | " + " | ".join(f"{sum(per_op[n].values()):.2f}"
                                                 for n in CONTENDERS) + " |")
    text = "\n".join(lines)
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    (out / "profile_diff.md").write_text(
        f"shape {args.shape}, {where}, torch {torch.__version__}\n\n"
        + "\n".join(f"- {n}: {med[n]:.2f} ms" for n in CONTENDERS) + "\n\n" + text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
