"""Where a LoRA step's time goes, against a full fine-tuning step of the same converted Llama.

    python benchmarks/lora_profile.py --dim 768 --rounds 20 --out lora-768.json
    python benchmarks/lora_profile.py --dim 1024 --rounds 12 --profile-steps 3 --out lora-1024.json

Both steps run in the same 2 ranks (TP=2, gloo): the bench's Llama (``tensorpar.bench``'s
``Workload``: ``--dim``, 4 blocks, 12 heads, 4 KV heads, SwiGLU hidden 2,048, vocabulary 8,192)
converted by ``tensorpar.parallelize`` and trained as a user's loop does (``labels=``, AdamW,
the bench's ``hf-llama-labels`` step), every weight trained ("full") or LoRA adapters of rank 8
on every block projection, no adapter dropout ("lora"), on batches of 8 x 128 tokens. After 2
warm-up steps each, ``--rounds`` rounds time one step of each, their order alternating, every
step between two barriers (its wall time, and the rank's CPU time: what a loaded machine
stretches least); then ``--profile-steps`` steps of each under ``torch.profiler``
(per-op self CPU time on rank 0, the bench's categories) and one step of each under
``CollectiveCounter``. Prints the medians, IQRs and the ratio, the categories and the ops whose
time differs most; ``--out`` writes it all as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import tensorpar as tp


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, med, q3


def _rank(args) -> dict:
    from tensorpar.bench.hf_llama import setup_hf_llama_labels
    from tensorpar.bench.profiling import ops_per_step, summarize
    from tensorpar.bench.workload import Workload, batch, dense_state

    group = tp.init_tensor_parallel()
    work = Workload(dim=args.dim, n_head=args.n_head, n_kv_head=args.n_kv_head,
                    n_layer=args.layers, hidden_dim=args.hidden_dim, seq_len=args.seq_len,
                    batch_size=args.batch_size)
    state = dense_state(work)
    cpu = torch.device("cpu")
    steps = {"full": setup_hf_llama_labels(work, state, group, cpu),
             "lora": setup_hf_llama_labels(work, state, group, cpu, lora_rank=args.rank)}
    ids, targets = batch(work, 0)
    for _ in range(2):
        for fn in steps.values():
            fn(ids, targets)
    times: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [] for k in steps}  # this rank's CPU time, all threads
    for r in range(args.rounds):
        for name in (("full", "lora") if r % 2 == 0 else ("lora", "full")):
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            steps[name](ids, targets)
            cpu[name].append(1e3 * (time.process_time() - cpu_start))
            dist.barrier()
            times[name].append(1e3 * (time.perf_counter() - start))
    result = {"times_ms": times, "cpu_ms": cpu, "profile": {}, "ops": {}, "collectives": {}}
    for name, fn in steps.items():
        if args.profile_steps:
            dist.barrier()
            start = time.perf_counter()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(args.profile_steps):
                    fn(ids, targets)
            result["profile"][name] = summarize(prof, time.perf_counter() - start,
                                                args.profile_steps, top=25)
            result["ops"][name] = ops_per_step(prof, args.profile_steps)
        with tp.CollectiveCounter() as counter:
            fn(ids, targets)
        result["collectives"][name] = {k: [counter.counts[k], counter.bytes[k]]
                                       for k in counter.counts}
    return result


def _report(res: dict, args) -> None:
    print(f"width {args.dim}, {args.layers} blocks, TP=2, batch {args.batch_size} x "
          f"{args.seq_len}, LoRA rank {args.rank}, {args.rounds} alternating rounds")
    q = {k: _quartiles(v) for k, v in res["times_ms"].items()}
    for k, (q1, med, q3) in q.items():
        print(f"  {k}: median {med:.1f} ms (IQR {q1:.1f}-{q3:.1f})")
    ratios = [b / a for a, b in zip(res["times_ms"]["full"], res["times_ms"]["lora"],
                                    strict=True)]
    print(f"  lora / full: {q['lora'][1] / q['full'][1]:.3f} of medians; per round median "
          f"{statistics.median(ratios):.3f}")
    cpu = {k: statistics.median(v) for k, v in res["cpu_ms"].items()}
    print(f"  CPU time a step (rank 0, its threads; robust to a loaded machine): full "
          f"{cpu['full']:.1f} ms, lora {cpu['lora']:.1f} ms, {cpu['lora'] / cpu['full']:.3f}")
    for k, c in res["collectives"].items():
        print(f"  {k} collectives: " + ", ".join(f"{kind} {n} ({b / 2**20:.2f} MiB)"
                                                for kind, (n, b) in sorted(c.items())))
    if not res["profile"]:
        return
    print("  categories, self CPU ms a step (rank 0): full / lora")
    cats = res["profile"]["full"]["categories_ms_per_step"]
    lora_cats = res["profile"]["lora"]["categories_ms_per_step"]
    for c in cats:
        print(f"    {c:26s} {cats[c]:9.1f} {lora_cats[c]:9.1f}")
    full, lora = res["ops"]["full"], res["ops"]["lora"]
    names = sorted(set(full) | set(lora),
                   key=lambda n: -abs(lora.get(n, [0, 0])[0] - full.get(n, [0, 0])[0]))
    print("  ops by |lora - full| self CPU ms a step: full ms (calls) / lora ms (calls)")
    for n in names[:25]:
        f, g = full.get(n, [0.0, 0.0]), lora.get(n, [0.0, 0.0])
        print(f"    {n[:48]:48s} {f[0]:8.1f} ({f[1]:5.0f}) {g[0]:8.1f} ({g[1]:5.0f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-kv-head", type=int, default=4)
    p.add_argument("--hidden-dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    # one thread a rank, as the bench's ranks; no time limit: a crowded machine is slow
    with tp.RankPool(2, threads=1, timeout_s=None) as pool:
        res = pool.run(_rank, args)[0]
    _report(res, args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), **res}, f, indent=1)


if __name__ == "__main__":
    main()
