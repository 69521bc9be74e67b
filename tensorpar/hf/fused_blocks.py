"""The column side of a converted block as one fused, overlapped op, as in tensorpar's GPT.

A Hugging Face attention or MLP module calls its column projections one by one on its input
(``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)``; ``gate_proj(x)``, ``up_proj(x)``; GPT-2's
``c_attn(x)``). After conversion the first of those calls computes all of them at once with
``parallel.fused.fused_column``, the op the GPT's attention and MLP use::

    block entry (pre-hook)  notes the block's input x; under sequence parallelism x is this
                            rank's (B, T_r, D) shard and the block's own forward is handed a
                            stand-in of the full (B, T, D) shape instead (HF code reads only its
                            shape, e.g. ``hidden_states.shape[:-1]``, and passes it on to the
                            projections)
    first column call       q, k, v = fused_column(x, [W_q, W_k, W_v], ...): one autograd op;
                            forward: f (or the SP all-gather), the matmuls; backward: the
                            input-gradient all-reduce (or reduce-scatter) runs while the
                            weight-gradient matmuls compute
    every column call       hands out its product (again, if called twice)
    block exit              forgets the products
    row layer               the matmul and its all-reduce as one op, reduced in place
                            (``fused_row``; under SP the reduce-scatter), set up by the converter

KV heads that several ranks hold (fewer KV heads than ranks) have their K and V gradients summed
over those ranks in one all-reduce, as in ``ParallelSelfAttention``.

A column called on another tensor than its block's input (a module that transforms its input
first) computes its product alone, with ``fused_column`` over its own weight: correct, with one
input-gradient all-reduce of its own. Under sequence parallelism that is refused (the block's
forward held a stand-in, not values).

``FusedColumnLinear`` is the same op for a single column layer (a plan's ``column`` /
``column_gather``: the LM head), reading the sequence length from the model's
``SequenceShards`` under SP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.parallel.fused import ColumnLoRA, fused_column
from tensorpar.parallel.linear import ColumnParallelLinear
from tensorpar.parallel.lora import (
    column_lora,
    column_update,
    dropped_column_products,
    drops,
    has_lora,
)
from tensorpar.parallel.mappings import gather_from_tp, sum_shared_shard_grads
from tensorpar.parallel.sharding import ShardSpec

if TYPE_CHECKING:
    from tensorpar.hf.sequence import SequenceLength


class InRegionColumn(ColumnParallelLinear):
    """A column projection inside a converted block: its product comes from the block's
    ``Region`` (one fused op for all the block's columns).

    shared: this rank's rows are also held by other ranks (KV heads shared when there are fewer
    than ranks): their gradients are summed over exactly those ranks in backward.
    shard_spec: where this rank's rows sit in the dense weight (and bias), set by the converter;
    read here, never off ``self.weight.tp_shard``: under FSDP2 the weight seen in forward is a
    gathered tensor without the tag.
    expand: local head index per output head (KV heads repeated per local query head).
    """

    shared = False
    shard_spec: ShardSpec | None = None
    expand: torch.Tensor | None = None
    head_dim = 0
    region: Region | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.region.product(self, x)
        if self.expand is not None:  # (..., kv_local * hd) -> (..., h_local * hd)
            y = y.unflatten(-1, (-1, self.head_dim)).index_select(-2, self.expand).flatten(-2)
        return y


class Region:
    """The columns of one converted block and, while its forward runs, their products."""

    def __init__(self, module: nn.Module, columns: list[InRegionColumn],
                 group: ProcessGroup | None, seq: SequenceLength | None = None):
        self.columns, self.group, self.seq = columns, group, seq
        self._input = self._handed = self._products = None
        for c in columns:
            c.region = self
        module.register_forward_pre_hook(self._enter, with_kwargs=True)
        module.register_forward_hook(self._leave, always_call=True)

    def _enter(self, module, args, kwargs):
        named = "hidden_states" in kwargs
        x = kwargs["hidden_states"] if named else args[0]
        handed = x
        if self.seq is not None:  # (B, T_r, D) -> a stand-in of (B, T, D), no memory
            handed = x.new_zeros(()).expand(x.shape[0], self.seq.length, x.shape[-1])
        self._input, self._handed, self._products = x, handed, None
        if named:
            return args, kwargs | {"hidden_states": handed}
        return (handed, *args[1:]), kwargs

    def _leave(self, module, args, out):
        self._input = self._handed = self._products = None

    def _weights(self, columns: list[InRegionColumn], adapted: list[InRegionColumn]):
        """Each column's (weight, bias), the shared rows' gradients summed in one all-reduce,
        and the adapted columns' B (``parallel/lora.py``)."""
        ws, bs = [c.weight for c in columns], [c.bias for c in columns]
        b_lora = [c.lora_B.weight for c in adapted]
        # (list, index) of each tensor of shared rows that trains (a frozen one needs no sum)
        places = [(t, i) for t, cs in ((ws, columns), (bs, columns), (b_lora, adapted))
                  for i, c in enumerate(cs)
                  if c.shared and t[i] is not None and t[i].requires_grad]
        if places:
            spec = next(c for c in columns if c.shared).shard_spec
            summed = sum_shared_shard_grads([t[i] for t, i in places], self.group, spec)
            for (t, i), s in zip(places, summed, strict=True):
                t[i] = s
        return ws, bs, b_lora

    def _products_of(self, columns: list[InRegionColumn], x: torch.Tensor,
                     length: int | None) -> list[torch.Tensor]:
        adapted = [c for c in columns if has_lora(c)]
        ws, bs, b_lora = self._weights(columns, adapted)
        if not any(drops(c) for c in adapted):  # the adapters are part of the fused op
            lora = column_lora(adapted, [columns.index(c) for c in adapted], b_lora, x,
                               self.group, length is not None) if adapted else None
            return list(column_op(x, ws, bs, self.group, length, lora))
        # an adapter that drops has an input of its own: A leaves the fused op
        ys = list(column_op(x, ws, bs, self.group, length))
        zs = dropped_column_products(x, adapted, self.group, length)
        for j, c in enumerate(adapted):
            i = columns.index(c)
            ys[i] = column_update(ys[i], zs[j], c, b_lora[j])
        return ys

    def product(self, column: InRegionColumn, x: torch.Tensor) -> torch.Tensor:
        """``column``'s output for input ``x`` (computed with its siblings' on the first call)."""
        length = self.seq.length if self.seq is not None else None
        if x is self._handed and x is not None:
            if self._products is None:
                self._products = self._products_of(self.columns, self._input, length)
            return self._products[self.columns.index(column)]
        if self.seq is not None:
            raise RuntimeError(f"{type(column).__name__}: under sequence parallelism a column "
                               "projection must be called on its block's input, as is")
        return self._products_of([column], x, None)[0]


