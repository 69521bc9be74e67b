"""The column side of a block as one autograd op, with its backward collective overlapped.

An opt-in variant of ``enter_tp_region`` followed by the block's column-parallel matmuls (Q, K and
V; gate and up; the LM head), for the layers' ``fused=True``. Same parameters, same collectives,
same numbers (to fp32 rounding) as the plain path::

    forward   x ──f (or SP all-gather)──> x_full ──> y_i = x_full W_i^T      for each weight i
    backward  dx = sum_i dy_i W_i          (the input gradient, which the layers below wait for)
              start all-reduce(dx)         (or its reduce-scatter under SP), asynchronously
              dW_i = dy_i^T x_full         (the weight gradients) while the collective runs
              wait

This is Megatron's overlap of the input-gradient all-reduce with the weight-gradient GEMM (its
``LinearWithGradAccumulationAndAsyncCommunication``). In the plain path ``f``'s all-reduce runs
after every matmul of the block's backward, so nothing hides it.

The matmuls themselves stay separate: concatenating the weights into one GEMM was measured slower
on CPU (the copies of the weights, and the split and concatenation of the gradients, cost more
than the larger GEMM saves: see benchmarks/README.md).

The collective writes into ``dx``, a fresh tensor that nothing else references (autograd saved
nothing of it), which keeps the rule that collectives never mutate what autograd holds.

The row side (``fused_row``, without sequence parallelism) is the row matmul and its forward
all-reduce (g) as one op: the partial product is made inside it, so it is reduced in place,
without the copy that ``reduce_from_tp`` makes of a tensor it did not create.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from tensorpar.parallel.mappings import SEQ_DIM, _all_gather, _reduce_scatter_single
from tensorpar.runtime.groups import tp_size


class _FusedColumn(torch.autograd.Function):
    """forward: f (or the SP all-gather), then the matmuls; backward: all-reduce (or
    reduce-scatter) of the input gradient, overlapped with the weight-gradient matmuls."""

    @staticmethod
    def forward(ctx, x, group, sequence_parallel, has_bias, *weights_and_biases):
        # has_bias[i]: weight i has a bias; the biases that exist follow the weights
        weights = list(weights_and_biases[:len(has_bias)])
        present = iter(weights_and_biases[len(has_bias):])
        biases = [next(present) if h else None for h in has_bias]
        n = tp_size(group)
        x_full = x
        if sequence_parallel and n > 1:  # (B, T/n, D) -> (B, T, D)
            x_full = _all_gather(x, SEQ_DIM, [x.shape[SEQ_DIM]] * n, group)
        ctx.x_dtype = x.dtype
        cast = _autocast_cast(x.device.type)  # compute (and save) what autocast's linear would
        x_full = cast(x_full)
        weights, biases = [cast(w) for w in weights], [cast(b) for b in biases]
        ctx.save_for_backward(x_full, *weights)
        ctx.group, ctx.sp, ctx.n, ctx.has_bias = group, sequence_parallel and n > 1, n, has_bias
        return tuple(F.linear(x_full, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx, *dys):
        x_full, *weights = ctx.saved_tensors
        B, T, D = x_full.shape
        work = None
        if ctx.sp:
            # compute dx directly in the (n, B, T/n, D) order the reduce-scatter input needs:
            # rank r's sequence rows first, so no copy is made to reorder it
            dx_parts = _input_grad([dy.reshape(B, ctx.n, T // ctx.n, -1).transpose(0, 1)
                                    for dy in dys], weights, ctx.x_dtype)  # (n, B, T/n, D)
            dx = dx_parts.new_empty((B, T // ctx.n, D))
            work = _reduce_scatter_single(dx, dx_parts.flatten(0, 1), group=ctx.group,
                                          async_op=True)
        else:
            dx = _input_grad(dys, weights, ctx.x_dtype)  # (B, T, D)
            if ctx.n > 1:
                work = dist.all_reduce(dx, group=ctx.group, async_op=True)
        # the weight gradients: computed while the collective is in flight
        x_2d = x_full.reshape(-1, D)
        dws = [dy.reshape(-1, dy.shape[-1]).t().mm(x_2d) for dy in dys]  # (out_i, D) each
        dbs = [dy.reshape(-1, dy.shape[-1]).sum(0)
               for dy, h in zip(dys, ctx.has_bias, strict=True) if h]
        if work is not None:
            work.wait()
        return (dx, None, None, None, *dws, *dbs)


def _autocast_cast(device: str):
    """A function casting a tensor (or None) to autocast's dtype on ``device`` when autocast is
    on there, and returning it unchanged otherwise. Custom ops run their matmuls in the dtype
    autocast's own linear would use, and save those casts for backward."""
    if not torch.is_autocast_enabled(device):
        return lambda t: t
    dtype = torch.get_autocast_dtype(device)
    return lambda t: None if t is None else t.to(dtype)


