"""Column- and row-parallel linear layers (Shoeybi et al., 2019, section 3).

Both keep ``nn.Linear``'s layout, ``weight`` of shape (out, in), and compute Y = X W^T + b.

Column parallel: W is split along its output features (weight dim 0, with the bias)::

    W = [W_0; W_1; ...; W_{n-1}]      rank i:  Y_i = f(X) W_i^T + b_i     (B, T, out_i)

    The input is replicated (f = copy_to_tp: identity forward, all-reduce backward) or, under
    sequence parallelism, all-gathered along the sequence. The output stays sharded on its last
    dim, or is all-gathered when ``gather_output=True``. Under SP the layer keeps only this rank's
    (B, T_r, in) shard of X for backward and all-gathers it again there, while dX = dY_i W_i
    computes (``column_linears``; Korthikanti et al. 2022, as Megatron).

Row parallel: W is split along its input features (weight dim 1)::

    W = [W_0, W_1, ..., W_{n-1}]      rank i:  P_i = X_i W_i^T             (B, T, out)
    Y = g(sum_i P_i) + b

    The input arrives sharded on its last dim (``input_is_parallel=True``, typically a column
    layer's output) or is split here. The partial products are summed with one all-reduce (g), or
    reduce-scattered along the sequence under SP. The bias is added once, after the reduction.

Construction: ``Layer(in, out, ...)`` draws the dense ``nn.Linear(in, out)`` from torch's RNG and
keeps this rank's slice, so a given seed gives the same model at every TP size.
``Layer.from_dense(linear, ...)`` slices an existing dense layer instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.parallel.fused import fused_row, regathering_column
from tensorpar.parallel.lora import has_lora, lora_row, row_addend
from tensorpar.parallel.mappings import (
    enter_tp_region,
    exit_tp_region,
    gather_from_sequence,
    gather_from_tp,
    scatter_to_tp,
    sum_grads_in_backward,
)
from tensorpar.parallel.sharding import replicated_parameter, shard_range, sharded_parameter
from tensorpar.runtime.groups import tp_rank, tp_size


def column_linears(x: torch.Tensor, weights: list[torch.Tensor],
                   biases: list[torch.Tensor | None] | None = None, *,
                   sequence_parallel: bool = False, group: ProcessGroup | None = None,
                   keep_gathered_input: bool = False,
                   seq_len: int | None = None) -> tuple[torch.Tensor, ...]:
    """The plain column side of a block: Y_i = enter_tp_region(X) W_i^T + b_i for each weight.

    x: (B, T, D), or under SP (B, T_r, D), rank r's ``tensor_split`` shard of the T tokens,
    entering the TP region once for all the weights. seq_len: T, under SP; without it the ranks
    exchange their shard sizes first (``mappings.gather_from_sequence``).
    Under SP (n > 1) the matmuls keep only ``x``, this rank's shard, for backward and all-gather
    it again there, overlapped with the input-gradient matmul (``fused.regathering_column``);
    ``keep_gathered_input`` keeps the gathered (B, T, D) instead (one all-gather fewer in
    backward, n times the memory for it). Each output is (B, T, out_i).
    """
    biases = list(biases) if biases is not None else [None] * len(weights)
    if sequence_parallel and tp_size(group) > 1 and not keep_gathered_input:
        return regathering_column(gather_from_sequence(x, group, seq_len), x, weights, biases,
                                  group)
    x_tp = enter_tp_region(x, sequence_parallel, group, seq_len)
    return tuple(F.linear(x_tp, w, b) for w, b in zip(weights, biases, strict=True))


def _check_splittable(features: int, n: int, what: str) -> None:
    if features < n:
        raise ValueError(f"{what}={features} cannot be split over {n} ranks (needs >= {n})")


def _check_last_dim(x: torch.Tensor, expected: int, what: str) -> None:
    if x.dim() == 0 or x.shape[-1] != expected:
        raise ValueError(
            f"{what}: input of shape {tuple(x.shape)} has last dim "
            f"{x.shape[-1] if x.dim() else None}, expected {expected}"
        )


class _ParallelLinear(nn.Module):
    """What both layers share: the dense sizes, the group, and the slice of the split dim.

    split_dim is the dim of the dense (out, in) weight that is split: 0 for column, 1 for row.
    This rank holds ``[shard_start, shard_stop)`` of it.
    """

    split_dim: int

    def __init__(self, in_features: int, out_features: int, bias: bool, sequence_parallel: bool,
                 group: ProcessGroup | None, device, dtype, shard: tuple[int, int] | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.group = sequence_parallel, group
        if shard is None:
            n = tp_size(group)
            split, what = ((out_features, "out_features"), (in_features, "in_features"))[
                self.split_dim]
            _check_splittable(split, n, f"{type(self).__name__} {what}")
            shard = shard_range(split, n, tp_rank(group))
        self.shard_start, self.shard_stop = shard
        # draw the whole dense layer from torch's RNG and keep our slice: same model at any TP size
        dense = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        self.load_dense(dense.weight, dense.bias)

    @torch.no_grad()
    def load_dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """Take this rank's slice of a dense (out, in) weight and its (out,) bias.

        The bias is split with the output features (column) or replicated (row).
        """
        start, stop = self.shard_start, self.shard_stop
        self.weight = sharded_parameter(weight, self.split_dim, start, stop)
        if bias is None:
            self.bias = None
        elif self.split_dim == 0:
            self.bias = sharded_parameter(bias, 0, start, stop)
        else:
            self.bias = replicated_parameter(bias)
        return self


class ColumnParallelLinear(_ParallelLinear):
    """Linear layer with its weight split on the output features across the TP group.

    in_features, out_features, bias: as ``nn.Linear`` (the dense layer's sizes).
    gather_output: all-gather the output shards into the full (B, T, out) on every rank.
    sequence_parallel: the input is a sequence shard (B, T/n, in), all-gathered here.
    group: the TP process group (None: the whole world).
    out_range: the rows of the dense weight this rank holds (default: its ``tensor_split`` shard);
        attention uses it to cut along head boundaries.
    keep_gathered_input: under SP, keep the all-gathered (B, T, in) input for backward instead
        of this rank's shard (see ``column_linears``).
    """

    split_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        group: ProcessGroup | None = None,
        *,
        device=None,
        dtype=None,
        out_range: tuple[int, int] | None = None,
        keep_gathered_input: bool = False,
    ):
        super().__init__(in_features, out_features, bias, sequence_parallel, group, device, dtype,
                         out_range)
        self.gather_output, self.keep_gathered_input = gather_output, keep_gathered_input

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        group: ProcessGroup | None = None,
        *,
        out_range: tuple[int, int] | None = None,
        keep_gathered_input: bool = False,
    ) -> ColumnParallelLinear:
        """This rank's column shard of ``linear``; together the shards compute ``linear``."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    gather_output, sequence_parallel, group, device="meta",
                    dtype=linear.weight.dtype, out_range=out_range,
                    keep_gathered_input=keep_gathered_input)
        return layer.load_dense(linear.weight, linear.bias)

    @property
    def out_features_local(self) -> int:
        return self.shard_stop - self.shard_start

    def forward_local(self, x_tp: torch.Tensor) -> torch.Tensor:
        """The sharded matmul on an input already in the TP region (after f or the SP gather).

        Autograd keeps ``x_tp`` for backward: under SP the gathered input (``column_linears``,
        which blocks feeding several column layers use, keeps the shard instead).
        """
        return F.linear(x_tp, self.weight, self.bias)

    def forward(self, x: torch.Tensor, seq_len: int | None = None) -> torch.Tensor:
        """x: (B, T, in), or under SP rank r's (B, T_r, in) ``tensor_split`` shard of T tokens,
        where ``seq_len`` is T (without it the ranks exchange their shard sizes first: one
        all-gather of an int64 per rank)."""
        _check_last_dim(x, self.in_features, "ColumnParallelLinear")
        (y,) = column_linears(x, [self.weight], [self.bias], group=self.group,
                              sequence_parallel=self.sequence_parallel,
                              keep_gathered_input=self.keep_gathered_input, seq_len=seq_len)
        if self.gather_output:
            y = gather_from_tp(y, self.group, full_size=self.out_features)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"(rows {self.shard_start}:{self.shard_stop} here), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}"
                + (", keep_gathered_input=True" if self.keep_gathered_input else ""))