def column_op(x: torch.Tensor, weights, biases, group: ProcessGroup | None,
              seq_len: int | None = None,
              lora: ColumnLoRA | None = None) -> tuple[torch.Tensor, ...]:
    """``fused_column`` on an input of any shape (..., D) (it takes (B, T, D)); ``seq_len``:
    under sequence parallelism T, x being this rank's (B, T_r, D) shard; ``lora``: as
    ``fused_column``'s."""
    if x.dim() == 3:
        return fused_column(x, weights, biases, sequence_parallel=seq_len is not None,
                            group=group, seq_len=seq_len, lora=lora)
    ys = fused_column(x.reshape(1, -1, x.shape[-1]), weights, biases, group=group, lora=lora)
    return tuple(y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys)


class FusedColumnLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` computed by ``fused_column`` (a plan's ``column`` and
    ``column_gather`` layers: the input-gradient all-reduce overlapped with the weight-gradient
    matmul, as the GPT's head). seq: under sequence parallelism, where T is noted (the input is
    then this rank's sequence shard, gathered inside the op)."""

    seq: SequenceLength | None = None

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        seq_len = (seq_len or self.seq.length) if self.seq is not None else None
        if has_lora(self) and drops(self):
            (y,) = column_op(x, [self.weight], [self.bias], self.group, seq_len)
            y = column_update(y, dropped_column_products(x, [self], self.group, seq_len)[0], self)
        elif has_lora(self):
            lora = column_lora([self], [0], [self.lora_B.weight], x, self.group,
                               seq_len is not None)
            (y,) = column_op(x, [self.weight], [self.bias], self.group, seq_len, lora)
        else:
            (y,) = column_op(x, [self.weight], [self.bias], self.group, seq_len)
        if self.gather_output:
            y = gather_from_tp(y, self.group, full_size=self.out_features)
        return y
