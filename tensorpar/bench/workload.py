"""What every contender of ``tensorpar bench`` shares: the model, its weights, the batches, the
optimizer, and the shape of a training step.

A contender is a function run on every rank of its pool::

    setup(work, state, group) -> step          # state: dense_state(work), the full fp32 weights
    loss = step(ids_BT, targets_BT)            # forward, backward, optimizer step, zero_grad

so every contender starts from the same weights, sees the same batches and applies the same
AdamW, and its per-step losses can be compared with the dense fp32 run's.

``DenseLlama`` is the plain-PyTorch model: the unsharded contender, the reference, and the model
that DTensor's ``parallelize_module`` shards. It computes exactly what ``tensorpar.gpt.model.GPT``
computes (same rotary layout, same GQA head grouping, same loss).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.train.optim import adamw
from tensorpar.transformer.reference import DenseAttention, DenseMLP
from tensorpar.transformer.rotary import rotary_table


def _f(default, help_: str):
    return dataclasses.field(default=default, metadata={"help": help_})


@dataclass
class Workload:
    """The Llama-like model and the training step. Every field is a ``tensorpar bench`` flag."""

    dim: int = _f(512, "model width")
    n_head: int = _f(8, "query heads")
    n_kv_head: int = _f(2, "key/value heads (GQA)")
    n_layer: int = _f(4, "transformer blocks")
    vocab_size: int = _f(8192, "vocabulary size")
    hidden_dim: int = _f(0, "SwiGLU hidden width (0: 8/3 of dim, rounded up to a multiple of 32)")
    seq_len: int = _f(256, "tokens per sequence")
    batch_size: int = _f(4, "sequences per step")
    lr: float = _f(1e-3, "AdamW learning rate (constant)")
    seed: int = _f(0, "seed for weights and batches")

    def gpt_config(self) -> GPTConfig:
        """The same model as tensorpar's ``GPTConfig``: untied embeddings, no dropout."""
        return GPTConfig(vocab_size=self.vocab_size, n_layer=self.n_layer, dim=self.dim,
                         n_head=self.n_head, n_kv_head=self.n_kv_head,
                         hidden_dim=self.hidden_dim, tie_embeddings=False, dropout=0.0)

    def check(self, tp: int) -> None:
        """Raise ValueError naming the flag and the numbers if the model cannot be split."""
        for name in ("seq_len", "batch_size", "n_layer"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"--lr {self.lr} must be > 0")
        self.gpt_config().check(tp)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""One full training step on (ids_BT, targets_BT): forward, backward, optimizer step, zero_grad.
Returns the loss as a detached scalar."""


def dense_state(work: Workload) -> dict[str, torch.Tensor]:
    """The full fp32 weights, named like tensorpar's GPT at TP=1 (``embed.weight``,
    ``blocks.{i}.attn.q_proj.weight``, ..., ``lm_head.weight``), drawn by tensorpar's own seeded
    init. Local to this process: on a rank of a larger world it builds the model in a one-rank
    group of its own (no collective with the other ranks)."""
    solo = None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # only this rank takes part in creating it: no other rank has to call anything
        solo = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    try:
        model = GPT(work.gpt_config(), solo, seed=work.seed)
        return {name: p.detach() for name, p in model.named_parameters()}
    finally:
        if solo is not None:
            dist.destroy_process_group(solo)


def batch(work: Workload, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_BT, targets_BT), int64, depending only on (seed, step).

    Text-like enough that the loss falls: each token is followed by a fixed successor of it
    (a seeded permutation of the vocabulary) 3 times out of 4, by a random token otherwise.
    """
    B, T, V = work.batch_size, work.seq_len, work.vocab_size
    successor = torch.randperm(V, generator=torch.Generator().manual_seed(work.seed))
    gen = torch.Generator().manual_seed(work.seed * 1_000_003 + 7919 * (step + 1))
    noise_BT = torch.randint(0, V, (B, T + 1), generator=gen)
    follow_BT = torch.rand(B, T + 1, generator=gen) < 0.75
    tokens = [noise_BT[:, 0]]
    for t in range(1, T + 1):
        tokens.append(torch.where(follow_BT[:, t], successor[tokens[-1]], noise_BT[:, t]))
    seq_BT1 = torch.stack(tokens, dim=1)
    return seq_BT1[:, :-1].contiguous(), seq_BT1[:, 1:].contiguous()


def mixed_precision(device: torch.device) -> AbstractContextManager:
    """The forward's precision, the same for every contender: bf16 autocast on a GPU (weights,
    gradients and AdamW stay fp32), plain fp32 on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def model_flops_per_step(work: Workload, n_params: int) -> int:
    """Model FLOPs of one training step, what MFU is quoted against: 6 per parameter per token
    (2 forward, 4 backward) plus causal attention's scores and weighted values, 6 * L * T * D per
    token (12 * L * T * D, halved by the mask). Recomputation is not counted."""
    return work.tokens_per_step * (6 * n_params + 6 * work.n_layer * work.seq_len * work.dim)


def make_optimizer(params, work: Workload) -> torch.optim.AdamW:
    """The same AdamW for every contender: the same hyperparameters (constant lr, decay on all)
    and the same implementation, torch's fused kernel (``tensorpar.train.optim``), which DTensor
    parameters take too."""
    return adamw(params, lr=work.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class DenseBlock(nn.Module):
    """x = x + attn(norm(x)); x = x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = DenseAttention(cfg.dim, cfg.n_head, cfg.n_kv_head)  # with rotary
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = DenseMLP(cfg.dim, cfg.hidden_dim)  # SwiGLU

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), (cos, sin))
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))


class DenseLlama(nn.Module):
    """The benchmark's model in plain PyTorch, loaded with ``dense_state(work)``.

    ``model(ids_BT, targets_BT)`` returns the mean cross-entropy; without targets the logits
    (B, T, V). The logits are flattened to (B*T, V) before the loss, which is what
    ``loss_parallel`` expects of a vocab-sharded DTensor.
    """

    def __init__(self, work: Workload, state: dict[str, torch.Tensor] | None = None):
        super().__init__()
        cfg = work.gpt_config()
        self.cfg = cfg
        with torch.device("meta"):
            self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.blocks = nn.ModuleList(DenseBlock(cfg) for _ in range(cfg.n_layer))
            self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
            self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        state = dense_state(work) if state is None else state
        # clone: contenders in one process must not share (and update) the same storage
        self.load_state_dict({k: v.clone() for k, v in state.items()}, strict=True, assign=True)

    def forward(self, ids_BT: torch.Tensor, targets_BT: torch.Tensor | None = None):
        T = ids_BT.shape[1]
        cos, sin = rotary_table(self.cfg.head_dim, 0, T, self.cfg.rope_theta, ids_BT.device)
        x_BTD = self.embed(ids_BT)
        for block in self.blocks:
            x_BTD = block(x_BTD, cos, sin)
        logits_BTV = self.lm_head(self.norm(x_BTD))
        if targets_BT is None:
            return logits_BTV
        return F.cross_entropy(logits_BTV.flatten(0, 1), targets_BT.flatten(0, 1))
