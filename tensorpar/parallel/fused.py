"""The column side of a block as one autograd op, its backward collectives overlapped with compute.

A variant of ``enter_tp_region`` followed by the block's column-parallel matmuls (Q, K and V; gate
and up; the LM head), for the layers' ``fused=True``. Same parameters, same collectives, same
numbers (to fp32 rounding) as the plain path::

    forward   x ──f (or SP all-gather)──> x_full ──> y_i = x_full W_i^T      for each weight i
              saved: x, or under SP only this rank's (B, T/n, D) shard of x_full
    backward  SP: start all-gather(shard) -> x_full, asynchronously
              dx = sum_i dy_i W_i          (the input gradient) while the all-gather runs
              SP: wait
              start all-reduce(dx)         (or its reduce-scatter under SP), asynchronously
              dW_i = dy_i^T x_full         (the weight gradients) while the collective runs
              wait

This is Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``: under SP the gathered
input is not kept for backward (Korthikanti et al. 2022, section 4.2.2: the column layers keep
their sequence shard, so every activation of the block is 1/n of the unsharded model's) but
gathered again, hidden behind the input-gradient matmul; the input-gradient collective is hidden
behind the weight-gradient matmuls. ``keep_gathered_input=True`` keeps the gathered (B, T, D)
instead: one all-gather fewer in backward, n times the memory for that tensor. In the plain path
``f``'s all-reduce (or the SP reduce-scatter) runs after every matmul of the block's backward, so
nothing hides it; under SP its matmuls are ``regathering_column``, which re-gathers the shard the
same way (the plain path differs from this one only in the input-gradient collective).

The matmuls themselves stay separate: concatenating the weights into one GEMM was measured slower
on CPU (the copies of the weights, and the split and concatenation of the gradients, cost more
than the larger GEMM saves: see benchmarks/README.md).

LoRA's adapters are part of the op (``ColumnLoRA``): forward adds s · (x A^T) B^T to their
outputs in place; backward makes z = x A^T's gradient dz = s · dy B and the local dB (z and dz
held transposed: ``_Adapters``). Without SP each rank's dz is a part of the whole and travels in
the input gradient's all-reduce, beside sum_i dy_i W_i, so that A's gradient comes out whole
(``_grads_with_partials``, ``lora.py``).

Under ``torch.compile`` a traced backward would wait for each functional collective at once, so
the backward is one custom op (``tensorpar::column_backward``) that runs the eager code above.

The collectives write into fresh tensors that nothing else references (``dx``, the re-gathered
input), which keeps the rule that collectives never mutate what autograd holds.

The row side (:func:`fused_row`) is the row-parallel matmul and its forward all-reduce (g)
together: the partial product is made inside the op, so it is reduced in place, without the copy
that ``reduce_from_tp`` makes of a tensor it did not create; its backward is local, as g's is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import _resolve_process_group

from tensorpar.parallel.collectives import (
    SEQ_DIM,
    all_gather,
    group_name,
    sequence_sizes,
    stacked_shards,
    start_all_reduce,
    start_reduce_scatter,
    trim_shard,
)
from tensorpar.parallel.sharding import shard_sizes
from tensorpar.runtime.asserts import is_compiling
from tensorpar.runtime.groups import tp_size


def _split_params(has_bias, weights_and_biases):
    """(weights, biases): has_bias[i] says whether weight i has a bias; those that exist follow
    the weights (autograd Functions take tensors as flat arguments)."""
    weights = list(weights_and_biases[:len(has_bias)])
    present = iter(weights_and_biases[len(has_bias):])
    return weights, [next(present) if h else None for h in has_bias]


class _FusedColumn(torch.autograd.Function):
    """forward: f (or the SP all-gather), then the matmuls (and the adapters' updates, added in
    place); backward: (SP: the all-gather of the input shard again, overlapped with the
    input-gradient matmul, then) the all-reduce (or reduce-scatter) of the input gradient,
    overlapped with the weight-gradient matmuls."""

    @staticmethod
    def forward(ctx, x, group, sizes, keep_gathered, has_bias, adapt, *tensors):
        # tensors: the weights, the adapters' A and B (adapt: their (targets, scales, partial)),
        # then the biases that exist
        k, m = len(has_bias), len(adapt[0]) if adapt else 0
        weights, biases = _split_params(has_bias, tensors[:k] + tensors[k + 2 * m:])
        n = tp_size(group)
        sp = sizes is not None  # the sequence shard sizes, under SP with n > 1
        x_full = all_gather(x, SEQ_DIM, sizes, group) if sp else x  # (B, T_r, D) -> (B, T, D)
        ctx.x_dtype, ctx.x_shape = x.dtype, list(x.shape)
        cast = autocast_cast(x.device.type)  # compute (and save) what autocast's linear would
        x_full = cast(x_full)
        weights, biases = [cast(w) for w in weights], [cast(b) for b in biases]
        factors = [cast(t) for t in tensors[k:k + 2 * m]]  # A_1..A_m, B_1..B_m
        ys = tuple(F.linear(x_full, w, b) for w, b in zip(weights, biases, strict=True))
        zt = _add_updates(x_full, ys, factors[:m], factors[m:], *adapt[:2]) if m else None
        ctx.regather = sp and not keep_gathered
        # the shard, cast like x_full: gathering the cast shard gives the cast x_full exactly
        ctx.save_for_backward(cast(x) if ctx.regather else x_full, zt, *weights, *factors)
        ctx.group, ctx.sizes, ctx.n, ctx.has_bias = group, sizes, n, has_bias
        ctx.adapt = adapt
        return ys

    @staticmethod
    def backward(ctx, *dys):
        x_saved, zt, *weights = ctx.saved_tensors
        k = len(ctx.has_bias)
        lora = _Adapters(weights[k:], ctx.adapt, zt) if ctx.adapt else None
        weights = weights[:k]
        # what autograd wants (the same on every rank): no dW for a frozen weight, no dx (nor
        # its collective) for an input that needs none, as the plain path's autograd skips them;
        # need covers the weights, then the adapters' A and B
        need_dx, need = ctx.needs_input_grad[0], ctx.needs_input_grad[6:]
        need = need[:len(need) - sum(ctx.has_bias)]
        if ctx.n > 1 and is_compiling():  # the eager overlap, kept inside one opaque op
            targets, scales, partial = ctx.adapt or ((), (), False)
            got = iter(column_backward(
                list(dys), x_saved, weights, ctx.x_dtype, ctx.x_shape, ctx.sizes or [],
                ctx.regather, group_name(ctx.group), need_dx, list(need),
                list(lora.a) if lora else [], list(lora.b) if lora else [], zt, list(targets),
                list(scales), partial))
            dx, dws = next(got) if need_dx else None, [next(got) if k else None for k in need]
        else:
            dx, dws = _column_grads(dys, x_saved, weights, ctx.x_dtype, ctx.sizes, ctx.regather,
                                    ctx.group, need_dx, need, lora)
        return (dx, None, None, None, None, None, *dws, *_bias_grads(dys, ctx.has_bias))


class _Adapters:
    """A fused column op's adapters in backward: ``ColumnLoRA``'s, with A and B as the matmuls
    used them and zt (R, N), the products A_j x^T by rows: transposed, so that the tokens are
    the last dimension of every adapter matmul (z^T dy, B^T dy^T: on CPU 3 to 10 times faster
    than dy^T z and dy B, the same values)."""

    def __init__(self, factors, adapt, zt):
        m = len(adapt[0])
        self.a, self.b, self.zt = list(factors[:m]), list(factors[m:2 * m]), zt
        self.targets, self.scales, self.partial = adapt
        self.cols = _column_slices([a.shape[0] for a in self.a])

    def a_cat(self) -> torch.Tensor:
        """All the A_j stacked (R, D): one matmul for all of them."""
        return torch.cat(self.a) if len(self.a) > 1 else self.a[0]

    def fill_dzt(self, dzt: torch.Tensor, dys) -> torch.Tensor:
        """dzt (R, N) := s_j B_j^T dy_t^T in each adapter's rows: the gradient of zt."""
        for b, t, s, rows in zip(self.b, self.targets, self.scales, self.cols, strict=True):
            dy = dys[t].reshape(-1, dys[t].shape[-1])
            if dzt.dtype == dy.dtype:  # beta=0: dzt's old values (uninitialised) are ignored
                dzt[rows].addmm_(b.t(), dy.t(), beta=0, alpha=s)
            else:  # the matmuls' dtype (bf16 autocast) into the fp32 buffer
                dzt[rows].copy_(torch.mm(b.t(), dy.t()).mul_(s))
        return dzt

    def b_grads(self, dys, need) -> list[torch.Tensor | None]:
        """dB_j = s_j dy_t^T z_j (out_t, r_j), local, where need[j]: made (r_j, out_t)."""
        return [torch.mm(self.zt[rows], dys[t].reshape(-1, b.shape[0])).mul_(s).t().contiguous()
                if want else None for b, t, s, rows, want
                in zip(self.b, self.targets, self.scales, self.cols, need, strict=True)]

    def a_grads(self, da: torch.Tensor | None, need) -> list[torch.Tensor | None]:
        """The A_j's rows of dA (R, D), where need[j]."""
        return [da[rows] if want and da is not None else None
                for rows, want in zip(self.cols, need, strict=True)]


