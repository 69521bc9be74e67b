"""LayerNorm and RMSNorm that also run on sequence shards (Korthikanti et al., 2022).

Without sequence parallelism every rank normalizes the same full activations and computes the same
weight gradients: these are ``nn.LayerNorm`` / ``nn.RMSNorm`` exactly. Under sequence parallelism
each rank normalizes only its (B, T/n, D) slice of the tokens, so each rank's weight gradient is a
partial sum over its tokens; the gradients are summed across the TP group inside backward (one
all-reduce for weight and bias together), so no separate "sync the norm grads" call can be
forgotten.

``rms_norm`` is ``F.rms_norm`` with a faster backward for float32 training on the CPU. There torch
composes RMSNorm's backward from the autograd of its forward's ops (pow, mean, rsqrt, two
products: about ten passes over the activations, 3.9 ms forward and backward for 1,024 tokens of
width 512 on one core); ``_CPURMSNorm`` takes torch's fused forward and computes the gradients in
four passes (0.7 ms), keeping only the input and rstd, as torch's CUDA kernel does. Elsewhere
(CUDA, other dtypes, autocast, no gradient, under ``torch.compile``, whose inductor fuses it) it
is ``F.rms_norm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from tensorpar.parallel.mappings import sum_grads_in_backward
from tensorpar.parallel.sharding import REPLICATED

_FUSED_FORWARD = hasattr(torch.ops.aten, "_fused_rms_norm")  # torch's RMSNorm forward kernel


def rms_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None,
             eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm(x, normalized_shape, weight, eps)``, to fp32 rounding (the module docstring
    says when its CPU path runs)."""
    if (_FUSED_FORWARD and weight is not None and len(normalized_shape) == 1
            and x.device.type == "cpu"
            and x.dtype == weight.dtype == torch.float32 and torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad)
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()):
        return _CPURMSNorm.apply(x, weight, eps)
    return F.rms_norm(x, normalized_shape, weight, eps)


class _CPURMSNorm(torch.autograd.Function):
    """y = x r w, r = (mean(x^2) + eps)^-1/2 over the last dim; x and r saved."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x * rstd
        grad_w = None
        if ctx.needs_input_grad[1]:  # sum over every token of grad_y x_hat
            grad_w = (grad_y * x_hat).reshape(-1, x.shape[-1]).sum(0)
        grad_x = None
        if ctx.needs_input_grad[0]:  # r (g w - x_hat mean(g w x_hat)), per token
            g_w = grad_y * weight
            mean = torch.linalg.vecdot(g_w, x_hat).unsqueeze_(-1).div_(x.shape[-1])
            grad_x = torch.addcmul(g_w, x_hat, mean, value=-1).mul_(rstd)
        return grad_x, grad_w, None


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
        return rms_norm(x, self.normalized_shape, weight, self.eps)
