"""LoRA on tensor-parallel linear layers (Hu et al., 2021): ``y = W x + (alpha / r) · B A x`` with
W frozen and only the small factors A (r, in) and B (out, r) trained, each factor split so that the
layer's own collectives carry the update.

Column-parallel base (W split by output features)::

    A replicated (r, in)        z = A x          x: the layer's input inside the TP region
    B split like W's rows       y_i = W_i x + s · B_i z

    The adapters are part of the block's fused column op (``fused.ColumnLoRA``): it computes
    z for all of them in one matmul, adds s · B_i z to its outputs in place, and in backward
    makes B_i's gradient s · dy_i z^T (local) and z's. Each rank's gradient of z,
    dz_i = s B_i^T dy_i, is its part of the whole dz. Without SP dz_i travels in the base's
    input-gradient all-reduce (``ColumnLoRA.partial``): after it every rank holds
    Σ_i W_i^T dy_i and dz, so dx = Σ_i W_i^T dy_i + A^T dz is the dense input gradient and
    dA = dz x^T is whole: no collective of A's own. Under SP (each rank's dA is over its tokens),
    and where the input needs no gradient (the first block's, the embedding frozen), A's product's
    gradient joins the input gradient's reduce-scatter as in the plain op and A's gradients are
    summed over the group in backward: one all-reduce of r · in values per op
    (``mappings.sum_grads_in_backward``).

Row-parallel base (W split by input features)::

    A split like W's columns    z_i = A_i x_i    (a partial sum of z = A x)
    B replicated (out, r)       y = g(W_i x_i + s · B z_i)

    Without SP z_i travels in the base's forward all-reduce, beside the partial product
    (``lora_row``: one flat buffer, one collective), and the update s · B z is added after it:
    B's gradient s · dy z^T and z's, s B^T dy, are then whole on every rank, and A_i's,
    dz x_i^T, is its columns of the dense one; backward is local. Under SP B z_i is added to the
    partial product before its reduce-scatter, and the sum of the B z_i is B z; B's weight
    gradient on a rank is s · dy_r z_r^T over its tokens, so B's gradients are summed in
    backward: one all-reduce of out · r values.

So LoRA adds no collective without SP and without adapter dropout: z (r values a token) rides
each row layer's forward all-reduce and dz each column op's input-gradient all-reduce; only the
first adapted column op whose input needs no gradient (the first block's attention with the
default targets) sums its A's gradients in one all-reduce of its own. With adapter dropout A
leaves the fused op: each adapted column op all-reduces its dz, (B, T, r), in backward.
Under SP it adds one all-reduce of the replicated factor's gradient per adapted op (A for
a block's column op, B for each row layer), r/(B·T) of the activations' size.

Initialised as PEFT does: A by ``nn.Linear``'s rule (Kaiming uniform, a = sqrt(5)) drawn dense
from a generator seeded by the layer's name, B zeros; so every TP size starts from the same
adapter.

Dropout (PEFT's ``lora_dropout``: ``B A dropout(x)``, a mask of its own per adapted layer)::

    every mask is drawn dense, (B, T, in), from (step seed, forward number, layer), and each
    rank keeps its part: a row layer its input columns, a column layer under SP its tokens.
    So the masks are those of TP=1 at every TP size, and a recomputed forward (same step, same
    forward number) draws them again.

    Row base: nothing changes, z_i = A_i (m_i ⊙ x_i) / (1 - p) still sums to A dropout(x).
    Column base: A's input is no longer the base's, so A leaves the fused op. Each rank computes
    z = A dropout(x) on the block's input as it holds it, and z enters the TP region as any
    column input does (``enter_tp_region``: f, or the sequence all-gather under SP): backward
    sums the ranks' partial dz, one all-reduce (reduce-scatter under SP) of (B, T, r·k) values
    for a block's k adapted columns. Without SP, A's gradient is then whole on every rank (no
    sum of A's gradients); under SP each rank's is over its tokens and is summed as before.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.parallel.collectives import start_all_reduce
from tensorpar.parallel.dropout import dropout_mask
from tensorpar.parallel.fused import ColumnLoRA, autocast_cast
from tensorpar.parallel.mappings import enter_tp_region, sum_grads_in_backward
from tensorpar.parallel.sharding import REPLICATED, ShardSpec, local_parameter, shard_range
from tensorpar.runtime.groups import tp_rank, tp_size
from tensorpar.runtime.seeds import derive_seed


class LoRADropout:
    """The adapters' dropout masks: probability ``p``, drawn from the seed of the step
    (``restart``; at first (seed, "lora-dropout", step 0, dp rank 0)) and the model's forward
    number within it (``next_forward``, a forward pre-hook on the model), one mask per layer
    (its ``lora_site``)."""

    def __init__(self, p: float, seed: int):
        if not 0.0 <= p < 1.0:
            raise ValueError(f"--lora-dropout {p} must be in [0, 1)")
        self.p = p
        # int64 [step seed, forward number], updated in place (dropout_mask's key)
        self.key = torch.zeros(2, dtype=torch.int64)
        self.restart(derive_seed(seed, "lora-dropout", 0, 0))

    def restart(self, step_seed: int) -> None:
        """Start the step whose seed is ``step_seed`` (``hf.dropout.seed_dropout``)."""
        self.key[0], self.key[1] = step_seed, 0

    def next_forward(self) -> None:
        self.key[1] += 1

    def drop(self, x: torch.Tensor, site: int, dense_shape, part: tuple) -> torch.Tensor:
        """``x`` with this rank's ``part`` (a tuple of slices) of the dense mask of ``site``
        zeroed and the rest scaled by 1 / (1 - p)."""
        mask = dropout_mask(list(dense_shape), self.p, self.key, site, x.device)[part]
        return x.masked_fill(mask, 0.0) * (1.0 / (1.0 - self.p))


def drops(layer: nn.Module) -> bool:
    """Whether ``layer``'s adapter drops its input now (a dropout above 0, training)."""
    stream = getattr(layer, "lora_dropout", None)
    return layer.training and stream is not None and stream.p > 0


