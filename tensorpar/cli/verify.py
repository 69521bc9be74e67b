"""``tensorpar verify``: the parallel layers against the dense model, number by number.

Builds a dense model (vocab embedding, RMSNorm, GQA attention, LayerNorm, SwiGLU MLP, LM head and
cross-entropy) and its tensor-parallel twin through the ``from_dense`` constructors, runs forward
and backward on both, and reports, for the logits, the loss and every parameter gradient, the
largest relative error over all ranks; then the collectives each rank issued, against the count the
Megatron scheme prescribes. Exits non-zero on any mismatch.

    python -m tensorpar verify --tp 2
    python -m tensorpar verify --tp 4 --sequence-parallel
    torchrun --nproc-per-node 2 -m tensorpar verify --tp 2
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.cli.compare import TOLERANCE, check_config, dense_shard, max_rel_error
from tensorpar.parallel.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.parallel.embedding import VocabParallelEmbedding
from tensorpar.parallel.linear import ColumnParallelLinear
from tensorpar.parallel.norm import LayerNorm, RMSNorm
from tensorpar.ranks.checking import naming_layers
from tensorpar.ranks.local import run_ranks
from tensorpar.runtime.counting import KINDS, CollectiveCounter
from tensorpar.runtime.groups import device_for
from tensorpar.runtime.torchrun import say
from tensorpar.transformer.attention import ParallelSelfAttention, head_shards
from tensorpar.transformer.mlp import ParallelMLP
from tensorpar.transformer.reference import BlockConfig, DenseBlock


class ParallelBlock(nn.Module):
    """The tensor-parallel twin of :class:`DenseBlock`; attribute names match it."""

    def __init__(self, dense: DenseBlock, sequence_parallel: bool, group: ProcessGroup | None):
        super().__init__()
        sp = {"sequence_parallel": sequence_parallel, "group": group}
        a, m = dense.attn, dense.mlp
        self.emb = VocabParallelEmbedding.from_dense(dense.emb, **sp)
        self.norm1 = RMSNorm.from_dense(dense.norm1, **sp)
        self.attn = ParallelSelfAttention.from_dense(a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                                                     a.num_heads, a.num_kv_heads, **sp)
        self.norm2 = LayerNorm.from_dense(dense.norm2, **sp)
        self.mlp = ParallelMLP.from_dense(m.up, m.down, m.gate, activation="silu", **sp)
        self.norm_f = RMSNorm.from_dense(dense.norm_f, **sp)
        self.head = ColumnParallelLinear.from_dense(dense.head, **sp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        T = ids.shape[1]
        h = self.emb(ids)  # (B, T, D), or this rank's tensor_split shard (B, T_r, D) under SP
        h = h + self.attn(self.norm1(h), seq_len=T)
        h = h + self.mlp(self.norm2(h), seq_len=T)
        return self.head(self.norm_f(h), seq_len=T)  # (B, T, V_local): vocab-sharded logits


def expected_collectives(cfg: BlockConfig, n: int, sequence_parallel: bool,
                         keep_gathered_input: bool = False) -> dict:
    """Collectives per rank the scheme prescribes for one forward and one backward of the block.

    keep_gathered_input: the column layers keep their SP-gathered input for backward (the
    ``keep_gathered_input`` option of the layers) instead of re-gathering their shard there."""
    if n == 1:
        return {"forward": {}, "backward": {}}
    kv_shared = head_shards(cfg.num_heads, cfg.num_kv_heads, n, 0)[2]
    if not sequence_parallel:
        # forward: g in embedding, attention, MLP; loss: one all-gather (its statistics and
        #   target logits)
        # backward: f in attention, MLP, LM head (+ the shared-KV gradient sum)
        return {"forward": {"all_reduce": 3, "all_gather": 1},
                "backward": {"all_reduce": 3 + kv_shared}}
    # forward: reduce-scatter in embedding, attention, MLP; all-gather in attention, MLP, head;
    #   loss: one all-gather
    # backward: each of those swapped (3 all-gathers, 3 reduce-scatters), plus one all-reduce of
    #   replicated-weight gradients per norm (3) and the shared-KV gradient sum; and the column
    #   side of attention, MLP and head all-gathers the input shard it kept (3), as Megatron
    regather = 0 if keep_gathered_input else 3
    return {"forward": {"all_gather": 4, "reduce_scatter": 3},
            "backward": {"all_reduce": 3 + kv_shared, "all_gather": 3 + regather,
                         "reduce_scatter": 3}}


def verify_rank(cfg: BlockConfig, sequence_parallel: bool, seed: int,
                group: ProcessGroup | None = None) -> dict:
    """Run on every rank: dense and parallel forward/backward; errors and collective counts.

    Runs on this rank's GPU when the group uses NCCL, on the CPU otherwise.
    """
    device = device_for(group)
    torch.manual_seed(seed)
    dense = DenseBlock(cfg).to(device)
    ids = torch.randint(cfg.vocab_size, (cfg.batch_size, cfg.seq_len)).to(device)
    targets = torch.randint(cfg.vocab_size, (cfg.batch_size, cfg.seq_len)).to(device)
    logits = dense(ids)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()

    tp = ParallelBlock(dense, sequence_parallel, group)
    with naming_layers(tp):  # under the check mode a mismatch names the layer
        with CollectiveCounter() as fwd:
            logits_local = tp(ids)
            loss_tp = vocab_parallel_cross_entropy(logits_local, targets, group=group,
                                                   vocab_size=cfg.vocab_size)
        with CollectiveCounter() as bwd:
            loss_tp.backward()

    errors = {
        "logits": max_rel_error(logits_local, logits[..., tp.head.shard_start:tp.head.shard_stop]),
        "loss": max_rel_error(loss_tp, loss),
    }
    dense_params = dict(dense.named_parameters())
    for name, p in tp.named_parameters():
        ref = dense_params[name].grad
        errors[f"grad {name}"] = max_rel_error(p.grad, dense_shard(ref, p.tp_shard))
    shapes = {"logits": tuple(logits.shape), "loss": ()}
    shapes.update({f"grad {k}": tuple(v.shape) for k, v in dense_params.items()})
    return {"errors": errors, "shapes": shapes,
            "counts": {"forward": dict(fwd.counts), "backward": dict(bwd.counts)}}


def report(results: list[dict], cfg: BlockConfig, n: int, sequence_parallel: bool,
           write=print) -> bool:
    """Write (``write``: print) the error and collective tables from every rank's results; True
    when all agree."""
    ok = True
    mode = "on" if sequence_parallel else "off"
    write(f"tensorpar verify: TP={n}, sequence parallel {mode}, fp32, "
          f"tolerance {TOLERANCE:.0e} (max relative error over ranks)")
    names = list(results[0]["errors"])
    width = max(len(k) for k in names) + 2
    write(f"{'tensor':<{width}}{'dense shape':<16}{'max rel err':>12}")
    for name in names:
        err = max(r["errors"][name] for r in results)
        good = err <= TOLERANCE
        ok &= good
        shape = str(results[0]["shapes"][name])
        write(f"{name:<{width}}{shape:<16}{err:>12.2e}  {'ok' if good else 'MISMATCH'}")
    expected = expected_collectives(cfg, n, sequence_parallel)
    write(f"\ncollectives per rank   {'forward':>9} {'expected':>9}   {'backward':>9} "
          f"{'expected':>9}")
    for kind in KINDS:
        row, good = f"{kind:<22}", True
        for phase in ("forward", "backward"):
            got = {r["counts"][phase].get(kind, 0) for r in results}
            want = expected[phase].get(kind, 0)
            good &= got == {want}
            shown = "/".join(str(g) for g in sorted(got))
            row += f" {shown:>9} {want:>9}  "
        ok &= good
        write((row + ("" if good else "MISMATCH")).rstrip())
    write("\nall outputs, gradients and collective counts match" if ok else "\nMISMATCH found")
    return ok


def run_verify(n: int, sequence_parallel: bool, seed: int, cfg: BlockConfig) -> bool:
    """Spawn n ranks (or use the torchrun ranks this process is part of) and verify."""
    check_config(cfg, n, sequence_parallel)
    results = run_ranks(verify_rank, n, cfg, sequence_parallel, seed)
    # under torchrun every rank judges (and exits) alike; rank 0 prints the tables
    return report(results, cfg, n, sequence_parallel, say)



# the block's sizes under train's flag names (the dataclass's own names stay as aliases)
TRAIN_NAMES = {"num_heads": "--n-head", "num_kv_heads": "--n-kv-head"}


def add_parser(sub) -> None:
    p = sub.add_parser("verify", help="compare the TP layers with the dense model, print errors "
                       "and collective counts; exit 1 on any mismatch")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size: ranks spawned "
                   "(default 2)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="also shard the sequence (default off)")
    p.add_argument("--hf", metavar="PATH", help="instead: a local Hugging Face model directory, "
                   "loaded tensor-parallel and compared layer by layer with the dense model "
                   "(default: tensorpar's own block)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data (default 0)")
    p.add_argument("--pp", type=int, default=1, help="instead: tensorpar's GPT cut into N "
                   "pipeline stages (pp x tp ranks), one step of the trainer's schedule against "
                   "the whole model on one rank, and each rank's sends and receives counted "
                   "(default 1: the one-block check)")
    p.add_argument("--pp-virtual", type=int, default=1,
                   help="with --pp: stages per pipeline rank, interleaved (default 1)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="with --pp: micro-batches in the step (default 2 x --pp)")
    p.add_argument("--n-layer", type=int, default=None,
                   help="with --pp: the GPT's blocks (default 2 x pp x virtual - 1: a cut "
                   "that is not even)")
    for f in dataclasses.fields(BlockConfig):
        extra = " (with --pp: a micro-batch's)" if f.name == "batch_size" else ""
        old = f"--{f.name.replace('_', '-')}"  # --num-heads: kept, an alias of train's name
        names = [TRAIN_NAMES[f.name], old] if f.name in TRAIN_NAMES else [old]
        p.add_argument(*names, type=int, default=f.default, dest=f.name,
                       help=f"{f.metadata['help']}{extra} (default {f.default})")
    p.set_defaults(func=run, check_collectives_by_default=True)


def run(args) -> int:
    """``tensorpar verify``: 0 when every error is within tolerance and every count as
    expected, else 1."""
    piped = args.pp != 1 or args.pp_virtual != 1
    if not piped and (args.micro_batches is not None or args.n_layer is not None):
        raise ValueError("--micro-batches and --n-layer are for a pipeline: give --pp N")
    if args.hf:
        if piped:
            raise ValueError("verify --hf with --pp: pipeline stages are built for tensorpar's "
                             "GPT (train --pp refuses --hf too)")
        from tensorpar.cli.verify_hf import run_verify_hf

        return 0 if run_verify_hf(args.hf, args.tp, args.seed) else 1
    sizes = BlockConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BlockConfig)})
    if piped:
        from tensorpar.cli.verify_pipeline import pipeline_check, run_verify_pipeline

        return 0 if run_verify_pipeline(pipeline_check(args, sizes), args.seed) else 1
    return 0 if run_verify(args.tp, args.sequence_parallel, args.seed, sizes) else 1