def _column_slices(widths) -> list[slice]:
    return [slice(sum(widths[:j]), sum(widths[:j + 1])) for j in range(len(widths))]


def _add_updates(x_full, ys, a, b, targets, scales) -> torch.Tensor:
    """y_t += s_j (x A_j^T) B_j^T in place for each adapter j (the ys are the op's own); returns
    zt (R, N), the products A_j x^T stacked by rows (one matmul for all of them)."""
    x_2d = x_full.reshape(-1, x_full.shape[-1])
    zt = (torch.cat(a) if len(a) > 1 else a[0]).mm(x_2d.t())
    for b_j, t, s, rows in zip(b, targets, scales, _column_slices([t.shape[0] for t in a]),
                               strict=True):
        ys[t].view(-1, ys[t].shape[-1]).addmm_(zt[rows].t(), b_j.t(), alpha=s)
    return zt


def _column_grads(dys, x_saved, weights, x_dtype, sizes, regather, group, need_dx, need,
                  lora: _Adapters | None = None):
    """(dx, [dW_i, dA_j, dB_j]) of ``_FusedColumn``, collectives overlapped (see above). sizes:
    the SP shard sizes (None without SP); regather: x_saved is this rank's shard, to gather
    again; need_dx, need: whether dx and each weight's (then each A's and B's) gradient are
    wanted (None in their place when not); lora: the adapters, if any."""
    if lora is None:
        return _base_grads(dys, x_saved, weights, x_dtype, sizes, regather, group, need_dx, need)
    k, m = len(weights), len(lora.a)
    if lora.partial and tp_size(group) > 1:
        return _grads_with_partials(dys, x_saved, weights, x_dtype, group, need, lora)
    # z's gradient, each rank's part: one more product of the op (A's gradients are summed by
    # the caller, its input gradient's part by the op's collective), made transposed (R, N)
    dzt = lora.fill_dzt(dys[0].new_empty(tuple(lora.zt.shape)), dys)
    dz = dzt.t().view(*dys[0].shape[:-1], -1)  # (B, T, R), a view
    dx, dws = _base_grads([*dys, dz], x_saved, [*weights, lora.a_cat()], x_dtype, sizes,
                          regather, group, need_dx, [*need[:k], any(need[k:k + m])])
    da = dws.pop()
    return dx, dws + lora.a_grads(da, need[k:k + m]) + lora.b_grads(dys, need[k + m:])