def dropped_input(x: torch.Tensor, layer: nn.Module, group: ProcessGroup | None,
                  seq_len: int | None = None) -> torch.Tensor:
    """The adapter's input with its mask: a row layer's x_i (..., in_local) keeps its columns of
    the dense mask; a column layer's x its tokens under SP (``seq_len`` T, x (B, T_r, D)), else
    all of it."""
    shape, part = list(x.shape), [slice(None)] * x.dim()
    if layer.lora_split == "row":
        shape[-1] = layer.in_features
        part[-1] = slice(layer.shard_start, layer.shard_stop)
    elif seq_len is not None and tp_size(group) > 1:
        shape[1] = seq_len
        part[1] = slice(*shard_range(seq_len, tp_size(group), tp_rank(group)))
    return layer.lora_dropout.drop(x, layer.lora_site, shape, tuple(part))


def dropped_column_products(x: torch.Tensor, layers: list[nn.Module],
                            group: ProcessGroup | None,
                            seq_len: int | None = None) -> list[torch.Tensor]:
    """z = A dropout(x) of each column layer in ``layers`` on the block's input ``x`` as this
    rank holds it (under SP its tokens, ``seq_len`` T), entering the TP region together: one
    all-reduce (reduce-scatter) of their gradients in backward."""
    sp = seq_len is not None
    factors = [c.lora_A.weight for c in layers]
    if sp:  # each rank's A gradient is over its tokens
        factors = sum_grads_in_backward(factors, group)
    zs = [F.linear(dropped_input(x, c, group, seq_len), a)
          for c, a in zip(layers, factors, strict=True)]
    z = enter_tp_region(torch.cat(zs, dim=-1), sp, group, seq_len)
    return list(z.split([a.shape[0] for a in factors], dim=-1))


