"""``tensorpar verify --pp N``: one pipelined step of the GPT against the whole model on one
device, number by number, and the transfers each rank made against the analytic count.

The GPT is the default one, its head tied to its embedding (the table on the first and the
last stage, its gradient summed over the two). Every rank builds the whole GPT at TP=1 (its own
one-rank group) and runs forward and backward on
the step's batch: the reference. Then its part of the pipelined model, the stages of its
pipeline rank (``gpt/stages.py``) split over its TP group, runs the same batch under the
trainer's schedule (``train/pipeline.py``: torch's 1F1B, or the interleaved schedule with
``--pp-virtual``) in ``--micro-batches`` micro-batches. The report gives the loss's error and
every gradient's (each rank against its slice of the reference), then, for each pipeline rank,
the sends, receives and all-reduces of the step against ``planner.pipeline.p2p`` and
``tied_sync``, and the TP collectives
against ``planner.pipeline.rank_tp_comm``. Exits non-zero on any mismatch.

    python -m tensorpar verify --pp 2
    python -m tensorpar verify --pp 2 --tp 2 --sequence-parallel
    python -m tensorpar verify --pp 2 --pp-virtual 2 --micro-batches 4
    torchrun --nproc-per-node 4 -m tensorpar verify --pp 2 --tp 2
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tensorpar.cli.compare import TOLERANCE, check_config, dense_shard, max_rel_error
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.gpt.stages import GPTStage, describe_split, rank_part
from tensorpar.parallel.ownership import ShardOwnership, clip_grad_norm_
from tensorpar.parallel.stages import check_pipeline
from tensorpar.planner.pipeline import add_transfers, rank_tp_comm, step_transfers, tied_sync
from tensorpar.planner.step import Step
from tensorpar.ranks.local import run_ranks
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.runtime.groups import device_for
from tensorpar.runtime.torchrun import say
from tensorpar.train.config import TrainConfig
from tensorpar.train.pipeline import PipelineParts, Schedule
from tensorpar.train.shape import gpt_shape
from tensorpar.transformer.reference import BlockConfig

PP_KINDS = ("send", "recv", "all_reduce")  # the transfers; the loss and the norm summed over pp
TP_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass
class PipelineCheck:
    """What ``verify --pp`` runs: the model's sizes (``sizes``, ``--batch-size`` rows a
    micro-batch), ``n_layer`` blocks cut into ``pp`` x ``virtual`` stages, ``micro_batches``
    per step, each stage over ``tp`` ranks."""

    sizes: BlockConfig
    n_layer: int
    pp: int
    virtual: int
    micro_batches: int
    tp: int
    sequence_parallel: bool

    @property
    def model(self) -> GPTConfig:
        s = self.sizes  # the default GPT: its head tied to the embedding (first, last stage)
        return GPTConfig(vocab_size=s.vocab_size, n_layer=self.n_layer, dim=s.dim,
                         n_head=s.num_heads, n_kv_head=s.num_kv_heads, hidden_dim=s.hidden_dim)

    @property
    def batch(self) -> int:
        return self.sizes.batch_size * self.micro_batches

    @property
    def step(self) -> Step:
        """The step as the planner sees it (fp32, one data-parallel copy)."""
        return Step(gpt_shape(self.model), self.tp, self.batch, self.sizes.seq_len, "fp32",
                    self.sequence_parallel, pp=self.pp, virtual=self.virtual,
                    micro_batches=self.micro_batches)

    def check(self) -> None:
        """ValueError, naming the numbers, before any rank starts."""
        check_config(self.sizes, self.tp, self.sequence_parallel)
        self.model.check(self.tp)
        check_pipeline(self.pp, self.virtual, self.n_layer, self.micro_batches)
        self.train_config()

    def train_config(self) -> TrainConfig:
        """The trainer's flags for this step (the schedule reads its shapes from them)."""
        return TrainConfig(tp=self.tp, dp=1, pp=self.pp, pp_virtual=self.virtual,
                           batch_size=self.batch, micro_batch_size=self.sizes.batch_size,
                           seq_len=self.sizes.seq_len,
                           sequence_parallel=self.sequence_parallel)


