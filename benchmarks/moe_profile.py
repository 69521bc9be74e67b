"""Where a Qwen3-MoE training step's time goes: tensorpar against transformers' own TP + EP and
the model on one rank, the bench's three MoE contenders in the same 2 ranks.

    python benchmarks/moe_profile.py --dim 512 --rounds 10 --out moe-512.json

The contenders are the bench's (``tensorpar/bench/hf_moe.py``): ``tp`` (``hf-qwen3moe``,
``tensorpar.parallelize``), ``transformers`` (``hf-qwen3moe-transformers``) and ``one`` (the
model alone in each rank, one thread: what half of it is the ideal 2-rank step). After 2
warm-up steps each, ``--rounds`` rounds time one step of each, their order alternating, every
step between two barriers: the step's wall time, and its CPU time (``time.process_time``: this
rank's threads, gloo's included, the time waiting for the other rank not), which a loaded
machine inflates far less than wall time. Then ``--profile-steps`` steps of each under
``torch.profiler`` (self CPU ms and calls by op, rank 0; the bench's categories).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import tensorpar as tp

SETUPS = {"tp": "setup_tensorpar_moe", "transformers": "setup_transformers_moe",
          "one": "setup_dense_moe"}


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, med, q3


def _rank(args) -> dict:
    from tensorpar.bench import hf_moe
    from tensorpar.bench.profiling import ops_per_step, summarize
    from tensorpar.bench.workload import Workload, batch

    group = tp.init_tensor_parallel()
    work = Workload(dim=args.dim, n_head=args.n_head, n_kv_head=args.n_kv_head,
                    n_layer=args.layers, vocab_size=args.vocab_size, seq_len=args.seq_len,
                    batch_size=args.batch_size)
    cpu = torch.device("cpu")
    steps = {k: getattr(hf_moe, fn)(work, {}, group, cpu) for k, fn in SETUPS.items()}
    ids, targets = batch(work, 0)
    for _ in range(2):
        for fn in steps.values():
            fn(ids, targets)
    wall: dict[str, list[float]] = {k: [] for k in steps}
    cpu_ms: dict[str, list[float]] = {k: [] for k in steps}
    names = list(steps)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            steps[name](ids, targets)
            cpu_ms[name].append(1e3 * (time.process_time() - cpu_start))
            dist.barrier()
            wall[name].append(1e3 * (time.perf_counter() - start))
    result = {"wall_ms": wall, "cpu_ms": cpu_ms, "categories": {}, "ops": {}}
    for name, fn in steps.items():
        dist.barrier()
        start = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.profile_steps):
                fn(ids, targets)
        summary = summarize(prof, time.perf_counter() - start, args.profile_steps)
        result["categories"][name] = summary["categories_ms_per_step"]
        result["ops"][name] = ops_per_step(prof, args.profile_steps)
    return result


def _report(res: list[dict], args) -> None:
    print(f"Qwen3-MoE width {args.dim}, {args.layers} layers, 8 experts top-2, TP = EP = 2, "
          f"batch {args.batch_size} x {args.seq_len}, {args.rounds} alternating rounds")
    for r, rank in enumerate(res):
        for name in SETUPS:
            w, c = _quartiles(rank["wall_ms"][name]), _quartiles(rank["cpu_ms"][name])
            print(f"  rank {r} {name:12s} wall {w[1]:7.1f} ms (IQR {w[0]:.1f}-{w[2]:.1f})   "
                  f"CPU {c[1]:6.1f} ms (IQR {c[0]:.1f}-{c[2]:.1f})")
    wall = {k: _quartiles(res[0]["wall_ms"][k])[1] for k in SETUPS}
    cpu = {k: max(_quartiles(r["cpu_ms"][k])[1] for r in res) for k in SETUPS}
    print(f"  tp / transformers: wall {wall['tp'] / wall['transformers']:.3f}, CPU (the busier "
          f"rank) {cpu['tp'] / cpu['transformers']:.3f}; tp CPU over half of one rank's: "
          f"{cpu['tp'] - cpu['one'] / 2:.1f} ms")
    cats = res[0]["categories"]
    print("  categories, self CPU ms a step (rank 0): " + " / ".join(SETUPS))
    for c in cats["tp"]:
        print(f"    {c:26s} " + " ".join(f"{cats[k][c]:9.1f}" for k in SETUPS))
    ops = res[0]["ops"]
    for name in SETUPS:
        calls = sum(v[1] for v in ops[name].values())
        print(f"  {name}: {calls:.0f} op calls a step; the top ops by self CPU ms (calls)")
        for op, (ms, n) in sorted(ops[name].items(), key=lambda kv: -kv[1][0])[:args.top]:
            print(f"    {op[:52]:52s} {ms:8.2f} ({n:4.0f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--n-kv-head", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    # one thread a rank, as the bench's ranks; no time limit: a crowded machine is slow
    with tp.RankPool(2, threads=1, timeout_s=None) as pool:
        res = pool.run(_rank, args)
    _report(res, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "ranks": res}, f, indent=1)


if __name__ == "__main__":
    main()
