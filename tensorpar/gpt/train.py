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

A Hugging Face causal LM from a local directory, under the same flags (``hf/train.py``)::

    tensorpar train --hf ./my-llama --tp 2 --steps 200 --data notes.txt --out runs/ft

Every rank of the TP group sees the same batch; the randomness of a step (its batch, its dropout
masks) derives from (seed, step), so a resumed run, at any TP size, repeats exactly what an
uninterrupted one would have done. The loop knows no model class: a *recipe* (``recipe.py``)
builds the model and its loss.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from tensorpar.checkpoint.format import find_checkpoint
from tensorpar.checkpoint.load import load_checkpoint
from tensorpar.checkpoint.save import save_checkpoint
from tensorpar.gpt.data import TokenBatches, load_text
from tensorpar.gpt.model import GPTConfig
from tensorpar.gpt.optim import adamw, implementation
from tensorpar.gpt.recipe import GPTRecipe
from tensorpar.gpt.report import Metrics, ProgressLine, plot_loss, summary
from tensorpar.gpt.speedups import tf32_matmuls
from tensorpar.gpt.train_config import TrainConfig, learning_rate
from tensorpar.parallel.layout import Layout, clip_grad_norm_, rank_sizes
from tensorpar.plan.meter import MemoryMeter
from tensorpar.runtime.checking import collectives_checked, naming_layers
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.runtime.dtensors import local_part
from tensorpar.runtime.groups import device_for, tp_rank, tp_size
from tensorpar.runtime.stopping import StopRequest, signal_name
from tensorpar.scale.data_parallel import data_parallel, dp_groups
from tensorpar.scale.mesh import dp_group, dp_rank, dp_size, init_parallel