def expected_transfers(check: PipelineCheck, pp_rank: int, tp_rank: int) -> dict:
    """What pipeline rank ``pp_rank`` (TP rank ``tp_rank``) sends, receives and all-reduces
    over pp in the step (``planner.pipeline.step_transfers``, and ``tied_sync``: the tied
    table's gradient sum)."""
    s = check.sizes
    sent = step_transfers(check.pp, check.virtual, check.micro_batches, pp_rank, s.batch_size,
                          s.seq_len, s.dim, check.tp, check.sequence_parallel, tp_rank)
    return add_transfers(sent, tied_sync(check.step, pp_rank, tp_rank))


def expected_tp(check: PipelineCheck, pp_rank: int) -> dict[str, int]:
    """The TP collectives of pipeline rank ``pp_rank``'s stages in the step."""
    if check.tp == 1:
        return {}
    part = rank_part(check.n_layer, check.pp, check.virtual, pp_rank)[2]
    return rank_tp_comm(check.step, len(part["blocks"]), part["embed"],
                        part["head"])["counts"]


def verify_pipeline_rank(check: PipelineCheck, seed: int,
                         group: ProcessGroup | None = None) -> dict:
    """Run on every rank: the whole model's step and this rank's pipelined step; the errors and
    the transfers counted."""
    from torch.distributed.device_mesh import init_device_mesh

    device = device_for(group)
    mesh = init_device_mesh(device.type, (check.pp, 1, check.tp),
                            mesh_dim_names=("pp", "dp", "tp"))
    pp_group, tp_group = mesh["pp"].get_group(), mesh["tp"].get_group()
    pp_rank, tp_rank = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    alone, _ = dist.new_subgroups(group_size=1)  # this rank by itself: the reference's TP=1
    cfg, s = check.model, check.sizes
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(s.vocab_size, (check.batch, s.seq_len), generator=gen).to(device)
    targets = torch.randint(s.vocab_size, (check.batch, s.seq_len), generator=gen).to(device)

    whole = GPT(cfg, alone, seed=seed, device=device)
    loss = whole(ids, targets)
    loss.backward()

    mine, ranges, held = rank_part(check.n_layer, check.pp, check.virtual, pp_rank)
    part = GPT(cfg, tp_group, check.sequence_parallel, seed=seed, device=device, **held)
    stages = [GPTStage(part, st, len(ranges), ranges[st]) for st in mine]
    schedule = Schedule(check.train_config(), PipelineParts(part, stages), stages, mesh, device,
                        check.micro_batches, s.vocab_size, torch.float32)
    tokens = torch.tensor(float(targets.numel()), device=device)
    ownership = ShardOwnership.gather(part, tp_group)
    schedule.step(ids, targets, tokens)  # the first step sets up its transfers (not counted)
    part.zero_grad()
    counter = CollectiveCounter({"pp": schedule.groups(), "tp": tp_group})
    with counter:  # a steady step, as the trainer's summary counts it, and its gradient norm
        loss_pp = schedule.step(ids, targets, tokens)
        norm = clip_grad_norm_(part, ownership, float("inf"), tp_group, pp_group=pp_group)

    errors = {"loss": max_rel_error(loss_pp, loss)}
    reference = dict(whole.named_parameters())
    for name, p in part.named_parameters():
        errors[f"grad {name}"] = max_rel_error(p.grad, dense_shard(reference[name].grad,
                                                                   p.tp_shard))
    errors["gradient norm"] = max_rel_error(norm, torch.stack(
        [p.grad.double().pow(2).sum() for p in whole.parameters()]).sum().sqrt())
    shapes = {"loss": (), "gradient norm": ()} | {f"grad {k}": tuple(v.shape)
                                               for k, v in reference.items()}
    got = {label: {k: dict(v) for k, v in counter.by_group.get(label, {}).items()}
           for label in ("pp", "tp")}
    return {"errors": errors, "shapes": shapes, "pp_rank": pp_rank, "tp_rank": tp_rank,
            "counts": got}