def _base_grads(dys, x_saved, weights, x_dtype, sizes, regather, group, need_dx, need):
    """(dx, [dW_i]) of the op's matmuls y_i = x W_i^T (``_column_grads`` without adapters)."""
    n, regather = tp_size(group), regather and any(need)  # no dW wanted: nothing to gather
    if not need_dx:
        x_full = all_gather(x_saved, SEQ_DIM, sizes, group) if regather else x_saved
        return None, _weight_grads(dys, x_full, need)
    regathered = all_gather(x_saved, SEQ_DIM, sizes, group, async_op=True) \
        if regather else None  # started first: it travels while dx is computed
    (B, T), D = dys[0].shape[:2], weights[0].shape[1]
    wait = None
    if sizes is not None:
        if T % n == 0:
            # compute dx directly in the (n, B, T/n, D) order the reduce-scatter input
            # needs: rank r's sequence rows first, so no copy is made to reorder it
            dx_parts = _input_grad([dy.reshape(B, n, T // n, -1).transpose(0, 1)
                                    for dy in dys], weights, x_dtype)  # (n, B, T/n, D)
        else:  # uneven shards: each padded to the largest (one copy of dx)
            dx_parts = stacked_shards(_input_grad(dys, weights, x_dtype), SEQ_DIM, n)
        x_full = regathered() if regathered else x_saved  # waits for the all-gather
        regathered = None  # frees the unordered buffer it held
        wait = start_reduce_scatter(dx_parts.new_empty((B, sizes[0], D)),
                                    dx_parts.flatten(0, 1), group)
    else:
        dx, x_full = _input_grad(dys, weights, x_dtype), x_saved  # (B, T, D)
        if n > 1:
            wait = start_all_reduce(dx, group)
    dws = _weight_grads(dys, x_full, need)  # while the collective is in flight
    if wait is not None:
        dx = wait()
    if sizes is not None:
        dx = trim_shard(dx, SEQ_DIM, T, group)
    return dx, dws


class _RegatheringColumn(torch.autograd.Function):
    """forward: the matmuls on the SP-gathered input, saving only this rank's shard of it;
    backward: the all-gather of the shard again, overlapped with the input-gradient matmul."""

    @staticmethod
    def forward(ctx, x_full, x_shard, group, sizes, has_bias, *weights_and_biases):
        weights, biases = _split_params(has_bias, weights_and_biases)
        ctx.x_dtype = x_full.dtype
        cast = autocast_cast(x_full.device.type)  # as in _FusedColumn: autocast's linear
        x_full = cast(x_full)
        weights, biases = [cast(w) for w in weights], [cast(b) for b in biases]
        ctx.save_for_backward(cast(x_shard), *weights)
        ctx.group, ctx.sizes, ctx.has_bias = group, sizes, has_bias
        return tuple(F.linear(x_full, w, b) for w, b in zip(weights, biases, strict=True))

    @staticmethod
    def backward(ctx, *dys):
        x_shard, *weights = ctx.saved_tensors
        need = ctx.needs_input_grad[5:5 + len(weights)]  # no dW, no gather (the same on all ranks)
        wait = all_gather(x_shard, SEQ_DIM, ctx.sizes, ctx.group, async_op=True) \
            if any(need) else None
        # (B, T, D): the gather's backward reduce-scatters it, after this op
        dx = _input_grad(dys, weights, ctx.x_dtype) if ctx.needs_input_grad[0] else None
        x_full = wait() if wait is not None else None
        del wait  # frees the unordered buffer it held
        dws, dbs = _weight_grads(dys, x_full, need), _bias_grads(dys, ctx.has_bias)
        return (dx, None, None, None, None, *dws, *dbs)


# an eager collective inside: a CUDA graph would replay the op without communicating
_CUDAGRAPH_UNSAFE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t)


