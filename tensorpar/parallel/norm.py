"""LayerNorm and RMSNorm that also run on sequence shards (Korthikanti et al., 2022).

Without sequence parallelism every rank normalizes the same full activations and computes the same
weight gradients: these are ``nn.LayerNorm`` / ``nn.RMSNorm`` exactly. Under sequence parallelism
each rank normalizes only its (B, T/n, D) slice of the tokens, so each rank's weight gradient is a
partial sum over its tokens; the gradients are summed across the TP group inside backward (one
all-reduce for weight and bias together), so no separate "sync the norm grads" call can be
forgotten.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.parallel.grad_sync import sum_grads_in_backward
from tensorpar.parallel.sharding import REPLICATED


def _tag_replicated(module: nn.Module) -> None:
    for p in module.parameters(recurse=False):
        p.tp_shard = REPLICATED


def _copy_from(layer: nn.Module, dense: nn.Module) -> None:
    """Own copies of the dense norm's parameters, frozen where they were frozen."""
    layer.load_state_dict({k: v.clone() for k, v in dense.state_dict().items()}, assign=True)
    for name, p in layer.named_parameters(recurse=False):
        p.requires_grad_(getattr(dense, name).requires_grad)
    _tag_replicated(layer)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that may run on sequence shards (``sequence_parallel=True``)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, sequence_parallel: bool = False,
                 group: ProcessGroup | None = None, *, device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device=device,
                         dtype=dtype)
        self.sequence_parallel, self.group = sequence_parallel, group
        _tag_replicated(self)

    @classmethod
    def from_dense(cls, norm: nn.LayerNorm, sequence_parallel: bool = False,
                   group: ProcessGroup | None = None) -> LayerNorm:
        layer = cls(norm.normalized_shape, norm.eps, norm.elementwise_affine,
                    norm.bias is not None, sequence_parallel, group, device="meta")
        _copy_from(layer, norm)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.sequence_parallel and weight is not None:
            weight, *rest = sum_grads_in_backward([p for p in (weight, bias) if p is not None],
                                                  self.group)
            bias = rest[0] if rest else None
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` that may run on sequence shards (``sequence_parallel=True``)."""

    def __init__(self, normalized_shape, eps: float | None = None,
                 elementwise_affine: bool = True, sequence_parallel: bool = False,
                 group: ProcessGroup | None = None, *, device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, device=device, dtype=dtype)
        self.sequence_parallel, self.group = sequence_parallel, group
        _tag_replicated(self)

    @classmethod
    def from_dense(cls, norm: nn.RMSNorm, sequence_parallel: bool = False,
                   group: ProcessGroup | None = None) -> RMSNorm:
        layer = cls(norm.normalized_shape, norm.eps, norm.elementwise_affine,
                    sequence_parallel, group, device="meta")
        _copy_from(layer, norm)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.sequence_parallel and weight is not None:
            (weight,) = sum_grads_in_backward([weight], self.group)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)
