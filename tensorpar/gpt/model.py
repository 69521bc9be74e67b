"""A GPT built from the tensor-parallel layers (Llama-shaped: RMSNorm, rotary, GQA, SwiGLU).

The model code does not depend on the TP size: each layer takes ``group`` and holds its shard.
Where the model is split::

    module                      split                 what each rank holds
    embed                       vocab-parallel        rows [v0, v1) of the vocabulary
    blocks.i.attn_norm          replicated            all of it (SP: applied to T/n tokens)
    blocks.i.attn.{q,k,v}_proj  column (by heads)     its query heads and the KV heads they read
    blocks.i.attn.o_proj        row (by heads)        the matching input columns
    blocks.i.mlp_norm           replicated
    blocks.i.mlp.{gate,up}      column                hidden units [h0, h1)
    blocks.i.mlp.down           row                   the matching input columns
    norm                        replicated
    lm_head (or tied to embed)  column (by vocab)     logits for [v0, v1); the loss never gathers

Per block: one all-reduce in forward and one in backward for attention, the same for the MLP
(under sequence parallelism each becomes an all-gather plus a reduce-scatter).

Context parallelism (``cp_group=``): every CP rank is given the whole rows (ids, targets,
packed positions) and keeps its load-balanced chunks of them (``parallel/context.py``); the
blocks run on those tokens (under SP split once more over TP), attention all-gathers the keys
and values over CP, and the loss is this rank's tokens' share (see ``forward``).

Initialization depends only on the seed and each parameter's name: every parameter is drawn dense
from its own generator and sliced, so TP=1, 2 and 4 start from the same weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from tensorpar.gpt.moe_blocks import GPTMoE, check_moe
from tensorpar.parallel.context import cp_sizes, split_to_cp
from tensorpar.parallel.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.parallel.dropout import ParallelDropout, TensorParallelRNG, region_for
from tensorpar.parallel.embedding import VocabParallelEmbedding
from tensorpar.parallel.fused import fused_column
from tensorpar.parallel.linear import ColumnParallelLinear, column_linears
from tensorpar.parallel.norm import RMSNorm
from tensorpar.parallel.sharding import dense_shape
from tensorpar.parallel.stages import mark_stage_copy
from tensorpar.runtime.groups import tp_rank, tp_size
from tensorpar.runtime.seeds import derive_seed
from tensorpar.transformer.attention import (
    ParallelSelfAttention,
    head_shards,
    packed_causal_mask,
    padded_causal_mask,
)
from tensorpar.transformer.context_parallel import CPSequence, cp_size
from tensorpar.transformer.expert_groups import ExpertGroups
from tensorpar.transformer.kv_cache import KVCache
from tensorpar.transformer.mlp import ParallelMLP
from tensorpar.transformer.rotary import rotary_table, rotary_table_at


@dataclass
class GPTConfig:
    """The model's shape. Every field is a ``tensorpar train`` flag (``--n-layer`` ...)."""

    vocab_size: int = dataclasses.field(default=256, metadata={
        "help": "vocabulary size (256: the byte tokenizer)"})
    n_layer: int = dataclasses.field(default=6, metadata={"help": "transformer blocks"})
    dim: int = dataclasses.field(default=192, metadata={"help": "model width"})
    n_head: int = dataclasses.field(default=6, metadata={"help": "query heads"})
    n_kv_head: int = dataclasses.field(default=2, metadata={
        "help": "key/value heads (GQA; 1 is MQA, n_head is MHA)"})
    hidden_dim: int = dataclasses.field(default=0, metadata={
        "help": "SwiGLU hidden width (0: 8/3 of dim, rounded up to a multiple of 32)"})
    tie_embeddings: bool = dataclasses.field(default=True, metadata={
        "help": "the LM head reuses the embedding table"})
    rope_theta: float = dataclasses.field(default=10000.0, metadata={
        "help": "rotary embedding base"})
    norm_eps: float = dataclasses.field(default=1e-5, metadata={"help": "RMSNorm epsilon"})
    dropout: float = dataclasses.field(default=0.0, metadata={
        "help": "dropout on each residual branch"})
    # Mixture of Experts (gpt/moe_blocks.py): every block's MLP routed to experts
    moe_experts: int = dataclasses.field(default=0, metadata={
        "help": "routed experts per block, each a SwiGLU of --hidden-dim (0: dense MLP blocks)"})
    moe_top_k: int = dataclasses.field(default=2, metadata={
        "help": "with --moe-experts: the experts each token goes to"})
    moe_shared_experts: int = dataclasses.field(default=0, metadata={
        "help": "with --moe-experts: shared experts every token goes through (one SwiGLU of "
                "this many times --hidden-dim, split by TP)"})
    moe_router: str = dataclasses.field(default="softmax", metadata={
        "help": "with --moe-experts: softmax (Mixtral: top-k of the softmax, renormalised) or "
                "sigmoid (DeepSeek-V3: top-k of sigmoid scores plus a selection bias)"})
    moe_balance: str = dataclasses.field(default="aux", metadata={
        "help": "with --moe-experts: aux (the load-balancing loss alone) or bias (also "
                "DeepSeek-V3's loss-free balancing: the sigmoid router's selection bias moved "
                "after each step by --moe-bias-rate x sign(mean load - load), loads summed over "
                "all ranks)"})
    moe_aux_coef: float = dataclasses.field(default=0.01, metadata={
        "help": "with --moe-experts: the load-balancing loss's coefficient (E x sum f_i P_i, "
                "as transformers' Mixtral; k when balanced)"})
    moe_z_coef: float = dataclasses.field(default=0.0, metadata={
        "help": "with --moe-experts: the router z-loss's coefficient (mean logsumexp^2)"})
    moe_bias_rate: float = dataclasses.field(default=0.001, metadata={
        "help": "with --moe-balance bias: the selection bias's step"})

    def __post_init__(self):
        if self.hidden_dim == 0:
            self.hidden_dim = 32 * math.ceil(8 * self.dim / 3 / 32)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    def check(self, tp: int) -> None:
        """Raise ValueError, naming the flags and numbers, if the model cannot be split."""
        if min(self.vocab_size, self.n_layer, self.dim, self.n_head, self.n_kv_head) < 1:
            raise ValueError(f"model sizes must be positive: {self}")
        if self.dim % self.n_head or self.head_dim % 2:
            raise ValueError(f"--dim {self.dim} must divide by --n-head {self.n_head} into an "
                             "even head_dim (rotary embeddings rotate channel pairs)")
        try:
            head_shards(self.n_head, self.n_kv_head, tp, 0)
        except ValueError as e:
            raise ValueError(f"--n-head {self.n_head}, --n-kv-head {self.n_kv_head}, --tp {tp}: "
                             f"{e}") from None
        for flag, value in (("--vocab-size", self.vocab_size), ("--hidden-dim", self.hidden_dim)):
            if value < tp:
                raise ValueError(f"{flag} {value} cannot be split over --tp {tp}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--dropout {self.dropout} must be in [0, 1)")
        check_moe(self)


