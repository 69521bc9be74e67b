"""Train the GPT of ``model.py``, or fine-tune a Hugging Face model, with tensor parallelism.

Local ranks, spawned by the command itself (gloo on CPU, NCCL when there is a GPU per rank)::

    tensorpar train --tp 2 --steps 300 --out runs/gpt
    tensorpar train --tp 2 --steps 600 --out runs/gpt --resume     # continue to step 600
    tensorpar train --tp 4 --sequence-parallel --dtype bf16 ...     # 4 GPUs, bf16 autocast
    tensorpar --device cuda train --tp 4 ...    # a test mode: 4 ranks on one GPU, over gloo

Under torchrun (one process per rank; multi-node through torchrun's rendezvous)::

    torchrun --standalone --nproc-per-node 2 -m tensorpar train --tp 2 --out runs/gpt
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m tensorpar train --tp 16 ...

A Hugging Face causal LM from a local directory, under the same flags (``train/hf_recipe.py``)::

    tensorpar train --hf ./my-llama --tp 2 --steps 200 --data notes.txt --out runs/ft

Every rank of the TP group sees the same batch; the randomness of a step (its batch, its dropout
masks) derives from (seed, step), so a resumed run, at any TP size, repeats exactly what an
uninterrupted one would have done. The loop knows no model class: a *recipe* (``gpt_recipe.py``)
builds the model and its loss.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import ExitStack, closing
from pathlib import Path

import torch
import torch.distributed as dist

from tensorpar.checkpoint.format import find_checkpoint
from tensorpar.checkpoint.load import load_checkpoint
from tensorpar.checkpoint.save import save_checkpoint
from tensorpar.data.chat import IGNORE_INDEX, describe_examples, is_chat_file, pad_id, read_examples
from tensorpar.data.packing import (
    ExampleBatches,
    TokenBatches,
    ValidationExamples,
    ValidationWindows,
)
from tensorpar.data.text import read_corpus
from tensorpar.gpt.model import GPTConfig
from tensorpar.mesh.data_parallel import data_parallel, dp_groups, gradient_sync
from tensorpar.mesh.experts import reduce_expert_grads
from tensorpar.mesh.mesh import cp_group, cp_rank, dp_rank, init_parallel, replica_group
from tensorpar.parallel.ownership import ShardOwnership, clip_grad_norm_, rank_sizes
from tensorpar.ranks.checking import naming_layers
from tensorpar.ranks.signals import StopRequest, signal_name
from tensorpar.runtime.dtensors import local_part
from tensorpar.runtime.groups import collectives_checked, device_for, tp_rank, tp_size
from tensorpar.train.compute import tf32_matmuls
from tensorpar.train.config import TrainConfig, evaluates, learning_rate, passes
from tensorpar.train.gpt_recipe import GPTRecipe
from tensorpar.train.history import RNG_SCHEME
from tensorpar.train.measure import StepMeasure, resident_peak
from tensorpar.train.moe import MoETraining
from tensorpar.train.optim import implementation, make_optimizer
from tensorpar.train.pipeline import Schedule, build_parts, shard_stages
from tensorpar.train.report import RunReport, start_line


def train_rank(cfg: TrainConfig, model_cfg: GPTConfig, resume_from: str | None,
               group=None) -> dict:
    """The GPT's training loop on one rank: :func:`train_model_rank` with ``GPTRecipe``."""
    return train_model_rank(cfg, GPTRecipe(model_cfg), resume_from, group)