@torch.library.custom_op("tensorpar::column_backward", mutates_args=(), tags=_CUDAGRAPH_UNSAFE)
def column_backward(dys: list[torch.Tensor], x_saved: torch.Tensor, weights: list[torch.Tensor],
                    x_dtype: torch.dtype, x_shape: list[int], sizes: list[int], regather: bool,
                    group: str, need_dx: bool, need: list[bool], lora_a: list[torch.Tensor],
                    lora_b: list[torch.Tensor], lora_zt: torch.Tensor | None, targets: list[int],
                    scales: list[float], partial: bool) -> list[torch.Tensor]:
    """[dx, dW_i, ..., dA_j, ..., dB_j, ...]: ``_column_grads`` for compiled graphs (sizes: []
    without SP), over the group named ``group``; dx if ``need_dx``, each gradient where its
    ``need`` (the weights', then the adapters' A and B); bias gradients are the caller's. The
    adapters (none when ``lora_a`` is empty): ``_Adapters``. The inputs are cast already
    (forward did), so autocast is off inside: the dtypes are the fake's. With adapters, outputs
    that share a buffer are copied apart: a custom op's outputs may not alias."""
    lora = _Adapters([*lora_a, *lora_b], (tuple(targets), tuple(scales), partial), lora_zt) \
        if lora_a else None
    with torch.autocast(x_saved.device.type, enabled=False):
        dx, dws = _column_grads(dys, x_saved, weights, x_dtype, sizes or None, regather,
                                _resolve_process_group(group), need_dx, need, lora)
        out = [t for t in (dx, *dws) if t is not None]
        return [t.clone() for t in out] if lora else out


