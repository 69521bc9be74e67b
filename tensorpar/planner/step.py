"""The step the planner plans, as one typed value: ``Step`` (the model's shape, the layout of
ranks, the batch and its passes, the precision, recomputation, the kernels, LoRA), built once
from ``tensorpar train``'s config (``Step.from_train_config``) or from ``tensorpar plan``'s flags
(``cli/plan.py``); and the typed budget the memory estimate returns (``Budget``).

Every planner function takes the ``Step`` whole rather than its fields one by one: a new
dimension of the step (an expert or context-parallel size) is a field here, not a parameter
added to every function.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tensorpar.parallel.context import cp_sizes
from tensorpar.planner.shapes import ModelShape

# the precisions: fp32; Megatron-style bf16 (bf16 weights and gradients, fp32 master weights and
# moments); bf16-autocast (what ``tensorpar train --dtype bf16`` does: fp32 weights, bf16 matmuls)
DTYPES = ("fp32", "bf16", "bf16-autocast")
RECOMPUTE = ("none", "selective", "full")
# torch's AdamW implementations (train/optim.py picks fused), by the temporaries of their step
ADAMW = ("fused", "foreach", "for-loop")
# the names of ``tensorpar.mesh.data_parallel.DP_MODES`` (the planner imports no engine)
DP_MODES = ("fsdp", "ddp")


@dataclass(frozen=True)
class Lora:
    """LoRA fine-tuning: adapters of ``rank`` on the projections ``targets`` (``--lora-targets``,
    comma-separated names; None: every projection), the frozen base held in ``base_dtype``."""

    rank: int
    targets: str | None = None
    base_dtype: str = "fp32"
    dropout: float = 0.0  # on the adapters' input (``--lora-dropout``, PEFT's lora_dropout)


@dataclass(frozen=True)
class Step:
    """One training step, as the planner sees it."""

    shape: ModelShape
    tp: int = 1  # tensor-parallel size
    batch: int = 1  # sequences per optimizer step, over all data-parallel copies
    seq: int = 2048  # tokens per sequence
    dtype: str = "bf16"  # one of DTYPES
    sequence_parallel: bool = False
    recompute: str = "none"  # one of RECOMPUTE ("selective" plans as "none": no scores kept)
    dp: int = 1  # data-parallel copies
    dp_mode: str = "fsdp"  # one of DP_MODES
    pp: int = 1  # pipeline ranks
    virtual: int = 1  # stages per pipeline rank (interleaved 1F1B above 1)
    micro_batches: int = 1  # passes per step and copy (gradient accumulation, or the pipeline's)
    optimizer: str = "fused"  # AdamW's implementation, one of ADAMW
    dropout: bool = False  # the residual branches drop (a mask each is kept)
    device: str = "cpu"  # where the kernels run ("cpu", "cuda": activations.DEVICES)
    attention: str | None = None  # the SDPA kernel (activations.ATTENTION); None: torch's pick
    fused: bool = True  # the fused column projections (one cast of their input under autocast)
    keep_gathered_input: bool = False  # under SP the column ops keep their gathered input
    lora: Lora | None = None
    # positions restart at every example of a row (``--pack``): attention takes a block-diagonal
    # causal mask, and the rotary tables are made per row
    packed: bool = False
    # a Hugging Face model converted by tensorpar (its attention keeps other tensors than the
    # GPT's); None: whether ``lora`` is given (only those take adapters)
    converted: bool | None = field(default=None)
    ep: int = 1  # expert-parallel size: the routed experts split over ep of the dp x tp ranks
    # context-parallel size: each sequence split over cp ranks, 2 load-balanced chunks each
    # (``parallel/context.py``); the data-parallel engine spans the dp x cp ranks
    cp: int = 1

    @property
    def micro(self) -> int:
        """Sequences of one pass (micro-batch) on one data-parallel copy."""
        return self.batch // self.dp // self.micro_batches

    @property
    def autocast(self) -> bool:
        return self.dtype == "bf16-autocast"

    @property
    def rank_seq(self) -> int:
        """Tokens of each sequence on one CP rank: the most any rank holds
        (``parallel.context.cp_sizes``); the whole sequence without CP."""
        return max(cp_sizes(self.seq, self.cp))

    @property
    def dp_ranks(self) -> int:
        """The ranks the data-parallel engine spans: the dp copies times the CP ranks of each,
        which hold the same weights and sum their gradients with the copies' (FSDP2 shards
        over them all, as torchtitan's FSDP over dp x cp)."""
        return self.dp * self.cp

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 shards over more than one rank."""
        return self.dp_ranks > 1 and self.dp_mode == "fsdp"

    @property
    def is_converted(self) -> bool:
        return self.lora is not None if self.converted is None else self.converted

    def replace(self, **changes) -> Step:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_train_config(cls, cfg, shape: ModelShape, optimizer: str = "fused",
                          dropout: bool = False, device: str = "cpu",
                          converted: bool | None = None) -> Step:
        """The step ``tensorpar train`` runs for ``cfg`` (a ``train.config.TrainConfig``; the
        planner reads its fields and imports nothing of the trainer): its batch over ``dp``
        copies in passes of ``--micro-batch-size`` sequences, tensorpar's bf16 (autocast),
        full recomputation or none, packed rows or not. ``optimizer``: the trainer's AdamW
        implementation; ``dropout``: whether the model drops; ``device``: where the ranks ran;
        ``converted``: whether the model is a Hugging Face model (``Step.converted``)."""
        dp = cfg.dp or 1
        per_copy = cfg.batch_size // dp
        lora = None if cfg.lora_rank is None else Lora(cfg.lora_rank, cfg.lora_targets,
                                                         cfg.base_dtype, cfg.lora_dropout)
        return cls(shape, tp=cfg.tp, batch=cfg.batch_size, seq=cfg.seq_len,
                   dtype="bf16-autocast" if cfg.dtype == "bf16" else "fp32",
                   sequence_parallel=cfg.sequence_parallel,
                   recompute="full" if cfg.recompute else "none", dp=dp, dp_mode=cfg.dp_mode,
                   pp=cfg.pp, virtual=cfg.pp_virtual,
                   micro_batches=per_copy // (cfg.micro_batch_size or per_copy),
                   optimizer=optimizer, dropout=dropout, device=device, fused=cfg.fused,
                   lora=lora, packed=cfg.pack, converted=converted, ep=getattr(cfg, "ep", 1),
                   cp=getattr(cfg, "cp", None) or 1)


@dataclass(frozen=True)
class BlockBudget:
    """Bytes around one block's backward: "between" two blocks (the last block's activations
    and the head's gradient in), what a block's backward adds "inside", and what one block
    "kept" for it. ``Budget.block_copies`` holds the autocast weight copies in each."""

    between: int
    inside: int
    kept: int


@dataclass(frozen=True)
class Budget:
    """One rank's bytes in a steady training step (AdamW states exist; gradients are freed
    between steps): what it stores, what it keeps for backward, and each moment of the step.

    peaks: each moment's bytes above the weights and states ("loss backward", "block backward",
    "optimizer step", ...); copies: the bytes of autocast's bf16 weight copies each moment
    includes; held: bytes kept for the whole run besides (DDP's buckets); dp_buffers: data
    parallelism's buffers at the peak (DDP's buckets, or FSDP2's gathered weights and
    reduce-scatter buffers)."""

    dtype: str
    weights: int
    grads: int
    optimizer: int
    activations: int
    peaks: dict[str, int]
    copies: dict[str, int]
    blocks: BlockBudget
    block_copies: BlockBudget
    held: int = 0
    dp_buffers: int = 0

    @property
    def peak_at(self) -> str:
        return max(self.peaks, key=self.peaks.get)

    @property
    def peak_extra(self) -> int:
        return self.peaks[self.peak_at]

    @property
    def total(self) -> int:
        """The step's peak: weights + states + what is held + the largest moment."""
        return self.weights + self.optimizer + self.held + self.peak_extra

    def replace(self, **changes) -> Budget:
        return dataclasses.replace(self, **changes)
