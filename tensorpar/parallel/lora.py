"""LoRA on tensor-parallel linear layers (Hu et al., 2021): ``y = W x + (alpha / r) · B A x`` with
W frozen and only the small factors A (r, in) and B (out, r) trained, each factor split so that the
layer's own collectives carry the update.

Column-parallel base (W split by output features)::

    A replicated (r, in)        z = A x          x: the layer's input inside the TP region
    B split like W's rows       y_i = W_i x + s · B_i z

    A's product is one more output of the block's fused column op, so its input gradient joins
    the base's all-reduce (or reduce-scatter) in backward: Σ_i (W_i^T dy_i + A^T B_i^T s dy_i),
    exactly the dense input gradient. A's weight gradient on a rank is its part
    B_i^T s dy_i x^T, so A's gradients are summed over the group in backward: one all-reduce of
    r · in values per op (``grad_sync.sum_grads_in_backward``), the price of keeping A whole.

Row-parallel base (W split by input features)::

    A split like W's columns    z_i = A_i x_i    (a partial sum of z = A x)
    B replicated (out, r)       y = g(W_i x_i + s · B z_i)

    B z_i is added to the partial product before the reduction, and the sum of the B z_i is
    B z: the update rides on the base's all-reduce (or reduce-scatter). B's weight gradient on a
    rank is s · dy z_i^T, a part of s · dy z^T, so B's gradients are summed in backward: one
    all-reduce of out · r values.

So LoRA adds no collective on activations; it adds one all-reduce of the replicated factor's
gradient per adapted op (A for a block's column op, B for each row layer), r/(B·T) of the
activations' size. Initialised as PEFT does: A by ``nn.Linear``'s rule (Kaiming uniform,
a = sqrt(5)) drawn dense from a generator seeded by the layer's name, B zeros; so every TP size
starts from the same adapter.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tensorpar.parallel.sharding import REPLICATED, ShardSpec, local_parameter
from tensorpar.runtime.seeds import derive_seed


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
                in_range: tuple[int, int] | None = None) -> None:
    """Give ``layer`` (a column or row layer) the factors ``lora_A`` and ``lora_B``, this rank's
    pieces of the dense ``a_dense`` (r, in) and ``b_dense`` (out, r), and ``lora_scale``
    alpha / r. split: "column" (B's rows as ``out_spec``, the layer's weight rows) or "row" (A's
    columns ``in_range``, the layer's weight columns)."""
    rank = a_dense.shape[0]
    if split == "column":
        a = local_parameter(a_dense, REPLICATED)
        b = local_parameter(out_spec.take(b_dense).contiguous(), out_spec)
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


def has_lora(layer: nn.Module) -> bool:
    return isinstance(getattr(layer, "lora_A", None), LoRAFactor)


def column_update(y: torch.Tensor, z: torch.Tensor, layer: nn.Module,
                  b: torch.Tensor | None = None) -> torch.Tensor:
    """A column layer's output ``y`` plus its update ``s · B_i z`` (z = A x from the fused op;
    b: B as the caller has it, its gradients summed where ranks share its rows)."""
    b = layer.lora_B.weight if b is None else b
    return y + layer.lora_scale * F.linear(z, b)


def row_addend(x: torch.Tensor, layer: nn.Module, b: torch.Tensor) -> torch.Tensor:
    """``s · B A_i x_i``, the row layer's update before the reduction (b: B with its gradients
    summed over the group)."""
    return layer.lora_scale * F.linear(F.linear(x, layer.lora_A.weight), b)


def lora_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The adapters' parameters, by name."""
    return [(n, p) for n, p in model.named_parameters()
            if n.endswith((".lora_A.weight", ".lora_B.weight"))]