class Block(nn.Module):
    """x = x + attn(norm(x)); x = x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig, sequence_parallel: bool, group: ProcessGroup | None,
                 rng: TensorParallelRNG, device=None, fused: bool = True,
                 keep_gathered_input: bool = False, experts: ExpertGroups | None = None,
                 cp_group: ProcessGroup | None = None):
        super().__init__()
        kw = {"sequence_parallel": sequence_parallel, "group": group}
        cols = {"fused": fused, "keep_gathered_input": keep_gathered_input}
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device, **kw)
        self.attn = ParallelSelfAttention(cfg.dim, cfg.n_head, cfg.n_kv_head, bias=False,
                                          device=device, cp_group=cp_group, **cols, **kw)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device, **kw)
        self.mlp = GPTMoE(cfg, sequence_parallel, group, experts, device) if cfg.moe_experts \
            else ParallelMLP(cfg.dim, cfg.hidden_dim, gated=True, activation="silu",
                             bias=False, device=device, **cols, **kw)
        # the residual stream is replicated, or sequence-sharded under SP: pick the mask stream
        self.drop = ParallelDropout(cfg.dropout, rng, region_for(sequence_parallel))

    def forward(self, x, rope, cache=None, attn_mask=None, seq_len=None, key=None, context=None):
        """x: (B, T, D), or under SP this rank's (B, T_r, D) shard of the ``seq_len`` tokens.
        key: the dropout key of the block (its masks: sites 0 and 1), or None: a new one.
        context: under CP, the whole sequence (``CPSequence``); x and seq_len are then this CP
        rank's tokens."""
        if key is None and self.drop.p > 0 and self.drop.training:
            key = self.drop.rng.key(self.drop.region)
        x = x + self.drop(self.attn(self.attn_norm(x), rope, cache, attn_mask, seq_len,
                                    context=context), key, 0)
        return x + self.drop(self.mlp(self.mlp_norm(x), seq_len), key, 1)