def train_model_rank(cfg: TrainConfig, recipe, resume_from: str | None, group=None) -> dict:
    """The training loop of one rank, for the model of ``recipe`` (``gpt_recipe.py``). Returns
    what the run measured (on every rank).

    group: every rank of the run (tp x dp of them; default the whole world). With ``cfg.dp`` > 1
    they form a ("dp", "tp") mesh (``mesh/mesh.py``) and each TP group trains on its slice of
    every batch.

    A SIGTERM or SIGUSR1 that reaches any rank, from the start on, ends the run after the step in
    flight (the first, if it came during setup) with a checkpoint (``ranks/signals.py``)."""
    group = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    with StopRequest(group, device_for(group)) as stop, ExitStack() as scope:
        run = Run(cfg, recipe, resume_from, group, scope)
        report = scope.enter_context(closing(RunReport(run.out, run.start, cfg, run.lead,
                                                       run.intro())))
        measure = StepMeasure(run.start, cfg.steps, run.counted, run.device, run.ddp)
        skipped = run.agree(report.skipped())  # rank 0 read them: every rank counts alike
        stopped = None  # (signal number, step) when a SIGTERM/SIGUSR1 ended the run early
        for step in range(run.start, cfg.steps):
            t0 = time.perf_counter()
            lr = learning_rate(cfg, step)
            for g in run.opt.param_groups:
                g["lr"] = lr
            run.at_step(step)  # the step's dropout streams
            with measure.around(step):
                loss, norm, finite = run.step(step, skipped)
            skipped += not finite
            seconds = time.perf_counter() - t0
            val_loss = run.validate() if evaluates(cfg, step + 1) else None
            report.step(step + 1, loss, norm, finite, lr, seconds, val_loss, run.data_seconds,
                        run.moe_metrics)
            signum = stop.agreed()  # the same on every rank: all stop after this step
            if signum or (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                run.save(step + 1)
            if signum:
                stopped = (signum, step + 1)
                break
        report.close()
        return run.result(measure, report, stopped)


def validation_data(cfg: TrainConfig, tokenizer) -> ValidationWindows | ValidationExamples | None:
    """``--val-data``: chat or instruction examples (their answers scored), else text windows."""
    if cfg.val_data is None:
        return None
    if is_chat_file(cfg.val_data):
        examples = read_examples(cfg.val_data, tokenizer, cfg.seq_len, "--val-data",
                                 cfg.skip_bad_examples)
        return ValidationExamples(examples, cfg.seq_len, cfg.batch_size, cfg.eval_batches,
                                  pad_id(tokenizer))
    return ValidationWindows(read_corpus(cfg.val_data, tokenizer, "--val-data").tokens,
                             cfg.seq_len, cfg.batch_size, cfg.eval_batches)


def training_batches(cfg: TrainConfig, tokenizer):
    """``--data``'s batches, their source's label, and what the summary says of chat or
    instruction examples (None for text)."""
    if is_chat_file(cfg.data):  # examples, trained on their answers (data/chat.py)
        examples = read_examples(cfg.data, tokenizer, cfg.seq_len,
                                 skip_bad=cfg.skip_bad_examples)
        return (ExampleBatches(examples, cfg.seq_len, cfg.batch_size, cfg.seed,
                               pad_id(tokenizer), cfg.pack),
                cfg.data, describe_examples(examples, cfg.seq_len))
    data = read_corpus(cfg.data, tokenizer)  # a text file's ids, or shards memory-mapped
    return (TokenBatches(data.tokens, cfg.seq_len, cfg.batch_size, cfg.seed, data.digest),
            data.label, None)


class Run:
    """One rank's run, set up: its groups, model, optimizer, data and files. ``step`` is one
    optimizer step; ``save`` a checkpoint; ``result`` what the run returns."""

    def __init__(self, cfg: TrainConfig, recipe, resume_from: str | None, run_group,
                 scope: ExitStack):
        self.cfg, self.recipe, self.run_group = cfg, recipe, run_group
        dp = cfg.dp or 1
        self.mesh = init_parallel(tp=cfg.tp, dp=dp, pp=cfg.pp, cp=cfg.cp) \
            if dp > 1 or cfg.pp > 1 or cfg.cp > 1 else None
        self.group = run_group if self.mesh is None else self.mesh["tp"].get_group()
        # --cp: the CP ranks take the same rows and each keeps its chunks (the model splits
        # them); their gradients are averaged with the dp ranks' (mesh.replica_mesh)
        self.cp_group = cp_group(self.mesh)
        cp_kw = {} if self.cp_group is None else {"cp_group": self.cp_group}
        self.device = device_for(self.group)
        self.lead = tp_rank(run_group) == 0  # the rank that prints and writes the run's files
        self.ddp = self.mesh is not None and cfg.dp_mode == "ddp"
        tokenizer = recipe.tokenizer()
        # the note: what the summary says of chat or instruction examples (None for text)
        self.batches, self.source, self.data_note = training_batches(cfg, tokenizer)
        r = dp_rank(self.mesh)
        self.passes = pass_rows(cfg.batch_size, dp, passes(cfg), r)
        self.dp = dp
        self.replicas = dp * cfg.cp  # the ranks a step's gradient is averaged over
        # ``net`` is the model (FSDP2 turns it into a sharded module in place); ``model`` what
        # the step calls; saves, clipping and the shard ownership use ``net``
        self.validation = validation_data(cfg, tokenizer)
        self.pipeline, self.pp_group = None, None  # --pp: this rank's stages (pipeline.py)
        bf16 = torch.bfloat16 if cfg.dtype == "bf16" else None
        # a Mixture of Experts: its groups (--ep), aux-loss weights, expert gradients (moe.py)
        self.moe = MoETraining.setup(cfg, recipe, self.mesh, run_group)
        self.moe_metrics: dict = {}
        # the experts' groups: the GPT's (moe.py) or a Hugging Face MoE model's (its recipe)
        self.experts = self.moe.groups if self.moe is not None else \
            recipe.expert_groups(cfg, self.mesh, run_group)
        extra = {} if self.experts is None else {"experts": self.experts}
        if cfg.pp > 1:
            self.pp_group = self.mesh["pp"].get_group()
            parts, self.at_step = build_parts(recipe, cfg, self.group, r, self.device,
                                              self.mesh["pp"].get_local_rank(),
                                              **extra, **cp_kw)
            self.net = parts.net
        else:
            self.net, self.at_step = recipe.build(cfg, self.group, r, self.device, **extra,
                                                  **cp_kw)
        if self.moe is not None:
            self.moe.attach(self.net, passes(cfg), self.pp_group)
        if collectives_checked(self.group):  # a mismatch then names the layer
            scope.enter_context(naming_layers(self.net))
        scope.enter_context(tf32_matmuls(cfg.tf32, self.device))  # restored after: a pool's
        self.ownership = ShardOwnership.gather(self.net, self.group)  # ranks go on to other jobs
        if cfg.pp > 1:
            modules = shard_stages(parts, self.mesh, cfg.dp_mode, bf16)
            self.model = self.net
            self.pipeline = Schedule(cfg, parts, modules, self.mesh, self.device, passes(cfg),
                                     recipe.model_cfg.vocab_size,
                                     bf16 or torch.float32)
        else:
            self.model = self.net if self.mesh is None else \
                data_parallel(self.net, self.mesh, cfg.dp_mode, param_dtype=bf16)
        self.forward = recipe.loss_fn(self.model, cfg, self.group, **extra)
        self.opt = make_optimizer(self.net, cfg)
        self.counted = self.counted_groups()
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16,
                                       enabled=cfg.dtype == "bf16")
        self.start = 0
        if resume_from is not None:  # the files were hashed once before the ranks started
            self.start = load_checkpoint(resume_from, self.net, self.opt, check_hashes=False,
                                         part=cfg.pp > 1)["step"]
        self.out = Path(cfg.out)
        if self.lead:
            self.out.mkdir(parents=True, exist_ok=True)
            recipe.write_run_files(self.out)
        self.meta = recipe.manifest() | {
            "train": dataclasses.asdict(cfg),
            "data": {"source": self.source, "sha256_16": self.batches.digest,
                     "position": {"step": None, "sequences": None}},
            "rng": {"scheme": RNG_SCHEME, "seed": cfg.seed,
                    "note": "each stream's seed hashes (seed, purpose, step, dp rank, tp rank)"},
            "data_parallel": {"size": dp, "mode": cfg.dp_mode if dp > 1 else None,
                              "stored": "each TP rank's shard once, written by dp rank 0"}}

    def counted_groups(self) -> dict:
        """The groups whose collectives the summary counts, by kind."""
        return {"tp": self.group} | \
            ({} if self.replicas == 1 else {"dp": dp_groups(self.model, self.mesh)}) | \
            ({} if self.pp_group is None else {"pp": self.pipeline.groups()}) | \
            ({} if self.cp_group is None else {"cp": self.cp_group}) | \
            ({} if self.moe is None else self.moe.counted())

    def step(self, step: int, skipped: int) -> tuple[float, float, bool]:
        """One optimizer step: forward and backward over this rank's passes (the gradients
        reduced over dp with the last), clip, and the optimizer's update unless the loss or the
        gradient norm is not finite (then the gradients are dropped, or, past
        ``--skip-nonfinite``, the run stops). The loss and the norm are reduced, so every rank
        decides alike.

        The loss is the mean over the step's target tokens, ignored ones left out, as one pass
        over the whole batch computes it: each pass sums its tokens' losses and divides by the
        step's count (counted from the batch every rank holds), not by its own (with ignored
        tokens, a mean of per-pass means is another number)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        x, y, *packed = self.batches.batch(step)  # the whole step's batch, on every rank
        self.data_seconds = time.perf_counter() - t0  # the step's wait for its data
        # --pack: each row's positions restart at every example (packing.ExampleBatches)
        pos = packed[0].to(self.device) if packed and cfg.pack else None
        at = {} if pos is None else {"position_ids": pos}
        if self.pipeline is not None:  # the passes are the pipeline's micro-batches
            def rows(t):  # the pipeline cuts them back into the passes (tensor_split)
                return torch.cat([t[p] for p in self.passes])

            tokens = torch.tensor((y != IGNORE_INDEX).sum().item() / self.replicas,
                                  device=self.device)
            with self.autocast:
                loss_sum = self.pipeline.step(
                    rows(x).to(self.device), rows(y).to(self.device), tokens,
                    None if pos is None else rows(pos)) / self.replicas
        elif len(self.passes) == 1 and self.replicas == 1:  # one pass: the loss's own mean
            with self.autocast:
                loss = self.forward(x.to(self.device), y.to(self.device), **at)
            loss.backward()
            loss_sum = loss.detach().float()
        else:
            # each pass's summed loss over the dp rank's share of the step's tokens: dp averages
            # the gradients over its ranks, so the step's gradient is that of the mean over all
            # of its tokens, as one pass over the whole batch makes it (under CP each rank sums
            # its chunks' losses and the average runs over dp x cp: the share is count / that)
            tokens = torch.tensor((y != IGNORE_INDEX).sum().item() / self.replicas,
                                  device=self.device)
            loss_sum = 0.0
            for i, rows in enumerate(self.passes):
                with gradient_sync(self.model, i == len(self.passes) - 1):
                    with self.autocast:
                        loss = self.forward(x[rows].to(self.device), y[rows].to(self.device),
                                            loss_tokens=tokens,
                                            **({} if pos is None else {"position_ids": pos[rows]}))
                    loss.backward()
                loss_sum = loss_sum + loss.detach().float() / self.replicas
        reduce_expert_grads(self.net, self.experts)  # over the expert-data ranks (--ep)
        ep = self.experts if self.experts is not None and self.experts.ep_size > 1 else None
        norm = clip_grad_norm_(self.net, self.ownership, cfg.grad_clip, self.group,
                               replica_group(self.mesh) if cfg.dp_mode == "fsdp" else None,
                               self.pp_group, None if ep is None else ep.ep)
        loss_value, norm_value = self._sum_over_dp(loss_sum), norm.item()
        finite = math.isfinite(loss_value) and math.isfinite(norm_value)
        if finite:
            self.opt.step()
        elif skipped == cfg.skip_nonfinite:
            raise FloatingPointError(nonfinite_step(step + 1, loss_value, norm_value, self.net,
                                                    self.run_group, cfg, self.out))
        self.opt.zero_grad(set_to_none=True)
        if self.moe is not None:  # the step's aux loss and loads; loss-free balancing
            self.moe_metrics = self.moe.end_step(finite)
        return loss_value, norm_value, finite

    def _sum_over_dp(self, loss: torch.Tensor) -> float:
        """The step's loss: the sum of the dp (x cp) ranks' parts (each its mean, or its tokens'
        share, divided by their count), one all-reduce over dp (x cp)."""
        if self.mesh is None:
            return loss.item()
        total = loss.clone()
        dist.all_reduce(total, group=replica_group(self.mesh))
        return total.item()

    @torch.no_grad()
    def validate(self) -> float:
        """The validation loss with the weights as they are: the mean cross-entropy over every
        predicted token of the validation windows, in eval mode (no dropout; the training's
        random streams untouched). Each dp rank sums its part of each batch (each CP rank its
        chunks of it, the count on CP rank 0 alone); one all-reduce of (sum, count) over dp (x
        cp) makes the mean, the same at every TP, CP and DP size."""
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        one = torch.ones((), device=self.device)
        try:
            for x, y in self.validation.batches(self.dp, dp_rank(self.mesh)):
                x, y = x.to(self.device), y.to(self.device)
                with self.autocast:
                    total[0] += self.forward(x, y, loss_tokens=one).double()  # the sum
                if cp_rank(self.mesh) == 0:
                    total[1] += (y != IGNORE_INDEX).sum()
        finally:
            self.model.train()
        if self.mesh is not None:
            dist.all_reduce(total, group=replica_group(self.mesh))
        return (total[0] / total[1]).item()

    def intro(self) -> str:
        """The run's first line (``report.start_line``): the model, the data and the rest."""
        cfg, recipe = self.cfg, self.recipe
        model = "tensorpar's GPT" if recipe.kind == "gpt" else getattr(recipe, "origin", "")
        if cfg.lora_rank is not None:
            model += f" (LoRA rank {cfg.lora_rank})"
        examples = getattr(self.batches, "examples", None)  # chat or instruction examples
        n = 0 if examples is None else len(examples.ids)
        source = self.source if examples is None else \
            f"{self.source} ({n:,} example{'s' * (n != 1)})"
        return start_line(cfg, model, source, self.start)

    def save(self, step: int) -> None:
        self.meta["data"]["position"] = {"step": step, "sequences": step * self.cfg.batch_size,
                                         "epoch": round(self.batches.epoch_of(step), 4)}
        save_checkpoint(self.out, step, self.net, self.ownership, self.opt, self.group, self.meta,
                        dp_group=replica_group(self.mesh), pp_group=self.pp_group)

    def agree(self, value: int) -> int:
        """Rank 0's ``value`` on every rank of the run."""
        if tp_size(self.run_group) == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(t, src=dist.get_global_rank(self.run_group, 0), group=self.run_group)
        return int(t.item())

    def result(self, measure: StepMeasure, report: RunReport, stopped) -> dict:
        """Every rank's sizes and peak memory (gathered), the measured step's collectives, how
        the run ended; on the lead rank the metrics rows, after the plot and the summary."""
        # a text file's ids on the CPU are memory the meter counts (memory-mapped shards not)
        on_cpu = self.device.type == "cpu" and isinstance(self.batches.tokens, torch.Tensor)
        mine = rank_sizes(self.net, self.ownership) | {
            "peak_memory": measure.peak_memory, "device": self.device.type,
            "data_bytes": self.batches.tokens.nbytes if on_cpu else 0,
            "resident_peak": resident_peak(), "tp_rank": tp_rank(self.group),
            "dp_rank": dp_rank(self.mesh), "cp_rank": cp_rank(self.mesh),
            "pp_rank": 0 if self.pp_group is None else tp_rank(self.pp_group)}
        sizes = [mine]
        if tp_size(self.run_group) > 1:
            sizes = [None] * tp_size(self.run_group)
            dist.all_gather_object(sizes, mine, group=self.run_group)
        result = {"rank": tp_rank(self.run_group), "sizes": sizes, "comm": measure.comm,
                  "start": self.start,
                  "stopped": None if stopped is None else {"signal": signal_name(stopped[0]),
                                                           "signum": stopped[0],
                                                           "step": stopped[1]}}
        if self.lead:
            result["rows"] = report.finish(self.start, sizes, measure.comm, self.recipe.shape(),
                                           implementation(self.opt), self.recipe.dropout,
                                           self.source, stopped is not None, self.data_note,
                                           converted=self.recipe.kind == "hf")
        return result