class LoRAFactor(nn.Module):
    """One factor, A or B, as PEFT names it: ``<layer>.lora_A.weight``."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight


def dense_lora_a(name: str, rank: int, in_features: int, seed: int,
                 dtype=torch.float32) -> torch.Tensor:
    """The dense A of layer ``name``: ``nn.Linear``'s initialisation, drawn from (seed, name)."""
    gen = torch.Generator().manual_seed(derive_seed(seed, "lora-a", name))
    bound = 1 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on (rank, in_features)
    return (torch.rand(rank, in_features, generator=gen, dtype=torch.float64) * 2 - 1) \
        .mul_(bound).to(dtype)


def attach_lora(layer: nn.Module, split: str, a_dense: torch.Tensor, b_dense: torch.Tensor,
                alpha: float, out_spec: ShardSpec | None = None,
                in_range: tuple[int, int] | None = None, dropout: LoRADropout | None = None,
                site: int = 0) -> None:
    """Give ``layer`` (a column or row layer) the factors ``lora_A`` and ``lora_B``, this rank's
    pieces of the dense ``a_dense`` (r, in) and ``b_dense`` (out, r), and ``lora_scale``
    alpha / r. split: "column" (B's rows as ``out_spec``, the layer's weight rows) or "row" (A's
    columns ``in_range``, the layer's weight columns). dropout: the model's adapter dropout, if
    any; site: this layer's mask number in it."""
    rank = a_dense.shape[0]
    if split == "column":
        a = local_parameter(a_dense, REPLICATED)
        b = local_parameter(out_spec.take(b_dense).clone(), out_spec)  # not a view of B
    elif split == "row":
        start, stop = in_range
        spec = ShardSpec(1, start, stop, a_dense.shape[1])
        a = local_parameter(a_dense[:, start:stop].contiguous(), spec)
        b = local_parameter(b_dense, REPLICATED)
    else:
        raise ValueError(f"split {split!r}: expected column or row")
    layer.lora_A, layer.lora_B = LoRAFactor(a), LoRAFactor(b)
    layer.lora_scale = alpha / rank
    layer.lora_split = split
    layer.lora_dropout, layer.lora_site = dropout, site


def has_lora(layer: nn.Module) -> bool:
    return isinstance(getattr(layer, "lora_A", None), LoRAFactor)


def column_update(y: torch.Tensor, z: torch.Tensor, layer: nn.Module,
                  b: torch.Tensor | None = None) -> torch.Tensor:
    """A column layer's output ``y`` plus its update ``s · B_i z`` (z = A dropout(x), when the
    adapter drops; b: B as the caller has it, its gradients summed where ranks share its rows)."""
    b = layer.lora_B.weight if b is None else b
    # one addmm: y + s · z B^T, with no pass over y for the scale
    return torch.addmm(y.reshape(-1, y.shape[-1]), z.reshape(-1, z.shape[-1]), b.t(),
                       alpha=layer.lora_scale).view(y.shape)


def column_lora(layers: list[nn.Module], targets: list[int], bs: list[torch.Tensor],
                x: torch.Tensor, group: ProcessGroup | None,
                sequence_parallel: bool) -> ColumnLoRA:
    """The adapters of the column ``layers`` (outputs ``targets`` of their fused column op on
    ``x``; bs: their B as the caller has them) folded into that op (``fused.ColumnLoRA``). A's
    products' gradients are partial sums that ride the input gradient's all-reduce without SP
    on an input that needs a gradient; elsewhere A's gradients are summed by one all-reduce of
    their own."""
    factors = [c.lora_A.weight for c in layers]
    partial = not sequence_parallel and tp_size(group) > 1 and x.requires_grad \
        and torch.is_grad_enabled()
    if not partial:
        factors = sum_grads_in_backward(factors, group)
    return ColumnLoRA(tuple(factors), tuple(bs), tuple(targets),
                      tuple(c.lora_scale for c in layers), partial)