class BlockDict(nn.ModuleDict):
    """The blocks a model (or a pipeline stage's part of it) holds, keyed by their index in the
    whole model, so their parameters keep the names ``blocks.{i}.…`` whichever blocks are held.
    Iterates over the blocks, in order; ``blocks[i]`` is block i."""

    def __iter__(self):
        return iter(self.values())

    def __getitem__(self, i: int | str) -> nn.Module:
        return super().__getitem__(str(i))

    def indices(self) -> list[int]:
        return [int(k) for k in self.keys()]


class GPT(nn.Module):
    """The GPT of ``cfg`` split over ``group``.

    sequence_parallel: the residual stream between blocks holds T/n tokens per rank.
    rng: dropout streams (``rng.set_step(s)`` before step s); only used when cfg.dropout > 0.
    seed: weights depend on it and on each parameter's name, never on the TP size.
    fused: QKV, gate/up and the LM head each as one autograd op that overlaps the backward
        all-reduce of the input gradient with the weight-gradient matmuls, and the row layers
        reducing their product in place (``parallel/fused.py``, ``fused_row.py``); False: the
        plain layers. Same parameters, same numbers (to fp32 rounding), same collectives.
    recompute: keep only each block's input in forward and recompute the block in backward
        (full activation recomputation: less memory, one more forward per block, whose
        collectives run again). The recomputed block draws the dropout masks of the first.
    keep_gathered_input: under SP, the column layers (QKV, gate/up, the head) keep their
        all-gathered (B, T, D) input for backward instead of their (B, T/n, D) shard and skip
        the all-gather again in backward (the default keeps the shard, as Megatron does: less
        memory, one more all-gather per column op, overlapped with the input-gradient matmul).
    cp_group: the context-parallel group (None: no CP): ``forward`` takes the whole rows and
        keeps this rank's chunks of them.
    blocks, embed, head: a pipeline rank's part of the model (``gpt/stages.py``): only the
        blocks of those indices (default all), the embedding only if ``embed``, the final norm
        and the head only if ``head``; every parameter has its name and its values in the whole
        model. A tied head without the embedding holds a copy of the embedding table
        (``parallel.stages.mark_stage_copy``): the trainer sums the two copies' gradients over
        the first and last pipeline stages, so they stay equal.
    experts: with ``cfg.moe_experts``, the groups of the MoE blocks (``mesh/experts.py``:
        EP, router statistics, expert-data); None: the experts split over ``group``.
    """

    def __init__(self, cfg: GPTConfig, group: ProcessGroup | None = None,
                 sequence_parallel: bool = False, seed: int = 0,
                 rng: TensorParallelRNG | None = None, device=None, *, fused: bool = True,
                 recompute: bool = False, keep_gathered_input: bool = False,
                 blocks: Sequence[int] | None = None, embed: bool = True, head: bool = True,
                 experts: ExpertGroups | None = None, cp_group: ProcessGroup | None = None):
        super().__init__()
        cfg.check(tp_size(group))
        self.cfg, self.group, self.sequence_parallel = cfg, group, sequence_parallel
        self.cp_group = cp_group if cp_size(cp_group) > 1 else None
        self.fused, self.recompute = fused, recompute
        self.keep_gathered_input = keep_gathered_input
        self.rng = rng or TensorParallelRNG(seed, group)
        kw = {"sequence_parallel": sequence_parallel, "group": group, "device": device}
        # built on the meta device, then every parameter drawn by ``init_weights``
        meta = {**kw, "device": "meta"}
        # a tied head without the first stage holds a copy of the table (``mark_stage_copy``)
        copy = cfg.tie_embeddings and head and not embed
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.dim, **meta) \
            if embed or copy else None
        held = range(cfg.n_layer) if blocks is None else blocks
        self.blocks = BlockDict({str(i): Block(cfg, sequence_parallel, group, self.rng, "meta",
                                               fused, keep_gathered_input, experts,
                                               self.cp_group)
                                 for i in held})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, **meta) if head else None
        if recompute:
            # a replayed block stops once its last saved tensor is back: with the all-reduce
            # outside the row matmul's op, the replay skips the MLP's exit (one fewer per block)
            for block in self.blocks:
                mlp = block.mlp.shared if cfg.moe_experts else block.mlp
                block.attn.o_proj.fused = False
                if mlp is not None:
                    mlp.down.fused = False
        self.lm_head = None if cfg.tie_embeddings or not head else \
            ColumnParallelLinear(cfg.dim, cfg.vocab_size, bias=False, **meta)
        self.init_weights(seed, device)
        if copy:  # drawn from its name as the first stage's: the same initial values
            mark_stage_copy(self.embed.weight)

    @torch.no_grad()
    def init_weights(self, seed: int, device=None) -> None:
        """Draw each parameter dense from a generator seeded by (seed, name), keep this rank's
        slice. GPT-2's scheme: N(0, 0.02), residual output projections scaled by 1/sqrt(2L),
        norms at one."""
        for name, p in self.named_parameters():
            spec = p.tp_shard
            if name.endswith("norm.weight"):
                full = torch.ones(dense_shape(p))
            else:
                std = 0.02
                if name.endswith(("o_proj.weight", "down.weight", "down_proj")):
                    std /= math.sqrt(2 * self.cfg.n_layer)
                gen = torch.Generator().manual_seed(derive_seed(seed, "init", name))
                full = torch.empty(dense_shape(p)).normal_(0.0, std, generator=gen)
            if spec.dim is not None:
                full = full.narrow(spec.dim, spec.start, spec.stop - spec.start)
            local = nn.Parameter(full.to(device=device, dtype=p.dtype).clone(),  # not a view:
                                 requires_grad=p.requires_grad)  # it would keep all of `full`
            local.tp_shard = spec
            if hasattr(p, "ep_shard"):  # an MoE block's experts (moe_blocks.py)
                local.ep_shard = p.ep_shard
            owner, attr = self._owner(name)
            setattr(owner, attr, local)
        for block in self.blocks:  # buffers built on meta
            block.attn.kv_index = block.attn.kv_index.to(device or "cpu")
            if isinstance(block.mlp, GPTMoE):
                block.mlp.materialize(device)

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        path, _, attr = name.rpartition(".")
        return self.get_submodule(path), attr

    def positions(self, B: int, T: int, device, cache: KVCache | None = None,
                  attention_mask_BS: torch.Tensor | None = None,
                  position_ids: torch.Tensor | None = None):
        """The rotary table and the attention mask (None: plain causal) of a forward over T
        tokens (``forward`` says what each argument means)."""
        start = cache.length if cache is not None else 0
        if self.cp_group is not None:  # the whole rows' rotary table; attention masks itself
            if cache is not None or attention_mask_BS is not None:
                raise ValueError("context parallelism is for training: no cache and no "
                                 "attention_mask_BS")
            if position_ids is None:
                return rotary_table(self.cfg.head_dim, 0, T, self.cfg.rope_theta, device), None
            return rotary_table_at(self.cfg.head_dim, position_ids, self.cfg.rope_theta), None
        if position_ids is not None:
            if cache is not None or attention_mask_BS is not None:
                raise ValueError("position_ids (packed examples) is for training: without a "
                                 "cache or an attention_mask_BS")
            if tuple(position_ids.shape) != (B, T):
                raise ValueError(f"position_ids is {tuple(position_ids.shape)}; expected "
                                 f"(B, T) = ({B}, {T})")
            rope = rotary_table_at(self.cfg.head_dim, position_ids, self.cfg.rope_theta)
            return rope, packed_causal_mask(position_ids)
        if attention_mask_BS is None:
            return rotary_table(self.cfg.head_dim, start, T, self.cfg.rope_theta, device), None
        if tuple(attention_mask_BS.shape) != (B, start + T):
            raise ValueError(f"attention_mask_BS is {tuple(attention_mask_BS.shape)}; "
                             f"expected (B, cached + T) = ({B}, {start + T})")
        valid_BS = attention_mask_BS.bool()
        pos_BT = (valid_BS.long().cumsum(-1) - 1).clamp(min=0)[:, start:]  # padding: 0
        rope = rotary_table_at(self.cfg.head_dim, pos_BT, self.cfg.rope_theta)
        return rope, padded_causal_mask(valid_BS, T)  # (B, 1, T, S), the same for each block

    def cp_local(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """This CP rank's chunks of whole rows ``t`` (B, T, ...) (``t`` itself without CP)."""
        return t if t is None or self.cp_group is None else split_to_cp(t, self.cp_group)

    def cp_tokens(self, T: int) -> int:
        """How many of the rows' T tokens this CP rank holds (T without CP)."""
        if self.cp_group is None:
            return T
        return cp_sizes(T, cp_size(self.cp_group))[tp_rank(self.cp_group)]

    def cp_context(self, T: int, position_ids: torch.Tensor | None) -> CPSequence | None:
        """What attention needs of the whole rows under CP (None without CP)."""
        return None if self.cp_group is None else CPSequence(T, position_ids)

    def run_blocks(self, x: torch.Tensor, rope, attn_mask, T: int,
                   cache: KVCache | None = None, blocks: BlockDict | None = None,
                   first_key: int | None = None, context: CPSequence | None = None
                   ) -> torch.Tensor:
        """``x`` through ``blocks`` (default this model's), each block's dropout key taken here:
        a recomputed block is handed it again (the masks of its first forward), and a compiled
        checkpoint sees no side effect. first_key: block i's key is number first_key + i + 1 of
        its stream (a pipeline stage's, the number the whole model's forward gives it);
        None: the stream's next keys. context: under CP the whole rows (``cp_context``), T
        then this rank's token count."""
        recompute = self.recompute and cache is None and torch.is_grad_enabled()
        for i, block in (self.blocks if blocks is None else blocks).items():
            i = int(i)
            key = None
            if block.drop.training and self.cfg.dropout > 0:
                key = self.rng.key(block.drop.region) if first_key is None else \
                    self.rng.key_at(block.drop.region, first_key + i + 1)
            if recompute:
                x = checkpoint(block, x, rope, None, attn_mask, T, key, context,
                               use_reentrant=False)
            else:
                x = block(x, rope, cache.layers[i] if cache is not None else None, attn_mask, T,
                          key, context)
        return x

    def logits(self, x: torch.Tensor, T: int) -> torch.Tensor:
        """The final norm and the head: this rank's logits (B, T, V_local); the loss never
        gathers them."""
        x = self.norm(x)
        # tied: the embedding's vocab rows are exactly a column-parallel head's shard
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        column = fused_column if self.fused else column_linears
        (logits_BTV_local,) = column(x, [head], sequence_parallel=self.sequence_parallel,
                                     group=self.group,
                                     keep_gathered_input=self.keep_gathered_input, seq_len=T)
        return logits_BTV_local

    def new_cache(self, max_len: int) -> KVCache:
        """An empty KV cache for ``max_len`` positions (this rank's KV heads only)."""
        return KVCache(self.cfg.n_layer, max_len)

    def forward(self, ids_BT: torch.Tensor, targets_BT: torch.Tensor | None = None,
                cache: KVCache | None = None,
                attention_mask_BS: torch.Tensor | None = None,
                loss_tokens: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T), the same on every rank. Returns this rank's logits
        (B, T, V_local), or with targets the mean cross-entropy over the targets that are not
        ignored (-100) (a scalar, the same on every rank). With a cache, the T new tokens follow
        the cached ones.

        loss_tokens: the number of targets the loss is a mean over, when this batch is a part of
        them (a pass of an accumulated step, a data-parallel slice): the losses of the batch's
        targets summed, divided by it (a 0-dim tensor). None: this batch's own count.

        attention_mask_BS: a left-padded batch (generation): (B, S) over the S = cached + T
        positions, 1 (True) at real tokens and 0 at padding, as in transformers. Padding is never
        attended and each sequence's rotary positions start at 0 at its first real token, so a
        prompt gets the logits it gets alone. None: every token is real (training's fused
        causal attention).

        position_ids: (B, T) positions restarting at 0 at each of several examples packed in a
        row (``--pack``): the rotary positions, and attention confined to each example (the
        block-diagonal causal mask), so an example's logits are those it gets alone.

        Under CP (``cp_group``) the ids, targets and position_ids are the whole rows, the same
        on every CP rank; the logits are this rank's chunks' (``split_to_cp`` order), and the
        loss is its chunks' summed losses over loss_tokens, which is then the step's count over
        the ranks the gradient is averaged over (dp x cp); None: the rows' count / cp, so that
        the mean over the CP ranks is the rows' mean."""
        B, T = ids_BT.shape
        ids, targets = self.cp_local(ids_BT), self.cp_local(targets_BT)
        t = ids.shape[1]  # this CP rank's tokens (T without CP)
        if self.cp_group is not None and targets is not None and loss_tokens is None:
            count = (targets_BT != -100).sum()
            loss_tokens = count / cp_size(self.cp_group)
        x = self.embed(ids)  # (B, t, D); under SP this rank's tensor_split shard (B, t_r, D)
        rope, attn_mask = self.positions(B, T, ids_BT.device, cache, attention_mask_BS,
                                         position_ids)
        x = self.run_blocks(x, rope, attn_mask, t, cache, context=self.cp_context(T, position_ids))
        logits_BTV_local = self.logits(x, t)
        if targets is None:
            return logits_BTV_local
        loss = vocab_parallel_cross_entropy(
            logits_BTV_local, targets, group=self.group, vocab_size=self.cfg.vocab_size,
            reuse_logits=True, reduction="mean" if loss_tokens is None else "sum")
        return loss if loss_tokens is None else loss / loss_tokens