def pass_rows(batch_size: int, dp: int, n: int, r: int) -> list[slice]:
    """Dp rank ``r``'s rows of the step's batch, one slice per pass: pass i of the step is
    rows [i·B/n, (i+1)·B/n) of the batch, cut over the dp ranks in order (Megatron's global
    micro-batches). So a pass's tokens over every dp rank are those one rank takes in pass i
    at ``--micro-batch-size`` dp x M: what a Mixture of Experts' router statistics, summed
    over the dp ranks each pass, need to equal one rank (with one pass: rows [r·B/dp,
    (r+1)·B/dp))."""
    size = batch_size // dp // n
    return [slice((i * dp + r) * size, (i * dp + r + 1) * size) for i in range(n)]


def nonfinite_step(step: int, loss: float, norm: float, model: torch.nn.Module, group,
                   cfg: TrainConfig, out: Path) -> str:
    """The one line that stops a run at a non-finite step, naming the first parameter (in the
    model's order) whose gradient is not finite, on whichever rank holds it. Every rank calls
    it (one all_gather_object, on this path only)."""
    first = next(((i, name) for i, (name, p) in enumerate(model.named_parameters())
                  if p.grad is not None and not bool(local_part(p.grad).isfinite().all())), None)
    found = [first]
    if tp_size(group) > 1:
        found = [None] * tp_size(group)
        dist.all_gather_object(found, first, group=group)
    hits = sorted((f[0], r, f[1]) for r, f in enumerate(found) if f is not None)
    where = f"first non-finite gradient: {hits[0][2]} (rank {hits[0][1]})" if hits else \
        "every gradient is finite"
    ckpt = find_checkpoint(out)
    kept = f"the newest checkpoint, {ckpt}, holds the weights before it" if ckpt else \
        "no checkpoint was written yet"
    skip = f"after skipping {cfg.skip_nonfinite} such steps" if cfg.skip_nonfinite else \
        "--skip-nonfinite N skips up to N such steps"
    return (f"step {step}: loss {loss}, gradient norm {norm}; {where}; stopped before the "
            f"optimizer applied it; {kept}; {skip}")
