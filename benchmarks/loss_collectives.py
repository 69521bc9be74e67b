"""The vocab-parallel loss against the loss of an earlier revision, at the bench's shapes.

Times forward + backward of ``vocab_parallel_cross_entropy`` as the GPT calls it (``vocab_size``
given, ``reuse_logits``) on B4 x T256 logits of a vocabulary of 8192 split over the ranks, one
thread per rank (the bench's setting), against the same function taken from git revision
``--old`` (default 0bb7385, the last whose loss made an all-gather and an all-reduce; since then
the target logits travel in the all-gather). The two alternate in ``ROUNDS`` rounds of ``REPS``
calls; rank 0 prints each one's median per call and both losses, which must be equal::

    python benchmarks/loss_collectives.py [--tp 2] [--old REV]
"""

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tensorpar.parallel.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.parallel.sharding import shard_sizes
from tensorpar.ranks.local import launch
from tensorpar.runtime.groups import tp_rank, tp_size

B, T, V = 4, 256, 8192
ROUNDS, REPS = 15, 20


def _time_both(old_source: str) -> dict:
    torch.set_num_threads(1)  # as the bench's ranks (launch gives each rank cores / ranks)
    with tempfile.TemporaryDirectory() as tmp:  # the old module, imported under its own name
        path = Path(tmp, "old_cross_entropy.py")
        path.write_text(old_source)
        spec = importlib.util.spec_from_file_location("old_cross_entropy", path)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    fns = {"old": old.vocab_parallel_cross_entropy, "new": vocab_parallel_cross_entropy}
    torch.manual_seed(0)
    logits = torch.randn(B, T, shard_sizes(V, tp_size())[tp_rank()], requires_grad=True)
    target = torch.randint(V, (B, T))
    times, losses = {k: [] for k in fns}, {}
    for r in range(ROUNDS):
        for name in (["old", "new"] if r % 2 else ["new", "old"]):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(REPS):
                loss = fns[name](logits * 1, target, vocab_size=V, reuse_logits=True)
                loss.backward()
            times[name].append((time.perf_counter() - start) / REPS * 1e3)
            losses[name] = loss.item()
    return {name: (statistics.median(t), losses[name]) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--old", default="0bb7385", help="git revision of the loss to compare")
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    old_source = subprocess.run(
        ["git", "show", f"{args.old}:tensorpar/parallel/cross_entropy.py"], cwd=root,
        capture_output=True, text=True, check=True).stdout
    results = launch(_time_both, args.tp, old_source)[0]
    print(f"vocab-parallel loss, forward + backward, {args.tp} ranks, B{B} x T{T}, vocab {V}, "
          f"median of {ROUNDS} rounds of {REPS} calls (rank 0):")
    for name, (ms, loss) in results.items():
        label = f"{args.old} (old)" if name == "old" else "this checkout"
        print(f"  {label:24} {ms:7.2f} ms   loss {loss!r}")
    if results["old"][1] != results["new"][1]:
        sys.exit("the losses differ")


if __name__ == "__main__":
    main()
