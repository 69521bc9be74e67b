"""Train the GPT of ``model.py`` with tensor parallelism.

Local ranks, spawned by the command itself (gloo on CPU, NCCL when there is a GPU per rank)::

    tensorpar train --tp 2 --steps 300 --out runs/gpt
    tensorpar train --tp 2 --steps 600 --out runs/gpt --resume     # continue to step 600
    tensorpar train --tp 4 --sequence-parallel --dtype bf16 ...     # 4 GPUs, bf16 autocast
    tensorpar --device cuda train --tp 4 ...    # a test mode: 4 ranks on one GPU, over gloo

Under torchrun (one process per rank; multi-node through torchrun's rendezvous)::

    torchrun --standalone --nproc-per-node 2 -m tensorpar train --tp 2 --out runs/gpt
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m tensorpar train --tp 16 ...

Every rank of the TP group sees the same batch; the randomness of a step (its batch, its dropout
masks) derives from (seed, step), so a resumed run, at any TP size, repeats exactly what an
uninterrupted one would have done.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tensorpar.checkpoint.format import find_checkpoint
from tensorpar.checkpoint.load import load_checkpoint
from tensorpar.checkpoint.save import save_checkpoint
from tensorpar.gpt.data import ByteTokenizer, TokenBatches, load_text
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.gpt.optim import adamw, implementation
from tensorpar.gpt.report import Metrics, ProgressLine, plot_loss, summary
from tensorpar.gpt.speedups import check_compile_backend, loss_function, tf32_matmuls
from tensorpar.parallel.layout import Layout, clip_grad_norm_, rank_sizes
from tensorpar.plan.meter import MemoryMeter
from tensorpar.runtime.checking import collectives_checked, naming_layers
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.runtime.groups import device_for, tp_rank, tp_size
from tensorpar.runtime.stopping import StopRequest, signal_name

# how every random stream's seed is derived (runtime/seeds.py); recorded in the manifest
RNG_SCHEME = "hashed"


@dataclass
class TrainConfig:
    """How to train. Every field is a ``tensorpar train`` flag."""

    tp: int = dataclasses.field(default=2, metadata={"help": "tensor-parallel size"})
    sequence_parallel: bool = dataclasses.field(default=False, metadata={
        "help": "shard norms and the residual stream over the sequence"})
    steps: int = dataclasses.field(default=400, metadata={
        "help": "optimizer steps, counted from the start of training (a resumed run stops here)"})
    batch_size: int = dataclasses.field(default=8, metadata={"help": "sequences per step"})
    seq_len: int = dataclasses.field(default=256, metadata={"help": "tokens per sequence"})
    lr: float = dataclasses.field(default=1e-3, metadata={"help": "peak learning rate (AdamW)"})
    warmup_steps: int = dataclasses.field(default=20, metadata={
        "help": "linear warmup, then cosine decay to lr/10 at --lr-decay-steps"})
    lr_decay_steps: int | None = dataclasses.field(default=None, metadata={
        "help": "the step where the cosine decay reaches lr/10 (constant after); stored with "
                "the run, so a resume with another --steps keeps the original schedule",
        "default": "--steps"})
    weight_decay: float = dataclasses.field(default=0.1, metadata={
        "help": "AdamW weight decay (matrices and embeddings; not norms)"})
    grad_clip: float = dataclasses.field(default=1.0, metadata={
        "help": "clip the global gradient norm to this (0: off)"})
    seed: int = dataclasses.field(default=0, metadata={"help": "seed for weights, data, dropout"})
    dtype: str = dataclasses.field(default="fp32", metadata={
        "help": "fp32, or bf16 (autocast; weights and optimizer stay fp32)"})
    data: str | None = dataclasses.field(default=None, metadata={
        "help": "a UTF-8 text file", "default": "Python's help topics, pydoc_data"})
    out: str = dataclasses.field(default="runs/gpt", metadata={
        "help": "run directory: checkpoints, metrics.jsonl, loss.png"})
    resume: bool = dataclasses.field(default=False, metadata={
        "help": "continue from the newest checkpoint in --out (at any --tp)"})
    save_every: int = dataclasses.field(default=100, metadata={
        "help": "checkpoint every N steps (and always at the end)"})
    recompute: bool = dataclasses.field(default=False, metadata={
        "help": "recompute each block in backward instead of keeping its activations"})
    skip_nonfinite: int = dataclasses.field(default=0, metadata={
        "help": "skip up to N steps whose loss or gradient norm is NaN or inf (their gradients "
                "are dropped; counted in metrics.jsonl and the summary); past N the run stops "
                "before the optimizer applies one"})
    fused: bool = dataclasses.field(default=True, metadata={
        "help": "overlap each block's backward all-reduce with its weight gradients "
                "(parallel/fused.py)"})
    compile: bool = dataclasses.field(default=False, metadata={
        "help": "run the forward and the loss under torch.compile (the backward through AOT "
                "autograd); the first step compiles; checkpoints stay the same (gpt/speedups.py)"})
    compile_backend: str = dataclasses.field(default="inductor", metadata={
        "help": "torch.compile's backend for --compile: inductor, or aot_eager (traces, "
                "generates no code: quick to compile)"})
    tf32: bool = dataclasses.field(default=False, metadata={
        "help": "let fp32 matmuls on a GPU use TF32 tensor cores: several times faster, but "
                "TF32 keeps a 10-bit mantissa, about 1e-3 relative error per product instead of "
                "fp32's 1e-7; only --dtype fp32 on CUDA (on the CPU: no effect, with a note)"})

    def check(self) -> None:
        for flag in ("tp", "steps", "batch_size", "seq_len", "save_every", "lr_decay_steps"):
            if getattr(self, flag) is not None and getattr(self, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} {getattr(self, flag)} must be >= 1")
        for flag in ("warmup_steps", "weight_decay", "grad_clip", "skip_nonfinite"):
            if not getattr(self, flag) >= 0:
                raise ValueError(f"--{flag.replace('_', '-')} {getattr(self, flag)} must be >= 0")
        if not self.lr > 0:
            raise ValueError(f"--lr {self.lr} must be > 0")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"--dtype {self.dtype}: expected fp32 or bf16")
        if self.sequence_parallel and self.seq_len < self.tp:
            raise ValueError(f"--seq-len {self.seq_len} is shorter than --tp {self.tp}: "
                             "--sequence-parallel needs at least one token per rank")
        if self.compile:
            check_compile_backend(self.compile_backend)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay to lr/10 at ``lr_decay_steps``
    (``steps`` when unset), constant after."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    horizon = cfg.lr_decay_steps or cfg.steps
    frac = (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    return adamw([{"params": decay, "weight_decay": cfg.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}],
                 lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def train_rank(cfg: TrainConfig, model_cfg: GPTConfig, resume_from: str | None,
               group=None) -> dict:
    """The training loop of one rank. Returns what the run measured (on every rank).

    A SIGTERM or SIGUSR1 that reaches any rank, from the start on, ends the run after the step in
    flight (the first, if it came during setup) with a checkpoint (``runtime/stopping.py``)."""
    group = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    with StopRequest(group, device_for(group)) as stop, ExitStack() as scope:
        return _train(cfg, model_cfg, resume_from, group, stop, scope)


def _train(cfg: TrainConfig, model_cfg: GPTConfig, resume_from: str | None, group,
           stop: StopRequest, scope: ExitStack) -> dict:
    rank, device = tp_rank(group), device_for(group)
    text, label = load_text(cfg.data)
    batches = TokenBatches.from_text(text, cfg.seq_len, cfg.batch_size, cfg.seed)
    model = GPT(model_cfg, group, cfg.sequence_parallel, seed=cfg.seed, device=device,
                fused=cfg.fused, recompute=cfg.recompute)
    if collectives_checked(group):  # a mismatch then names the layer (runtime/checking.py)
        scope.enter_context(naming_layers(model))
    scope.enter_context(tf32_matmuls(cfg.tf32, device))  # restored after: a pool's ranks go on
    forward = loss_function(model, cfg.compile, cfg.compile_backend)  # saves use model itself
    layout = Layout.gather(model, group)
    opt = make_optimizer(model, cfg)
    start = 0
    if resume_from is not None:
        # the files were hashed once by resolve(), before the ranks started
        start = load_checkpoint(resume_from, model, opt, check_hashes=False)["step"]
    out = Path(cfg.out)
    meta = {"config": dataclasses.asdict(model_cfg), "train": dataclasses.asdict(cfg),
            "tokenizer": ByteTokenizer.name,
            "data": {"source": label, "sha256_16": batches.digest,
                     "position": {"step": None, "sequences": None}},
            "rng": {"scheme": RNG_SCHEME, "seed": cfg.seed,
                    "note": "each stream's seed hashes (seed, purpose, step, dp rank, tp rank)"}}
    metrics = progress = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        metrics, progress = Metrics(out / "metrics.jsonl", start), ProgressLine(start, cfg.steps)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bf16")
    comm = {"counts": {}, "bytes": {}, "ring_bytes": {}}
    peak_memory = None
    tokens = cfg.batch_size * cfg.seq_len
    # collectives and memory are measured over one step, once AdamW's states exist (the second)
    measured_step = start + 1 if cfg.steps - start >= 2 else start

    def save(step: int) -> None:
        meta["data"]["position"] = {"step": step, "sequences": step * cfg.batch_size,
                                    "epoch": round(batches.epoch_of(step), 4)}
        save_checkpoint(out, step, model, layout, opt, group, meta)

    stopped = None  # (signal number, step) when a SIGTERM/SIGUSR1 ended the run early
    skipped = sum(1 for r in metrics.rows if r.get("skipped")) if metrics else 0
    if tp_size(group) > 1:  # rank 0 read them from metrics.jsonl: every rank counts the same
        skipped = _broadcast_int(skipped, group, device)
    try:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = learning_rate(cfg, step)
            x, y = (t.to(device) for t in batches.batch(step))
            model.rng.set_step(step)
            measure = step == measured_step
            counter, meter = (CollectiveCounter(), MemoryMeter(device)) if measure \
                else (None, None)
            with counter or nullcontext(), meter or nullcontext():
                with autocast:
                    loss = forward(x, y)
                loss.backward()
                norm = clip_grad_norm_(model, layout, cfg.grad_clip, group)
                # the same on every rank (the loss and the norm are reduced): all decide alike
                loss_value, norm_value = loss.item(), norm.item()
                finite = math.isfinite(loss_value) and math.isfinite(norm_value)
                if finite:
                    opt.step()
                elif skipped == cfg.skip_nonfinite:
                    raise FloatingPointError(nonfinite_step(step + 1, loss_value, norm_value,
                                                            model, group, cfg, out))
                opt.zero_grad(set_to_none=True)
            skipped += not finite
            if measure:
                comm = {k: dict(getattr(counter, k)) for k in comm}
                peak_memory = meter.peak_bytes
            dt = time.perf_counter() - t0
            if rank == 0:
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
    on_cpu = device.type == "cpu"  # the token data is then tensor memory the meter counts too
    mine = rank_sizes(model, layout) | {"peak_memory": peak_memory, "device": device.type,
                                        "data_bytes": batches.tokens.nbytes * on_cpu}
    sizes = [mine]
    if tp_size(group) > 1:
        sizes = [None] * tp_size(group)
        dist.all_gather_object(sizes, mine, group=group)
    result = {"rank": rank, "sizes": sizes, "comm": comm, "start": start,
              "stopped": None if stopped is None else {"signal": signal_name(stopped[0]),
                                                       "signum": stopped[0],
                                                       "step": stopped[1]}}
    if rank == 0:
        metrics.close()
        if metrics.rows:
            plot_loss(metrics.rows, out / "loss.png",
                      f"TP={cfg.tp}{' + SP' if cfg.sequence_parallel else ''}, {label}")
        result["rows"] = metrics.rows
        ran = [r for r in metrics.rows if r["step"] > start]
        if stopped is not None:
            print(f"tensorpar train: stopped by {signal_name(stopped[0])} after step "
                  f"{stopped[1]}; saved {find_checkpoint(out)}; resume with: tensorpar train "
                  f"--resume --out {out}", file=sys.stderr, flush=True)
        else:
            progress.console.print(summary(ran, sizes, comm, cfg, model_cfg,
                                           implementation(opt)))
            progress.console.print(f"checkpoint: {find_checkpoint(out)}   metrics: "
                                   f"{out / 'metrics.jsonl'}   plot: {out / 'loss.png'}")
    return result


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
                  if p.grad is not None and not bool(p.grad.isfinite().all())), None)
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
