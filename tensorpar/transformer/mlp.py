"""The tensor-parallel MLP: column-parallel up (and gate), row-parallel down.

::

    x ──f──> [gate_i, up_i] (column shards) ──act, no sync──> h_i ──> down_i (row shard) ──g──> y

    plain:   h_i = act(x W_up,i^T + b_up,i)
    gated:   h_i = act(x W_gate,i^T + b_gate,i) * (x W_up,i^T + b_up,i)     (SwiGLU with act=silu)

The non-linearity acts elementwise on each rank's hidden shard, so the block needs exactly one
all-reduce in forward (g, inside ``down``) and one in backward (f, on the input); under sequence
parallelism, one all-gather and one reduce-scatter each way instead, plus in backward the
all-gather of the input shard that gate and up keep in place of the gathered input (none with
``keep_gathered_input``). Gate and up are cut with the same ``tensor_split`` of the hidden dim,
so their shards always pair up.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.parallel.fused import fused_column
from tensorpar.parallel.linear import ColumnParallelLinear, RowParallelLinear, column_linears

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def _activation(activation: str | Callable) -> Callable:
    if callable(activation):
        return activation
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {sorted(ACTIVATIONS)} "
                         "or a callable")
    return ACTIVATIONS[activation]


class ParallelMLP(nn.Module):
    """MLP with its hidden dim split across the TP group.

    dim, hidden_dim: model and hidden widths. gated: add a gate projection (SwiGLU style).
    activation: a name in ``ACTIVATIONS`` or an elementwise callable.
    sequence_parallel: input and output are sequence shards (B, T/n, dim).
    fused: gate and up as one autograd op whose backward all-reduce is overlapped with the
        weight-gradient matmuls, and ``down`` reducing its product in place
        (``parallel/fused.py``); the same numbers and collectives.
    keep_gathered_input: under SP, gate and up keep the all-gathered (B, T, dim) input for
        backward; by default they keep this rank's (B, T/n, dim) shard and all-gather it again in
        backward, overlapped with the input-gradient matmul (one more all-gather, 1/n the memory).
    """

    def __init__(self, dim: int, hidden_dim: int, gated: bool = False,
                 activation: str | Callable = "gelu", bias: bool = True,
                 sequence_parallel: bool = False, group: ProcessGroup | None = None,
                 *, device=None, dtype=None, fused: bool = False,
                 keep_gathered_input: bool = False):
        super().__init__()
        self.act = _activation(activation)
        self.fused, self.keep_gathered_input = fused, keep_gathered_input
        self.sequence_parallel, self.group = sequence_parallel, group
        kw = {"group": group, "device": device, "dtype": dtype}
        self.gate = ColumnParallelLinear(dim, hidden_dim, bias, **kw) if gated else None
        self.up = ColumnParallelLinear(dim, hidden_dim, bias, **kw)
        self.down = RowParallelLinear(hidden_dim, dim, bias, input_is_parallel=True,
                                      sequence_parallel=sequence_parallel, fused=fused, **kw)

    @classmethod
    def from_dense(cls, up: nn.Linear, down: nn.Linear, gate: nn.Linear | None = None,
                   activation: str | Callable = "gelu", sequence_parallel: bool = False,
                   group: ProcessGroup | None = None, fused: bool = False,
                   keep_gathered_input: bool = False) -> ParallelMLP:
        """Shard dense ``up`` (dim -> hidden), ``down`` (hidden -> dim) and optional ``gate``."""
        if up.out_features != down.in_features or up.in_features != down.out_features:
            raise ValueError(f"ParallelMLP: up is {up.in_features}->{up.out_features} but down "
                             f"is {down.in_features}->{down.out_features}")
        if gate is not None and (gate.in_features, gate.out_features) != (up.in_features,
                                                                         up.out_features):
            raise ValueError(f"ParallelMLP: gate is {gate.in_features}->{gate.out_features}, "
                             f"up is {up.in_features}->{up.out_features}")
        mlp = cls(up.in_features, up.out_features, gate is not None, activation,
                  sequence_parallel=sequence_parallel, group=group, device="meta", fused=fused,
                  keep_gathered_input=keep_gathered_input)
        mlp.gate = None if gate is None else ColumnParallelLinear.from_dense(gate, group=group)
        mlp.up = ColumnParallelLinear.from_dense(up, group=group)
        mlp.down = RowParallelLinear.from_dense(down, input_is_parallel=True,
                                                sequence_parallel=sequence_parallel, group=group,
                                                fused=fused)
        return mlp

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """x: (B, T, dim), or under SP rank r's (B, T_r, dim) ``tensor_split`` shard of the T
        tokens, ``seq_len`` being T (without it the ranks exchange their sizes first)."""
        if x.shape[-1] != self.up.in_features:
            raise ValueError(f"ParallelMLP: input last dim {x.shape[-1]}, expected "
                             f"{self.up.in_features}")
        linears = [self.up] if self.gate is None else [self.gate, self.up]
        column = fused_column if self.fused else column_linears  # the block's only f
        hs = column(x, [m.weight for m in linears], [m.bias for m in linears],
                    sequence_parallel=self.sequence_parallel, group=self.group,
                    keep_gathered_input=self.keep_gathered_input, seq_len=seq_len)
        h = self.act(hs[0]) if self.gate is None else self.act(hs[0]) * hs[1]
        return self.down(h)