class RowParallelLinear(_ParallelLinear):
    """Linear layer with its weight split on the input features across the TP group.

    in_features, out_features, bias: as ``nn.Linear`` (the dense layer's sizes).
    input_is_parallel: the input already holds this rank's last-dim shard (B, T, in_i);
        if False the full input is split here.
    sequence_parallel: reduce-scatter the output along the sequence, (B, T/n, out), instead of
        all-reducing it. The bias is then added to sequence shards, so its gradient is summed over
        the group in backward.
    group: the TP process group (None: the whole world).
    in_range: the columns of the dense weight this rank holds (default: its ``tensor_split`` shard).
    fused: without sequence parallelism, the matmul and its all-reduce as one op that reduces the
        product in place (``fused.fused_row``); the same numbers and collectives.
    """

    split_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        group: ProcessGroup | None = None,
        *,
        device=None,
        dtype=None,
        in_range: tuple[int, int] | None = None,
        fused: bool = False,
    ):
        super().__init__(in_features, out_features, bias, sequence_parallel, group, device, dtype,
                         in_range)
        self.input_is_parallel, self.fused = input_is_parallel, fused

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
        group: ProcessGroup | None = None,
        *,
        in_range: tuple[int, int] | None = None,
        fused: bool = False,
    ) -> RowParallelLinear:
        """This rank's row shard of ``linear``; together the shards compute ``linear``."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    input_is_parallel, sequence_parallel, group, device="meta",
                    dtype=linear.weight.dtype, in_range=in_range, fused=fused)
        return layer.load_dense(linear.weight, linear.bias)

    @property
    def in_features_local(self) -> int:
        return self.shard_stop - self.shard_start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_is_parallel:
            _check_last_dim(x, self.in_features_local, "RowParallelLinear (input_is_parallel)")
        else:
            _check_last_dim(x, self.in_features, "RowParallelLinear")
            x = scatter_to_tp(x, self.group)
        if has_lora(self) and not self.sequence_parallel and tp_size(self.group) > 1:
            y = lora_row(x, self)  # the adapter's A_i x_i rides the product's all-reduce
        elif has_lora(self):  # the update joins the partial product before its reduction
            (b,) = sum_grads_in_backward([self.lora_B.weight], self.group)
            if self.fused and not self.sequence_parallel:
                y = fused_row(x, self.weight, self.group, row_addend(x, self, b))
            else:
                y = exit_tp_region(F.linear(x, self.weight) + row_addend(x, self, b),
                                   self.sequence_parallel, self.group)
        elif self.fused and not self.sequence_parallel:
            y = fused_row(x, self.weight, self.group)
        else:
            y = exit_tp_region(F.linear(x, self.weight), self.sequence_parallel, self.group)
        if self.bias is None:
            return y
        bias = self.bias
        if self.sequence_parallel:
            (bias,) = sum_grads_in_backward([bias], self.group)
        return y + bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (columns {self.shard_start}:{self.shard_stop} "
                f"here), out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")