@column_backward.register_fake
def _(dys, x_saved, weights, x_dtype, x_shape, sizes, regather, group, need_dx, need, lora_a,
      lora_b, lora_zt, targets, scales, partial):
    """dx of the input's shape and dtype; each dW (out_i, D), dA (r_j, D) and dB (out_t, r_j)
    in the matmuls' dtype."""
    dx = [x_saved.new_empty(x_shape, dtype=x_dtype)] if need_dx else []
    shapes = [(dy.shape[-1], x_saved.shape[-1]) for dy in dys]
    shapes += [tuple(a.shape) for a in lora_a] + [tuple(b.shape) for b in lora_b]
    return [*dx, *(x_saved.new_empty(s, dtype=dys[0].dtype)
                   for s, k in zip(shapes, need, strict=True) if k)]


def autocast_cast(device: str):
    """A function casting a tensor (or None) to autocast's dtype on ``device`` when autocast is
    on there, and returning it unchanged otherwise. Custom ops run their matmuls in the dtype
    autocast's own linear would use, and save those casts for backward."""
    if not torch.is_autocast_enabled(device):
        return lambda t: t
    dtype = torch.get_autocast_dtype(device)
    return lambda t: None if t is None else t.to(dtype)


def _input_grad(dys, weights, dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """sum_i dy_i W_i, accumulated in one buffer (the plain path sums separate products);
    ``out``: that buffer, (N, D) for N tokens, else a new one shaped as dy.

    Computed in the dtype of the matmuls and returned in the input's (fp32 under bf16 autocast),
    so the collective moves what the plain path's ``f`` would."""
    if out is None:
        dx = torch.matmul(dys[0], weights[0]).to(dtype)
    elif dys[0].dtype == dtype:
        dx = torch.mm(dys[0].reshape(-1, dys[0].shape[-1]), weights[0], out=out)
    else:
        dx = out.copy_(torch.mm(dys[0].reshape(-1, dys[0].shape[-1]), weights[0]))
    dx_2d = dx.view(-1, dx.shape[-1])
    for dy, w in zip(dys[1:], weights[1:], strict=True):
        if dy.dtype == dtype:  # accumulate in place: no temporary
            dx_2d.addmm_(dy.reshape(-1, dy.shape[-1]), w)
        else:  # bf16 products summed in fp32, as the plain path's autograd sums them
            dx_2d.add_(torch.mm(dy.reshape(-1, dy.shape[-1]), w))
    return dx


def _grads_with_partials(dys, x_full, weights, x_dtype, group, need, lora: _Adapters):
    """(dx, [dW_i, dA_j, dB_j]) without SP when the adapters' products' gradients dz are each
    rank's part (``ColumnLoRA.partial``): dz (as dz^T, (R, N)) travels in the input gradient's
    all-reduce, beside the base's sum_i dy_i W_i (one flat buffer, one collective), so that
    afterwards dx = sum_i dy_i W_i + dz A and dA = dz^T x are whole on every rank: no
    all-reduce of A's gradients. The base's dW_i and the local dB_j compute while it travels."""
    k, m = len(weights), len(lora.a)
    (N, D), R = x_full.reshape(-1, x_full.shape[-1]).shape, lora.zt.shape[0]
    flat = dys[0].new_empty(N * (D + R), dtype=x_dtype)
    _input_grad(dys, weights, x_dtype, out=flat[:N * D].view(N, D))
    lora.fill_dzt(flat[N * D:].view(R, N), dys)  # dz transposed, as zt
    wait = start_all_reduce(flat, group)
    dws = _weight_grads(dys, x_full, need[:k])  # while the collective is in flight
    dbs = lora.b_grads(dys, need[k + m:])
    flat = wait()  # in place in eager; a new tensor when compiled
    dx, dzt = flat[:N * D].view(N, D), flat[N * D:].view(R, N)
    a = lora.a_cat()  # (R, D)
    if a.dtype == x_dtype:
        dx.addmm_(dzt.t(), a)
    else:  # the matmuls' dtype (bf16 autocast), summed into the fp32 gradient
        dx.add_(torch.mm(dzt.t().to(a.dtype), a))
    x_2d = x_full.reshape(N, D)
    da = dzt.to(x_2d.dtype).mm(x_2d) if any(need[k:k + m]) else None  # (R, D), whole
    return dx.view(*dys[0].shape[:-1], D), dws + lora.a_grads(da, need[k:k + m]) + dbs


def _weight_grads(dys, x_full, need):
    """dW_i = dy_i^T x_full (out_i, D) where need[i], else None."""
    if not any(need):
        return [None] * len(dys)
    x_2d = x_full.reshape(-1, x_full.shape[-1])
    return [dy.reshape(-1, dy.shape[-1]).t().mm(x_2d) if k else None
            for dy, k in zip(dys, need, strict=True)]


def _bias_grads(dys, has_bias):
    """db_i = the sum of dy_i over tokens, where weight i has a bias."""
    return [dy.reshape(-1, dy.shape[-1]).sum(0) for dy, h in zip(dys, has_bias, strict=True) if h]


def _flat_params(weights, biases, n_weights: int):
    biases = list(biases) if biases is not None else [None] * n_weights
    if len(biases) != n_weights:
        raise ValueError(f"{n_weights} weights but {len(biases)} biases")
    has_bias = tuple(b is not None for b in biases)
    return has_bias, list(weights) + [b for b in biases if b is not None]


@dataclass(frozen=True)
class ColumnLoRA:
    """LoRA adapters folded into a fused column op (``parallel/lora.py``): output ``targets[j]``
    gains ``scales[j] · (x A_j^T) B_j^T``, computed and differentiated inside the op.

    a: the A_j (r_j, D), replicated; b: the B_j (out_t, r_j), this rank's rows of the output
    they update. partial: each rank's gradient of the products x A_j^T is its part of the
    whole; it rides the input gradient's all-reduce and A's gradients come out whole (only
    without SP, on an input that needs a gradient: ``lora.column_lora`` decides). Otherwise
    each rank's A gradient is its part: sum it yourself (``mappings.sum_grads_in_backward``)."""

    a: tuple[torch.Tensor, ...]
    b: tuple[torch.Tensor, ...]
    targets: tuple[int, ...]
    scales: tuple[float, ...]
    partial: bool = False


def fused_column(x: torch.Tensor, weights: list[torch.Tensor],
                 biases: list[torch.Tensor | None] | None = None, *,
                 sequence_parallel: bool = False, group: ProcessGroup | None = None,
                 keep_gathered_input: bool = False, seq_len: int | None = None,
                 lora: ColumnLoRA | None = None) -> tuple[torch.Tensor, ...]:
    """``tuple(F.linear(enter_tp_region(x), w_i, b_i) for i)`` as one autograd op whose backward
    overlaps its collectives with the matmuls.

    x: (B, T, D) replicated, or (B, T_r, D) under sequence parallelism (rank r's
    ``tensor_split`` shard of T; ``seq_len``: T, see ``mappings.gather_from_sequence``).
    weights: column shards (out_i, D) of this rank; biases: their (out_i,) shards, None entries
    for weights without one (or None: no biases). Returns one (B, T, out_i) tensor per weight.
    keep_gathered_input: under SP, keep the gathered (B, T, D) input for backward instead of the
    shard (no all-gather in backward; n times the memory for it).
    lora: LoRA adapters on some of the outputs (``ColumnLoRA``), their updates and gradients
    computed inside the op."""
    if lora is not None:
        _check_lora(lora, x, weights, sequence_parallel)
    if x.dim() != 3:
        raise ValueError(f"fused_column: expected activations (B, T, D), got {tuple(x.shape)}")
    try:
        has_bias, tensors = _flat_params(weights, biases, len(weights))
    except ValueError as e:
        raise ValueError(f"fused_column: {e}") from None
    sizes = None
    if sequence_parallel and tp_size(group) > 1:
        sizes = sequence_sizes(x, group, seq_len, "fused_column")
    adapt, factors = None, []
    if lora is not None:
        adapt = (tuple(lora.targets), tuple(float(s) for s in lora.scales), lora.partial)
        factors = [*lora.a, *lora.b]
    tensors = tensors[:len(weights)] + factors + tensors[len(weights):]
    return _FusedColumn.apply(x, group, sizes, keep_gathered_input, has_bias, adapt, *tensors)


def _check_lora(lora: ColumnLoRA, x: torch.Tensor, weights, sequence_parallel: bool) -> None:
    m, targets = len(lora.targets), sorted(set(lora.targets))
    if not m or {len(lora.a), len(lora.b), len(lora.scales), len(targets)} != {m} \
            or not 0 <= targets[0] <= targets[-1] < len(weights):
        raise ValueError(f"fused_column: LoRA targets {list(lora.targets)} (distinct outputs of "
                         f"{len(weights)} weights), {len(lora.a)} A, {len(lora.b)} B and "
                         f"{len(lora.scales)} scales: expected one A, B and scale a target")
    if lora.partial and (sequence_parallel or not x.requires_grad):
        raise ValueError("fused_column: partial LoRA sums ride the input gradient's all-reduce:"
                         " not under SP, nor on an input that requires no grad")


def regathering_column(x_full: torch.Tensor, x_shard: torch.Tensor, weights: list[torch.Tensor],
                       biases: list[torch.Tensor | None] | None = None,
                       group: ProcessGroup | None = None) -> tuple[torch.Tensor, ...]:
    """``tuple(F.linear(x_full, w_i, b_i) for i)`` keeping only ``x_shard`` for backward.

    x_full: (B, T, D), the all-gather of every rank's ``x_shard`` (B, T_r, D) (the output of
    ``gather_from_sequence(x_shard)``, whose backward reduce-scatters the input gradient).
    Backward gathers the shard again while it computes the input gradient (see above).
    """
    has_bias, tensors = _flat_params(weights, biases, len(weights))
    sizes = shard_sizes(x_full.shape[SEQ_DIM], tp_size(group))
    return _RegatheringColumn.apply(x_full, x_shard.detach(), group, sizes, has_bias, *tensors)

class _FusedRow(torch.autograd.Function):
    """forward: the row-parallel matmul (plus an addend), then all-reduce of its product;
    backward: local."""

    @staticmethod
    def forward(ctx, x, weight, group, addend):
        ctx.x_dtype = x.dtype
        ctx.addend_dtype = None if addend is None else addend.dtype
        cast = autocast_cast(x.device.type)  # what autocast's linear would compute
        x, weight = cast(x), cast(weight)
        y = F.linear(x, weight)  # (B, T, out): partial sums, made here and referenced nowhere
        if addend is not None:
            y.add_(addend.to(y.dtype))
        if tp_size(group) > 1:
            y = start_all_reduce(y, group)()  # in place (eager)
        # no dW wanted (a frozen weight): x is not kept
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_dx, need_dw, _, need_da = ctx.needs_input_grad
        dx = torch.matmul(dy, weight).to(ctx.x_dtype) if need_dx else None
        dw = dy.reshape(-1, dy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])) if need_dw else None
        return dx, dw, None, dy.to(ctx.addend_dtype) if need_da else None


def fused_row(x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup | None = None,
              addend: torch.Tensor | None = None) -> torch.Tensor:
    """``reduce_from_tp(F.linear(x, weight) + addend)`` with the all-reduce done in place on the
    product.

    x: (..., in_i) this rank's input shard; weight: (out, in_i); addend: (..., out), a partial
    sum added before the reduction (LoRA's B A_i x_i). Returns the summed (..., out).
    """
    return _FusedRow.apply(x, weight, group, addend)
