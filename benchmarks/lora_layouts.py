"""The LoRA adapters' own matmuls of one step, in two layouts of the products z = x A^T.

    python benchmarks/lora_layouts.py --dims 768 1024

For the bench's Llama at TP=2 (4 blocks; per rank q D/2, k and v 128, gate and up 1,024
outputs; o and down row layers; rank 8, batch 8 x 128 = N tokens), one thread, the matmuls an
adapter adds to a step (forward z and the update, backward dz, dB, dA and A^T dz in dx), in
the layout ``lora.py`` and ``fused.py`` used before (z (N, r): dB = dy^T z, dz = dy B) and the
one they use now (z^T (r, N): dB = (z^T dy)^T, dz^T = B^T dy^T). The two layouts alternate;
prints the minimum and the median of the step totals, in CPU time of the process (one thread:
its compute, without the waits for a core that a loaded machine adds). The values are the
same; only the operands' memory order differs, which on CPU decides which kernel runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

N, R, S = 8 * 128, 8, 2.0


def _tensors(dim: int, seed: int = 0):
    """(column ops, row layers) of one block: each column op (x, [A_j], [B_j], [dy_j], dx),
    each row layer (x_i, A_i, B, dy, dx_i)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    columns = [[dim // 2, 128, 128], [1024, 1024]]  # q, k, v; gate, up (per rank)
    rows = [(dim // 2, dim), (1024, dim)]  # o, down: (in_i, out)
    cols = [(rnd(N, dim), [rnd(R, dim) for _ in o], [rnd(n, R) for n in o],
             [rnd(N, n) for n in o], rnd(N, dim)) for o in columns]
    return cols, [(rnd(N, i), rnd(R, i), rnd(o, R), rnd(N, o), rnd(N, i)) for i, o in rows]


def tokens_first(cols, rows) -> None:
    """z (N, r): the layout before."""
    for x, a, b, dys, dx in cols:
        a_cat = torch.cat(a)
        z = x.mm(a_cat.t())
        dz = torch.empty(N, a_cat.shape[0])
        for j, (b_j, dy) in enumerate(zip(b, dys, strict=True)):
            c = slice(j * R, (j + 1) * R)
            dy.addmm_(z[:, c], b_j.t(), alpha=S)  # the update (dy stands in for y)
            dz[:, c].addmm_(dy, b_j, beta=0, alpha=S)
            b_j.new_empty(b_j.shape).addmm_(dy.t(), z[:, c], beta=0, alpha=S)  # dB
        dx.addmm_(dz, a_cat)
        dz.t().mm(x)  # dA
    for x, a, b, dy, dx in rows:
        z = x.mm(a.t())
        dy.addmm_(z, b.t(), alpha=S)
        dz = dy.mm(b).mul_(S)
        dy.t().mm(z).mul_(S)  # dB
        dz.t().mm(x)  # dA
        dx.addmm_(dz, a)


def tokens_last(cols, rows) -> None:
    """z^T (r, N): the layout now."""
    for x, a, b, dys, dx in cols:
        a_cat = torch.cat(a)
        zt = a_cat.mm(x.t())
        dzt = torch.empty(a_cat.shape[0], N)
        for j, (b_j, dy) in enumerate(zip(b, dys, strict=True)):
            c = slice(j * R, (j + 1) * R)
            dy.addmm_(zt[c].t(), b_j.t(), alpha=S)
            dzt[c].addmm_(b_j.t(), dy.t(), beta=0, alpha=S)
            torch.mm(zt[c], dy).mul_(S).t().contiguous()  # dB
        dx.addmm_(dzt.t(), a_cat)
        dzt.mm(x)  # dA
    for x, a, b, dy, dx in rows:
        zt = a.mm(x.t())
        dy.addmm_(zt.t(), b.t(), alpha=S)
        dzt = b.t().mm(dy.t()).mul_(S)
        zt.mm(dy).mul_(S).t().contiguous()  # dB
        dzt.mm(x)  # dA
        dx.addmm_(dzt.t(), a)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", type=int, nargs="+", default=[768, 1024])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)  # as each rank of the bench
    for dim in args.dims:
        block = _tensors(dim)
        times: dict[str, list[float]] = {"tokens first (before)": [], "tokens last (now)": []}
        fns = dict(zip(times, (tokens_first, tokens_last), strict=True))
        for i in range(args.repeats + 2):
            for name in (list(times) if i % 2 else list(times)[::-1]):
                start = time.process_time()
                for _ in range(args.layers):
                    fns[name](*block)
                if i >= 2:  # two warm-ups
                    times[name].append(1e3 * (time.process_time() - start))
        for name, ts in times.items():
            print(f"width {dim}, {name}: min {min(ts):.1f} ms, median "
                  f"{statistics.median(ts):.1f} ms CPU a step")


if __name__ == "__main__":
    main()
