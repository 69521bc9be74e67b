"""What a sequence-parallel column layer pays for not being told the full length.

Under SP a rank holds its ``tensor_split`` shard of the T tokens and cannot know the other ranks'
sizes. Called with ``seq_len=T`` (the GPT passes it) the layer all-gathers the shards at once;
without it the ranks first exchange their sizes, one all-gather of an int64 per rank. This times
the forward of an SP ``ColumnParallelLinear`` both ways on gloo (median of ``REPS`` calls on
rank 0, after warm-up; the two ways alternate twice and the second round is kept)::

    python benchmarks/sp_size_exchange.py [--tp 2]
"""

import argparse
import time

import torch

from tensorpar import ColumnParallelLinear
from tensorpar.parallel.sharding import shard_sizes
from tensorpar.ranks.local import run_ranks
from tensorpar.runtime.groups import tp_rank, tp_size

SHAPES = [(1, 64, 64, 200), (4, 256, 256, 200), (4, 1024, 1024, 20)]  # B, T, D, calls


def _median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e6


def _rank(B: int, T: int, D: int, reps: int) -> dict:
    torch.manual_seed(0)
    layer = ColumnParallelLinear(D, D, sequence_parallel=True)
    x = torch.randn(B, shard_sizes(T, tp_size())[tp_rank()], D)
    out = {}
    with torch.no_grad():
        for name, kw in (("told", {"seq_len": T}), ("exchanged", {})) * 2:
            for _ in range(5):
                layer(x, **kw)
            out[name] = _median_us(lambda kw=kw: layer(x, **kw), reps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="ranks (default 2)")
    args = parser.parse_args()
    print(f"SP ColumnParallelLinear forward, TP={args.tp}, gloo: median per call")
    for B, T, D, reps in SHAPES:
        got = run_ranks(_rank, args.tp, B, T, D, reps)[0]
        print(f"B={B} T={T} D={D}: told {got['told'] / 1e3:.1f} ms, "
              f"exchanged {got['exchanged'] / 1e3:.1f} ms")


if __name__ == "__main__":
    main()