class _LoRARow(torch.autograd.Function):
    """forward: the row-parallel matmul and the adapter's z_i = A_i x_i, all-reduced together
    (one flat buffer), then y = P + s · z B^T; backward: local (z's and B's gradients are whole,
    A_i's is its columns of the dense one). z and dz are held transposed, (r, N): every adapter
    matmul then has the tokens last, which is many times faster on CPU (``fused._Adapters``)."""

    @staticmethod
    def forward(ctx, x, x_a, weight, a, b, scale, group):
        cast = autocast_cast(x.device.type)  # what autocast's linears would compute
        ctx.x_dtype, ctx.scale = x.dtype, scale
        x, weight, a, b = cast(x), cast(weight), cast(a), cast(b)
        x_a = x if x_a is None else cast(x_a)  # the adapter's input: x, or x dropped
        x_2d = x.reshape(-1, x.shape[-1])
        (N, out), r = (x_2d.shape[0], weight.shape[0]), a.shape[0]
        flat = x_2d.new_empty(N * (out + r))  # (N, out) partial product, then (r, N) z_i^T
        torch.mm(x_2d, weight.t(), out=flat[:N * out].view(N, out))
        torch.mm(a, x_a.reshape(N, -1).t(), out=flat[N * out:].view(r, N))
        flat = start_all_reduce(flat, group)()  # in place (eager)
        zt = flat[N * out:].view(r, N).clone()  # (a view would keep the product for backward)
        y = flat[:N * out].view(N, out).addmm_(zt.t(), b.t(), alpha=scale)  # in place: no copy
        ctx.save_for_backward(x if ctx.needs_input_grad[2] else None, x_a, weight, a, b, zt)
        ctx.own_input = ctx.needs_input_grad[1]  # x_a is a tensor of its own
        return y.view(*x.shape[:-1], out)

    @staticmethod
    def backward(ctx, dy):
        x, x_a, weight, a, b, zt = ctx.saved_tensors
        need_dx, need_dxa, need_dw, need_da, need_db = ctx.needs_input_grad[:5]
        dy_2d = dy.reshape(-1, dy.shape[-1])
        dzt = b.t().mm(dy_2d.t()).mul_(ctx.scale)  # (r, N), whole: s B^T dy
        db = zt.mm(dy_2d).mul_(ctx.scale).t().contiguous() if need_db else None  # s dy^T z
        da = dzt.mm(x_a.reshape(dzt.shape[1], -1)) if need_da else None
        dx = dxa = None
        if need_dx:
            dx = dy_2d.mm(weight).to(ctx.x_dtype)
            if not ctx.own_input:  # the adapter's input is x: its gradient joins dx
                dx = dx.addmm_(dzt.t(), a) if a.dtype == dx.dtype else dx.add_(dzt.t().mm(a))
            dx = dx.view(*dy.shape[:-1], -1)
        if need_dxa:
            dxa = dzt.t().mm(a).view(*dy.shape[:-1], -1).to(ctx.x_dtype)
        dw = dy_2d.t().mm(x.reshape(dy_2d.shape[0], -1)) if need_dw else None
        return dx, dxa, dw, da, db, None, None


def lora_row(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """The reduced output of row ``layer`` (a ``RowParallelLinear`` with an adapter, without SP)
    for its input shard ``x`` (..., in_i): sum_i W_i x_i + s · B A x, the adapter's z_i riding
    the product's all-reduce (``_LoRARow``); x_i with its part of the dense mask for the
    adapter when it drops."""
    x_a = dropped_input(x, layer, layer.group) if drops(layer) else None
    return _LoRARow.apply(x, x_a, layer.weight, layer.lora_A.weight, layer.lora_B.weight,
                          layer.lora_scale, layer.group)


def row_addend(x: torch.Tensor, layer: nn.Module, b: torch.Tensor) -> torch.Tensor:
    """``s · B A_i x_i``, the row layer's update before the reduction (b: B with its gradients
    summed over the group; x_i with its part of the dense mask when the adapter drops)."""
    if drops(layer):
        x = dropped_input(x, layer, layer.group)
    return F.linear(F.linear(x, layer.lora_A.weight) * layer.lora_scale, b)  # s on (.., r)


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapters' parameters, by name."""
    return [(n, p) for n, p in model.named_parameters()
            if n.endswith((".lora_A.weight", ".lora_B.weight"))]