# how every random stream's seed is derived (runtime/seeds.py); recorded in the manifest.
# "hashed-keys" (2026-11-26): a dropout mask's seed hashes (stream seed, key, site); under
# "hashed" the sites of a step drew one after another from one generator per stream
RNG_SCHEME = "hashed-keys"


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; no weight decay on the vectors: norms (the GPT's only ones) and biases."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return adamw([{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}],
                 lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def train_rank(cfg: TrainConfig, model_cfg: GPTConfig, resume_from: str | None,
               group=None) -> dict:
    """The GPT's training loop on one rank: :func:`train_model_rank` with ``GPTRecipe``."""
    return train_model_rank(cfg, GPTRecipe(model_cfg), resume_from, group)


def train_model_rank(cfg: TrainConfig, recipe, resume_from: str | None, group=None) -> dict:
    """The training loop of one rank, for the model of ``recipe`` (``recipe.py``). Returns what
    the run measured (on every rank).

    group: every rank of the run (tp x dp of them; default the whole world). With ``cfg.dp`` > 1
    they form a ("dp", "tp") mesh (``scale/mesh.py``) and each TP group trains on its slice of
    every batch.

    A SIGTERM or SIGUSR1 that reaches any rank, from the start on, ends the run after the step in
    flight (the first, if it came during setup) with a checkpoint (``runtime/stopping.py``)."""
    group = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    with StopRequest(group, device_for(group)) as stop, ExitStack() as scope:
        return _train(cfg, recipe, resume_from, group, stop, scope)


def _train(cfg: TrainConfig, recipe, resume_from: str | None, run_group, stop: StopRequest,
           scope: ExitStack) -> dict:
    """run_group: every rank of the run; the TP group is all of it, or the mesh's "tp"."""
    dp = cfg.dp or 1
    mesh = init_parallel(tp=cfg.tp, dp=dp) if dp > 1 else None
    group = run_group if mesh is None else mesh["tp"].get_group()
    rank, device = tp_rank(group), device_for(group)
    lead = tp_rank(run_group) == 0  # the rank that prints and writes the run's files
    text, label = load_text(cfg.data)
    batches = TokenBatches.from_text(text, cfg.seq_len, cfg.batch_size, cfg.seed,
                                     recipe.tokenizer())
    rows = slice(dp_rank(mesh) * cfg.batch_size // dp, (dp_rank(mesh) + 1) * cfg.batch_size // dp)
    net, at_step = recipe.build(cfg, group, dp_rank(mesh), device)
    if collectives_checked(group):  # a mismatch then names the layer (runtime/checking.py)
        scope.enter_context(naming_layers(net))
    scope.enter_context(tf32_matmuls(cfg.tf32, device))  # restored after: a pool's ranks go on
    layout = Layout.gather(net, group)
    # ``net`` is the model (FSDP2 turns it into a sharded module in place); ``model`` what to call
    model = net if mesh is None else data_parallel(net, mesh, cfg.dp_mode)
    forward = recipe.loss_fn(model, cfg, group)  # saves use net itself
    opt = make_optimizer(net, cfg)
    start = 0
    if resume_from is not None:
        # the files were hashed once by resolve(), before the ranks started
        start = load_checkpoint(resume_from, net, opt, check_hashes=False)["step"]
    out = Path(cfg.out)
    meta = recipe.manifest() | {
        "train": dataclasses.asdict(cfg),
        "data": {"source": label, "sha256_16": batches.digest,
                 "position": {"step": None, "sequences": None}},
        "rng": {"scheme": RNG_SCHEME, "seed": cfg.seed,
                "note": "each stream's seed hashes (seed, purpose, step, dp rank, tp rank)"},
        "data_parallel": {"size": dp, "mode": cfg.dp_mode if dp > 1 else None,
                          "stored": "each TP rank's shard once, written by dp rank 0"}}
    metrics = progress = None
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        recipe.prepare(out)
        metrics = Metrics(out / "metrics.jsonl", start,
                          out / "tensorboard" if cfg.tensorboard else None)
        progress = ProgressLine(start, cfg.steps)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")
    comm = {"counts": {}, "bytes": {}, "ring_bytes": {}}
    peak_memory = None
    tokens = cfg.batch_size * cfg.seq_len
    # collectives and memory are measured over one steady step, once AdamW's states exist (the
    # second; under DDP the third: it rebuilds its gradient buckets after the first, broadcasting)
    settle = 2 if mesh is not None and cfg.dp_mode == "ddp" else 1
    measured_step = start + min(settle, max(0, cfg.steps - start - 1))

    def save(step: int) -> None:
        meta["data"]["position"] = {"step": step, "sequences": step * cfg.batch_size,
                                    "epoch": round(batches.epoch_of(step), 4)}
        save_checkpoint(out, step, net, layout, opt, group, meta, dp_group=dp_group(mesh))

    stopped = None  # (signal number, step) when a SIGTERM/SIGUSR1 ended the run early
    skipped = sum(1 for r in metrics.rows if r.get("skipped")) if metrics else 0
    if tp_size(run_group) > 1:  # rank 0 read them from metrics.jsonl: every rank counts alike
        skipped = _broadcast_int(skipped, run_group, device)
    counted = {"tp": group} | ({} if mesh is None else {"dp": dp_groups(model, mesh)})
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = learning_rate(cfg, step)
            x, y = (t[rows].to(device) for t in batches.batch(step))  # this dp rank's slice
            at_step(step)
            measure = step == measured_step
            counter, meter = (CollectiveCounter(counted), MemoryMeter(device)) if measure \
                else (None, None)
            with counter or nullcontext(), meter or nullcontext():
                with autocast:
                    loss = forward(x, y)
                loss.backward()
                norm = clip_grad_norm_(net, layout, cfg.grad_clip, group,
                                       dp_group(mesh) if cfg.dp_mode == "fsdp" else None)
                # the same on every rank (the loss and the norm are reduced): all decide alike
                loss_value, norm_value = _mean_over(loss.detach(), mesh), norm.item()
                finite = math.isfinite(loss_value) and math.isfinite(norm_value)
                if finite:
                    opt.step()
                elif skipped == cfg.skip_nonfinite:
                    raise FloatingPointError(nonfinite_step(step + 1, loss_value, norm_value,
                                                            net, run_group, cfg, out))
                opt.zero_grad(set_to_none=True)
            skipped += not finite
            if measure:
                tp_counts = counter.by_group.get("tp", {})
                comm = {k: dict(tp_counts.get(k, {})) for k in comm}
                if mesh is not None:
                    comm["dp"] = {k: dict(v) for k, v in counter.by_group.get("dp", {}).items()}
                peak_memory = meter.peak_bytes
            dt = time.perf_counter() - t0
            if lead:
                row = {"step": step + 1, "loss": loss_value if finite else None,
                       "lr": learning_rate(cfg, step),
                       "grad_norm": norm_value if finite else None,
                       "tokens_per_s": tokens / dt, "step_time_s": dt}
                if not finite:  # JSON has no NaN: the values are named instead
                    row["skipped"] = f"non-finite: loss {loss_value}, gradient norm {norm_value}"
                metrics.write(row)
                progress.update(step + 1, loss_value, tokens / dt)
            signum = stop.agreed()  # the same on every rank: all stop after this step
            if signum or (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                save(step + 1)
            if signum:
                stopped = (signum, step + 1)
                break
    finally:
        if progress is not None:
            progress.close()  # also when interrupted: the terminal gets its cursor back
        if metrics is not None:
            metrics.close()  # the TensorBoard writer's thread too
    on_cpu = device.type == "cpu"  # the token data is then tensor memory the meter counts too
    mine = rank_sizes(net, layout) | {"peak_memory": peak_memory, "device": device.type,
                                      "data_bytes": batches.tokens.nbytes * on_cpu,
                                      "tp_rank": rank, "dp_rank": dp_rank(mesh)}
    sizes = [mine]
    if tp_size(run_group) > 1:
        sizes = [None] * tp_size(run_group)
        dist.all_gather_object(sizes, mine, group=run_group)
    result = {"rank": tp_rank(run_group), "sizes": sizes, "comm": comm, "start": start,
              "stopped": None if stopped is None else {"signal": signal_name(stopped[0]),
                                                       "signum": stopped[0],
                                                       "step": stopped[1]}}
    if lead:
        if metrics.rows:
            plot_loss(metrics.rows, out / "loss.png",
                      f"TP={cfg.tp}{' + SP' if cfg.sequence_parallel else ''}"
                      f"{f' x DP={dp} ({cfg.dp_mode})' if dp > 1 else ''}, {label}")
        result["rows"] = metrics.rows
        ran = [r for r in metrics.rows if r["step"] > start]
        if stopped is None:  # a stopped run's line is said by the launcher (gpt/start.py)
            progress.console.print(summary(ran, sizes, comm, cfg, recipe.spec(),
                                           implementation(opt), recipe.dropout))
            progress.console.print(f"checkpoint: {find_checkpoint(out)}   metrics: "
                                   f"{out / 'metrics.jsonl'}   plot: {out / 'loss.png'}"
                                   + (f"   tensorboard: {out / 'tensorboard'}"
                                      if cfg.tensorboard else ""))
    return result


def _mean_over(loss: torch.Tensor, mesh) -> float:
    """The loss of the whole batch: the mean of the dp ranks' losses (equal slices), one
    all-reduce over dp (gloo has no average: a sum, divided)."""
    if mesh is None:
        return loss.item()
    total = loss.float().clone()
    dist.all_reduce(total, group=dp_group(mesh))
    return total.item() / dp_size(mesh)


def _broadcast_int(value: int, group, device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
    return int(t.item())


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