def report_pipeline(results: list[dict], check: PipelineCheck, write=print) -> bool:
    """The error table (a gradient's error: the largest over the ranks that hold it), then
    each pipeline rank's transfers and TP collectives against the analytic counts; True when
    all agree."""
    write(f"tensorpar verify: PP={check.pp}"
          + (f" x {check.virtual} virtual" if check.virtual > 1 else "")
          + f", TP={check.tp}, sequence parallel {'on' if check.sequence_parallel else 'off'}, "
          f"{check.micro_batches} micro-batches of {check.sizes.batch_size}, fp32, tolerance "
          f"{TOLERANCE:.0e} (max relative error over ranks, against the whole model on one "
          "rank)")
    write(describe_split(check.n_layer, check.pp, check.virtual))
    names = sorted(dict.fromkeys(k for r in results for k in r["errors"]),
                   key=lambda k: k == "gradient norm")  # the stages' tensors, then the norm
    width = max(len(k) for k in names) + 2
    write(f"{'tensor':<{width}}{'dense shape':<16}{'max rel err':>12}")
    ok = True
    for name in names:
        err = max(r["errors"][name] for r in results if name in r["errors"])
        ok &= err <= TOLERANCE
        shape = str(results[0]["shapes"][name])
        write(f"{name:<{width}}{shape:<16}{err:>12.2e}  "
              f"{'ok' if err <= TOLERANCE else 'MISMATCH'}")
    rows = [("pp", k, "counts") for k in PP_KINDS] + [("pp", k, "bytes")
                                                      for k in ("send", "all_reduce")]
    rows += [("tp", k, "counts") for k in TP_KINDS] if check.tp > 1 else []
    write("\nper step, each pipeline rank (measured / analytic)")
    write(f"{'':<22}" + "".join(f"  {f'pp rank {p}':>26}" for p in range(check.pp)))
    expected = [_expected(check, r["pp_rank"], r["tp_rank"]) for r in results]  # once a rank
    for label, kind, what in rows:
        line, good = f"{f'{label} {kind}' + (' bytes' if what == 'bytes' else ''):<22}", True
        for p in range(check.pp):  # every TP rank of pipeline rank p against its own count
            pairs = [(r["counts"][label].get(what, {}).get(kind, 0),
                      want[label][what].get(kind, 0))
                     for r, want in zip(results, expected, strict=True) if r["pp_rank"] == p]
            good &= all(got == want for got, want in pairs)
            got, want = (sorted({pair[i] for pair in pairs}) for i in (0, 1))
            line += f"  {'/'.join(map(str, got)) + ' / ' + '/'.join(map(str, want)):>26}"
        ok &= good
        write(line + ("" if good else "  MISMATCH"))
    write("\nthe loss, every gradient and every transfer match" if ok else "\nMISMATCH found")
    return ok


def _expected(check: PipelineCheck, pp_rank: int, tp_rank: int) -> dict:
    """The analytic counts of one rank, as its measured ``counts``: {"pp": {"counts": ...,
    "bytes": ...}, "tp": {"counts": ...}}."""
    return {"pp": expected_transfers(check, pp_rank, tp_rank),
            "tp": {"counts": expected_tp(check, pp_rank)}}


def run_verify_pipeline(check: PipelineCheck, seed: int) -> bool:
    """Spawn pp x tp ranks (or use the torchrun ranks this process is part of) and verify."""
    check.check()
    results = run_ranks(verify_pipeline_rank, check.pp * check.tp, check, seed)
    return report_pipeline(results, check, say)


def pipeline_check(args, sizes: BlockConfig) -> PipelineCheck:
    """``verify``'s flags as a ``PipelineCheck``: by default 2 x pp x virtual - 1 blocks (an
    uneven cut) and 2 x pp micro-batches."""
    stages = args.pp * args.pp_virtual
    return PipelineCheck(sizes, args.n_layer or 2 * stages - 1, args.pp, args.pp_virtual,
                         args.micro_batches or 2 * args.pp, args.tp, args.sequence_parallel)

