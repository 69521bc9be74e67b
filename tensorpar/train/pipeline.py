"""Pipeline parallelism in the trainer (``--pp N``): the GPT's stages on a ("pp", "dp", "tp")
mesh, scheduled by ``torch.distributed.pipelining``.

Each pipeline rank builds its part of the GPT (``gpt/stages.py``): its stages' blocks, the
embedding on the rank of the first stage, the final norm and head on the rank of the last. The
micro-batches are gradient accumulation's passes (``--micro-batch-size``): the step's batch on
this dp rank, split into m = (--batch-size / --dp) / --micro-batch-size rows each. torch's
``Schedule1F1B`` runs them (``ScheduleInterleaved1F1B`` with ``--pp-virtual V``: V stages per
rank), so at most about pp micro-batches are in flight on the first rank.

The loss is exact, as accumulation's: the last stage's loss function sums each micro-batch's
token losses and divides by the step's target count on this dp rank (``num_tokens``, the same
``loss_tokens`` rule as ``loop.Run.step``), with the schedule's own scaling off
(``scale_grads=False``); the step's loss is the sum of the micro-batches' on the last rank,
all-reduced over the pipeline so that every rank holds it. The gradient norm sums the squares of
every stage (``clip_grad_norm_``'s ``pp_group``).

The stages' shapes are given (``input_args``, ``output_args``), so the schedule never runs a
forward to find them (which would take dropout keys and, under DDP, run a forward outside
``no_sync``). FSDP2 shards each block and each stage's own parameters (embedding; norm and head)
over dp without resharding after forward (a stage runs m forwards before its backwards: gathering
again for each would cost m - 1 all-gathers); the schedule reduce-scatters once, after the
stage's last backward. DDP wraps each stage; the schedule holds its all-reduce back to the last
backward.

A tied head (the default GPT's): the first and the last stage each hold the embedding table
(``gpt/stages.py``); after the schedule's last backward each holds a part of its gradient (the
lookup's, the head's), summed by one all-reduce over the embedding group, the first and the last
pipeline rank of this rank's (dp, tp) coordinate, before the gradient norm (which counts the
table once, on the first stage) and the optimizer: both copies get the one table's gradient of
the run without a pipeline and stay equal.

Point to point: each stage boundary carries one activation forward and one gradient backward
per micro-batch, (B/m, T, D) fp32 each (T / tp tokens under sequence parallelism), so a step
sends 2 · m · (S - 1) tensors over its S = pp · V stages (``planner.pipeline.p2p``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tensorpar.gpt.stages import GPTStage, rank_part
from tensorpar.mesh.experts import ignore_experts_in_ddp, split_expert_params
from tensorpar.mesh.mesh import replica_mesh
from tensorpar.parallel.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.parallel.sharding import shard_sizes
from tensorpar.parallel.stages import is_stage_copy, mark_stage_copy
from tensorpar.runtime.dtensors import local_part
from tensorpar.runtime.groups import tp_size


def transfer_group(mesh) -> dist.ProcessGroup:
    """This rank's pipeline ranks again, as a group for the schedule's sends and receives alone.

    A middle stage sends and receives twice as many tensors as an end stage, and torch's check
    mode (``--check-collectives``: its ProcessGroupWrapper) numbers point-to-point operations
    and collectives in one sequence per group: on a group that carried both, the step's loss
    all-reduce would then be found "mismatched" across pipeline ranks. The collectives over the
    pipeline (the loss, the gradient norm, a checkpoint's agreement) stay on ``mesh["pp"]``.
    Called on every rank alike (each group is created by all ranks)."""
    pp = mesh["pp"].size()
    ranks = mesh.mesh.movedim(0, -1).reshape(-1, pp).tolist()  # each (dp, tp) pair's pipeline
    group, _ = dist.new_subgroups_by_enumeration(ranks)
    return group


def embedding_group(mesh) -> dist.ProcessGroup:
    """The first and the last pipeline rank of this rank's (dp, tp) coordinate: the two ranks
    that hold a tied embedding table (the embedding of stage 0, the head of stage S - 1), whose
    gradients are summed over it once a step. Called on every rank alike."""
    pp = mesh["pp"].size()
    ranks = mesh.mesh.movedim(0, -1).reshape(-1, pp)[:, [0, pp - 1]].tolist()
    group, _ = dist.new_subgroups_by_enumeration(ranks)
    return group


def tied_tables(parts: PipelineParts) -> list[nn.Parameter]:
    """The tied embedding table this rank holds (its first or last stage's), or none."""
    net = parts.net
    held = any(s.first or s.last for s in parts.stages)
    tied = net.cfg.tie_embeddings and net.embed is not None and held
    return [net.embed.weight] if tied else []


@dataclass
class PipelineParts:
    """What a pipeline rank holds: ``net``, its part of the GPT (every parameter under its name
    in the whole model: the optimizer, the shard ownership, the norm and checkpoints use it),
    and ``stages``, the ``GPTStage`` modules the schedule runs (over the same modules)."""

    net: nn.Module
    stages: list[GPTStage]


def build_parts(recipe, cfg, group, dp_rank: int, device: torch.device, pp_rank: int,
                **extra):
    """This rank's part of the GPT and its stages; with the recipe's per-step callback.
    extra: more of what ``recipe.build`` takes (the MoE blocks' ``experts``; ``cp_group`` under
    context parallelism)."""
    mine, ranges, part = rank_part(recipe.model_cfg.n_layer, cfg.pp, cfg.pp_virtual, pp_rank)
    net, at_step = recipe.build(cfg, group, dp_rank, device, **part, **extra)
    stages = [GPTStage(net, s, len(ranges), ranges[s]) for s in mine]
    return PipelineParts(net, stages), at_step


def shard_stages(parts: PipelineParts, mesh, mode: str,
                 param_dtype: torch.dtype | None) -> list[nn.Module]:
    """The stage modules the schedule calls, data-parallel over ``mesh["dp"]``: FSDP2 (each
    block, then each stage's own parameters, kept gathered between forwards) or DDP (each stage
    wrapped). Without data parallelism, the stages themselves. Under CP the data-parallel mesh
    is the flattened ("dp", "cp") one (``mesh.replica_mesh``)."""
    replicas = replica_mesh(mesh)
    if replicas.size() == 1:
        return list(parts.stages)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        for s in parts.stages:
            ignore_experts_in_ddp(s)
        return [DistributedDataParallel(s, process_group=replicas.get_group(),
                                        broadcast_buffers=False) for s in parts.stages]
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) \
        if param_dtype is not None else MixedPrecisionPolicy()
    specs = {name: p.tp_shard for name, p in parts.net.named_parameters()}
    copies = {name for name, p in parts.net.named_parameters() if is_stage_copy(p)}
    ignored = set(split_expert_params(parts.net)) or None  # reduced by the trainer (--ep)
    for block in parts.net.blocks:
        fully_shard(block, mesh=replicas, mp_policy=policy, reshard_after_forward=False,
                    ignored_params=ignored)
    for stage in parts.stages:
        fully_shard(stage, mesh=replicas, mp_policy=policy, reshard_after_forward=False,
                    ignored_params=ignored)
    for name, p in parts.net.named_parameters():
        p.tp_shard = specs[name]
        if name in copies:
            mark_stage_copy(p)
    return list(parts.stages)


class Schedule:
    """The stages of this rank under torch's schedule: ``step`` runs one optimizer step's
    forward and backward over its micro-batches and returns the step's loss."""

    def __init__(self, cfg, parts: PipelineParts, modules: list[nn.Module], mesh, device,
                 micro_batches: int, vocab: int, dtype: torch.dtype):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleInterleaved1F1B,
        )

        self.pp_group, self.tp_group = mesh["pp"].get_group(), mesh["tp"].get_group()
        self.transfers = transfer_group(mesh)  # the stages' sends and receives
        # a tied table on the first and the last stage: its gradients summed over both
        self.parts = parts
        self.embedding = embedding_group(mesh) if parts.net.cfg.tie_embeddings else None
        self.stages, self.m = parts.stages, micro_batches
        self.first = any(s.first for s in parts.stages)
        self.last = any(s.last for s in parts.stages)
        rows = cfg.batch_size // (cfg.dp or 1) // micro_batches
        T, tp = cfg.seq_len, tp_size(self.tp_group)
        t = parts.net.cp_tokens(T)  # this CP rank's tokens (T without CP)
        t_r = shard_sizes(t, tp)[dist.get_rank(self.tp_group)] if cfg.sequence_parallel else t
        dim = parts.net.cfg.dim
        # the shapes of one micro-batch, so that the schedule needs no forward to find them
        hidden = torch.empty(rows, t_r, dim, device=device, requires_grad=True)
        logits = torch.empty(rows, t, shard_sizes(vocab, tp)[dist.get_rank(self.tp_group)],
                             device=device, dtype=dtype)
        ids = torch.zeros(rows, T, dtype=torch.long, device=device)
        pipeline = [PipelineStage(module, s.index, s.count, device,
                                  input_args=(ids if s.first else hidden,),
                                  output_args=(logits if s.last else hidden,),
                                  group=self.transfers)
                    for module, s in zip(modules, parts.stages, strict=True)]
        group, local = self.tp_group, parts.net.cp_local  # under CP: this rank's chunks
        self.tokens = None  # the step's target count on this dp rank, set by ``step``

        def loss_fn(logits_local, targets):  # the micro-batch's summed losses / the step's count
            return vocab_parallel_cross_entropy(logits_local, local(targets), group=group,
                                                vocab_size=vocab, reuse_logits=True,
                                                reduction="sum") / self.tokens

        if cfg.pp_virtual == 1:
            self.schedule = Schedule1F1B(pipeline[0], micro_batches, loss_fn=loss_fn,
                                         scale_grads=False)
        else:
            self.schedule = ScheduleInterleaved1F1B(pipeline, micro_batches, loss_fn=loss_fn,
                                                    scale_grads=False)
        self.device = device
        self.keeps_outputs = "return_outputs" in inspect.signature(self.schedule.step).parameters

    def step(self, x: torch.Tensor, y: torch.Tensor, tokens: torch.Tensor,
             position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """This dp rank's rows of the step (x, y on the device): the sum of the micro-batches'
        losses, each its summed token losses / ``tokens``, on every pipeline rank."""
        losses: list[torch.Tensor] = []
        kwargs = {"seq_len": x.shape[1]}
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        self.tokens = tokens  # read by the loss function (torch 2.11 has no loss_kwargs)
        if self.keeps_outputs:  # the last stage's logits are not kept for the caller
            kwargs["return_outputs"] = False
        # contiguous: the rows of (B, T + 1) windows have a stride of T + 1, and torch checks a
        # stage's input against the (B, T) it expects when collectives are checked
        self.schedule.step(*((x.contiguous(),) if self.first else ()),
                           target=y if self.last else None,
                           losses=losses if self.last else None, **kwargs)
        self.sum_tied_grads()
        total = torch.zeros((), device=self.device)
        for loss in losses:
            total += loss.detach().float()
        dist.all_reduce(total, group=self.pp_group)  # only the last stage's rank has them
        return total

    def groups(self) -> list[dist.ProcessGroup]:
        """The groups the pipeline's traffic runs on, as the summary counts it under "pp": the
        pipeline's collectives, the sends and receives, the tied table's gradient sum."""
        return [self.pp_group, self.transfers] + \
            ([] if self.embedding is None else [self.embedding])

    def sum_tied_grads(self) -> None:
        """A tied table's gradient, the embedding's on the first stage and the head's on the
        last, summed over the two (one all-reduce of this rank's shard: under FSDP2 both ranks
        hold the same rows of it): each copy then has the gradient of the one table of the
        model without a pipeline, and the optimizer moves both alike."""
        for p in tied_tables(self.parts):
            if p.grad is not None:
                dist.all_reduce(local_part(p.grad), group=self.embedding)