def _input_grad(dys, weights, dtype) -> torch.Tensor:
    """sum_i dy_i W_i, accumulated in one buffer (the plain path sums separate products).

    Computed in the dtype of the matmuls and returned in the input's (fp32 under bf16 autocast),
    so the collective moves what the plain path's ``f`` would."""
    dx = torch.matmul(dys[0], weights[0]).to(dtype)
    dx_2d = dx.view(-1, dx.shape[-1])
    for dy, w in zip(dys[1:], weights[1:], strict=True):
        if dy.dtype == dtype:  # accumulate in place: no temporary
            dx_2d.addmm_(dy.reshape(-1, dy.shape[-1]), w)
        else:  # bf16 products summed in fp32, as the plain path's autograd sums them
            dx.add_(torch.matmul(dy, w))
    return dx


def fused_column(x: torch.Tensor, weights: list[torch.Tensor],
                 biases: list[torch.Tensor | None] | None = None, *,
                 sequence_parallel: bool = False,
                 group: ProcessGroup | None = None) -> tuple[torch.Tensor, ...]:
    """``tuple(F.linear(enter_tp_region(x), w_i, b_i) for i)`` as one autograd op whose backward
    overlaps its collective with the weight-gradient matmuls.

    x: (B, T, D) replicated, or (B, T/n, D) under sequence parallelism.
    weights: column shards (out_i, D) of this rank; biases: their (out_i,) shards, None entries
    for weights without one (or None: no biases). Returns one (B, T, out_i) tensor per weight.
    """
    if x.dim() != 3:
        raise ValueError(f"fused_column: expected activations (B, T, D), got {tuple(x.shape)}")
    biases = list(biases) if biases is not None else [None] * len(weights)
    if len(biases) != len(weights):
        raise ValueError(f"fused_column: {len(weights)} weights but {len(biases)} biases")
    has_bias = tuple(b is not None for b in biases)
    tensors = list(weights) + [b for b in biases if b is not None]
    return _FusedColumn.apply(x, group, sequence_parallel, has_bias, *tensors)


class _FusedRow(torch.autograd.Function):
    """forward: the row-parallel matmul, then all-reduce of its product; backward: local."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.x_dtype = x.dtype
        cast = _autocast_cast(x.device.type)  # what autocast's linear would compute
        x, weight = cast(x), cast(weight)
        y = F.linear(x, weight)  # (B, T, out): partial sums, made here and referenced nowhere
        if tp_size(group) > 1:
            dist.all_reduce(y, group=group)
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = torch.matmul(dy, weight).to(ctx.x_dtype)
        dw = dy.reshape(-1, dy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
        return dx, dw, None


def fused_row(x: torch.Tensor, weight: torch.Tensor,
              group: ProcessGroup | None = None) -> torch.Tensor:
    """``reduce_from_tp(F.linear(x, weight))`` with the all-reduce done in place on the product.

    x: (..., in_i) this rank's input shard; weight: (out, in_i). Returns the summed (..., out).
    """
    return _FusedRow.apply(x, weight, group)
