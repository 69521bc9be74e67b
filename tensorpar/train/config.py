"""How to train: ``TrainConfig``, every field a ``tensorpar train`` flag, checked in one place,
and the learning-rate schedule."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tensorpar.mesh.data_parallel import check_dp_mode
from tensorpar.parallel.context import check_cp_split, cp_sizes
from tensorpar.parallel.sharding import check_expert_parallel
from tensorpar.train.compute import check_compile_backend


@dataclass
class TrainConfig:
    """How to train. Every field is a ``tensorpar train`` flag."""

    tp: int = dataclasses.field(default=2, metadata={"help": "tensor-parallel size"})
    dp: int | None = dataclasses.field(default=None, metadata={
        "help": "data-parallel size: tp x dp ranks, each TP group training on its 1/dp of "
                "every batch", "default": "1; under torchrun the world size / --tp"})
    dp_mode: str = dataclasses.field(default="fsdp", metadata={
        "help": "fsdp (torch's FSDP2: weights, gradients and AdamW states split over dp too) "
                "or ddp (DistributedDataParallel: replicated, gradients all-reduced)"})
    ep: int = dataclasses.field(default=1, metadata={
        "help": "with --moe-experts or an --hf MoE model: expert-parallel size, the routed "
                "experts split over N of the dp x tp ranks of a stage (dp x cp x tp under --cp; "
                "consecutive; 1 or a multiple of --tp), each expert held once in that group and "
                "replicated over the stage's other ranks",
        "default": "1: every rank holds every expert (an --hf model: the experts split over "
                   "each TP group)"})
    pp: int = dataclasses.field(default=1, metadata={
        "help": "pipeline stages: the GPT's blocks cut into N stages over N ranks (tp x dp x pp "
                "ranks in all), run by torch.distributed.pipelining's 1F1B schedule on the "
                "step's micro-batches (--micro-batch-size)", "default": "1, no pipeline"})
    pp_virtual: int = dataclasses.field(default=1, metadata={
        "help": "with --pp: stages per pipeline rank, interleaved (torch's "
                "ScheduleInterleaved1F1B): a smaller bubble, more point-to-point traffic"})
    cp: int = dataclasses.field(default=1, metadata={
        "help": "context-parallel size: each sequence split over N ranks (2N chunks, rank i "
                "holding chunks i and 2N-1-i, the causal load balance), keys and values "
                "all-gathered in attention; tp x cp x dp x pp ranks in all, the gradients "
                "summed over dp x cp (the GPT, and --hf models of the Llama family, Qwen3-MoE "
                "and Mixtral among them)",
        "default": "1, no context parallelism"})
    sequence_parallel: bool = dataclasses.field(default=False, metadata={
        "help": "shard norms and the residual stream over the sequence"})
    steps: int = dataclasses.field(default=400, metadata={
        "help": "optimizer steps, counted from the start of training (a resumed run stops here)"})
    batch_size: int = dataclasses.field(default=8, metadata={
        "help": "sequences per optimizer step, over all data-parallel ranks (the global batch)"})
    micro_batch_size: int | None = dataclasses.field(default=None, metadata={
        "help": "sequences each data-parallel rank runs per forward and backward pass; the "
                "step's gradients accumulate over --batch-size / (--dp x this) passes and are "
                "reduced over dp once, and the loss is the mean over the step's target tokens, "
                "as in one pass", "default": "--batch-size / --dp: one pass"})
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
        "help": "a UTF-8 text file, or a folder of token shards written by tensorpar prepare "
                "(memory-mapped)", "default": "Python's help topics, pydoc_data"})
    val_data: str | None = dataclasses.field(default=None, metadata={
        "help": "held-out data, its loss written as val_loss: a UTF-8 text file or a shard "
                "folder (consecutive windows of --seq-len + 1 tokens in order, the mean over "
                "every predicted token), or chat or instruction examples like --data's (one a "
                "row in order, the mean over their answer tokens)",
        "default": "none, no validation"})
    eval_every: int | None = dataclasses.field(default=None, metadata={
        "help": "with --val-data: the validation loss every N steps (with the weights after "
                "that step's update) and after the last", "default": "--save-every"})
    eval_batches: int | None = dataclasses.field(default=None, metadata={
        "help": "with --val-data: the first K batches of --batch-size windows",
        "default": "all of them"})
    pack: bool = dataclasses.field(default=False, metadata={
        "help": "with chat or instruction examples (--data FILE.jsonl): several "
                "examples in each sequence, positions restarting at each and attention "
                "confined to it, instead of one padded example a sequence"})
    skip_bad_examples: bool = dataclasses.field(default=False, metadata={
        "help": "with examples (--data or --val-data FILE.jsonl): skip a malformed record (no "
                "content, an unknown role, no answer) and count it in the summary, instead of "
                "stopping at its line"})
    lora_rank: int | None = dataclasses.field(default=None, metadata={
        "help": "with --hf: train LoRA adapters of this rank on the blocks' projections, split "
                "with them over --tp, the model frozen; only the adapters are in the optimizer, "
                "the gradient norm and the checkpoints (which point to the --hf model)",
        "default": "none: every weight is trained"})
    lora_alpha: float = dataclasses.field(default=8.0, metadata={
        "help": "with --lora-rank: the adapters' scale is alpha / rank (PEFT's lora_alpha)"})
    lora_targets: str | None = dataclasses.field(default=None, metadata={
        "help": "with --lora-rank: the projections to adapt, by the last part of their names, "
                "comma-separated (PEFT's target_modules: q_proj,v_proj)",
        "default": "every projection in the blocks, not the head"})
    lora_dropout: float = dataclasses.field(default=0.0, metadata={
        "help": "with --lora-rank: dropout on each adapter's input while training (PEFT's "
                "lora_dropout); its masks are the same at every --tp"})
    base_dtype: str = dataclasses.field(default="fp32", metadata={
        "help": "with --lora-rank: keep the frozen weights of the projections and the head "
                "in fp32 or bf16 (half their memory, the same step: the values bf16 autocast "
                "computes with; needs --dtype bf16); embedding, norms and adapters stay fp32"})
    lora_init: str | None = dataclasses.field(default=None, metadata={
        "help": "with --hf: continue from this PEFT LoRA adapter folder (adapter_config.json, "
                "adapter_model.safetensors); its rank, alpha and targets are the run's",
        "default": "none: A drawn from the seed, B zeros"})
    out: str = dataclasses.field(default="runs/gpt", metadata={
        "help": "run directory: checkpoints, metrics.jsonl, loss.png (and tensorboard/ with "
                "--tensorboard)"})
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
                "autograd); the first step compiles; checkpoints stay the same (train/compute.py)"})
    compile_backend: str = dataclasses.field(default="inductor", metadata={
        "help": "torch.compile's backend for --compile: inductor, or aot_eager (traces, "
                "generates no code: quick to compile)"})
    tf32: bool = dataclasses.field(default=False, metadata={
        "help": "let fp32 matmuls on a GPU use TF32 tensor cores: several times faster, but "
                "TF32 keeps a 10-bit mantissa, about 1e-3 relative error per product instead of "
                "fp32's 1e-7; only --dtype fp32 on CUDA (on the CPU: no effect, with a note)"})
    tensorboard: bool = dataclasses.field(default=False, metadata={
        "help": "also write the metrics.jsonl rows as TensorBoard scalars (train/loss, train/lr, "
                "...) into --out's tensorboard/ directory, each step flushed, a resumed run "
                "appended (view: tensorboard --logdir RUN/tensorboard); needs pip install "
                "tensorboard"})
    wandb: bool = dataclasses.field(default=False, metadata={
        "help": "also log the metrics.jsonl rows to a Weights & Biases run (train/loss, ..., "
                "val/loss), its files in --out's wandb/ and its id in wandb-id, so that --resume "
                "continues it; WANDB_MODE=offline writes an offline run (wandb sync uploads it); "
                "needs pip install wandb"})
    wandb_project: str = dataclasses.field(default="tensorpar", metadata={
        "help": "with --wandb: the W&B project"})
    wandb_run_name: str | None = dataclasses.field(default=None, metadata={
        "help": "with --wandb: the W&B run's name", "default": "--out's folder name"})

    def check(self) -> None:
        for flag in ("tp", "dp", "ep", "pp", "pp_virtual", "cp", "steps", "batch_size",
                     "micro_batch_size", "seq_len", "save_every", "lr_decay_steps", "eval_every",
                     "eval_batches", "lora_rank"):
            if getattr(self, flag) is not None and getattr(self, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} {getattr(self, flag)} must be >= 1")
        for flag in ("warmup_steps", "weight_decay", "grad_clip", "skip_nonfinite"):
            if not getattr(self, flag) >= 0:
                raise ValueError(f"--{flag.replace('_', '-')} {getattr(self, flag)} must be >= 0")
        if not self.lr > 0:
            raise ValueError(f"--lr {self.lr} must be > 0")
        if not self.lora_alpha > 0:
            raise ValueError(f"--lora-alpha {self.lora_alpha} must be > 0")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"--lora-dropout {self.lora_dropout} must be in [0, 1)")
        if self.base_dtype not in ("fp32", "bf16"):
            raise ValueError(f"--base-dtype {self.base_dtype}: expected fp32 or bf16")
        asked = [f for f, on in (("--lora-dropout", self.lora_dropout),
                                  ("--base-dtype bf16", self.base_dtype != "fp32")) if on]
        if asked and self.lora_rank is None and self.lora_init is None:
            raise ValueError(f"{' and '.join(asked)}: for LoRA, add --lora-rank R")
        if self.base_dtype == "bf16" and self.dtype != "bf16":
            raise ValueError("--base-dtype bf16 computes in bf16: add --dtype bf16")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"--dtype {self.dtype}: expected fp32 or bf16")
        if self.cp > 1:
            check_cp_flags(self)
        elif self.sequence_parallel and self.seq_len < self.tp:
            raise ValueError(f"--seq-len {self.seq_len} is shorter than --tp {self.tp}: "
                             "--sequence-parallel needs at least one token per rank")
        if self.compile:
            check_compile_backend(self.compile_backend)
        check_dp_mode(self.dp_mode)
        dp = self.dp or 1
        if self.batch_size % dp:
            raise ValueError(f"--batch-size {self.batch_size} (the global batch) does not divide "
                             f"over --dp {dp} data-parallel ranks")
        if self.micro_batch_size is not None and (self.batch_size // dp) % self.micro_batch_size:
            raise ValueError(f"--micro-batch-size {self.micro_batch_size} does not divide the "
                             f"{self.batch_size // dp} sequences of each data-parallel rank "
                             f"(--batch-size {self.batch_size} over --dp {dp})")
        if self.pp > 1 or self.pp_virtual > 1:
            check_pipeline_flags(self)
        # the layout part here; the experts against the model (the recipe); dp None under
        # torchrun: when the mesh is built
        check_expert_parallel(self.ep, self.tp, self.dp, None, self.cp)
        if self.tensorboard:  # importable, or one line before any rank starts
            from tensorpar.train.report import summary_writer  # report imports rich: only then

            summary_writer()
        if self.wandb:
            from tensorpar.train.report import wandb_module

            wandb_module()


def evaluates(cfg: TrainConfig, step: int) -> bool:
    """Whether the run computes the validation loss after ``step`` (counted from 1)."""
    every = cfg.eval_every or cfg.save_every
    return cfg.val_data is not None and (step % every == 0 or step == cfg.steps)


def check_cp_flags(cfg: TrainConfig) -> None:
    """What ``--cp N`` needs of the other flags: 2N chunks of at least a token in a sequence,
    and under --sequence-parallel at least --tp tokens on every CP rank."""
    check_cp_split(cfg.seq_len, cfg.cp, "--cp")
    fewest = min(cp_sizes(cfg.seq_len, cfg.cp))
    if cfg.sequence_parallel and fewest < cfg.tp:
        raise ValueError(f"--sequence-parallel splits each CP rank's tokens over --tp "
                         f"{cfg.tp}, but --seq-len {cfg.seq_len} over --cp {cfg.cp} leaves a "
                         f"rank {fewest}")
    if cfg.compile:
        raise ValueError("--cp with --compile is not supported yet (the CP attention's mask "
                         "and gathers are not traced yet)")


def check_pipeline_flags(cfg: TrainConfig) -> None:
    """What ``--pp`` needs of the other flags (the model's side: ``gpt_recipe.check``)."""
    for flag in ("val_data", "compile"):
        if getattr(cfg, flag):
            raise ValueError(f"--pp with --{flag.replace('_', '-')} is not supported yet")
    if cfg.lora_rank is not None or cfg.lora_init is not None:
        raise ValueError("--pp pipelines tensorpar's GPT; LoRA fine-tunes a Hugging Face model")


def pipeline_micro_batch(cfg: TrainConfig) -> int | None:
    """The micro-batch size ``--pp`` takes when none is given: the step's sequences of a
    data-parallel copy in 2 x pp micro-batches (pp when 2 x pp does not divide them; a multiple
    of pp for interleaved stages, which torch's schedule runs in rounds of pp), so that 1F1B
    keeps every stage busy; None when no such count divides them (``check_pipeline`` then says
    what is needed)."""
    per_copy = cfg.batch_size // (cfg.dp or 1)
    for count in (2 * cfg.pp, cfg.pp):
        if count <= per_copy and per_copy % count == 0:
            return per_copy // count
    return None


def passes(cfg: TrainConfig) -> int:
    """Forward and backward passes per optimizer step (1 without --micro-batch-size)."""
    per_rank = cfg.batch_size // (cfg.dp or 1)
    return per_rank // (cfg.micro_batch_size or per_rank)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay to lr/10 at ``lr_decay_steps``
    (``steps`` when unset), constant after."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    horizon = cfg.lr_decay_steps or cfg.steps
    frac = (step - cfg.warmup_steps) / max(1, horizon - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def lora_targets(cfg: TrainConfig) -> list[str] | None:
    """``--lora-targets`` as a list (None: every projection)."""
    if cfg.lora_targets is None:
        return None
    return [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
