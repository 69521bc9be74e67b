"""The Llama family's RMSNorm as tensorpar's GPT runs it (``parallel.norm.rms_norm``).

transformers' ``LlamaRMSNorm`` (Mistral's, Qwen2's and Qwen3's are the same code) computes::

    weight * (x.float() * rsqrt(mean(x.float() ** 2, -1) + eps)).to(x.dtype)

as five autograd ops, a pass over the activations each in forward and more in backward, where
``F.rms_norm`` is one kernel forward (and one backward on CUDA; ``rms_norm`` adds a four-pass
CPU backward). On the 2-core CPU the nine norms of the benchmark's Llama took 31 ms more per
step than ``F.rms_norm`` (forward and backward, 4 x 256 tokens of width 512): the whole
difference between the HF path and the GPT at the time.

For float32 activations and weights the two are the same function, to fp32 rounding (the mean
is summed in another order), so ``fuse_rms_norms`` makes those norms call ``rms_norm``. In
other dtypes a norm keeps transformers' forward: it rounds the normalized x to the input dtype
before the weight product, which ``F.rms_norm`` does not. The module keeps its class, its
parameter and its hooks (sequence parallelism sums its gradient through a forward pre-hook).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from tensorpar.parallel.mappings import copy_to_tp, reduce_from_tp
from tensorpar.parallel.norm import rms_norm

# classes whose forward is exactly the formula above (checked in tests/hf/test_hf_norms.py)
FUSABLE = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def _forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == self.weight.dtype == torch.float32:
        return rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)
    return type(self).forward(self, x)  # transformers' own


def fuse_rms_norms(model: nn.Module) -> list[str]:
    """Make every Llama-family RMSNorm of ``model`` (the layers', the final one, Qwen3's per-head
    q/k norms) run ``rms_norm`` on float32 inputs; returns their names."""
    names = []
    for name, m in model.named_modules():
        if type(m).__name__ in FUSABLE and isinstance(getattr(m, "weight", None), nn.Parameter) \
                and m.weight.dim() == 1 and hasattr(m, "variance_epsilon"):
            m.forward = types.MethodType(_forward, m)
            names.append(name)
    return names


class HeadsRMSNorm(nn.Module):
    """An RMSNorm over all heads together (OLMoE's and OLMo-2's q/k norms, width heads x
    head_dim) run on this rank's heads: the weight is split with the heads, and each token's
    sum of squares is all-reduced over the TP group (in backward too: every rank's normalised
    heads read it), so the mean is over the full width::

        weight_shard * (x_shard * rsqrt(sum_ranks(sum(x_shard ** 2)) / width + eps))

    in float32, rounded to x's dtype before the weight product, as transformers' RMSNorm. The
    shards of two ranks must not overlap (KV heads shared by ranks would count twice).
    """

    def __init__(self, weight: nn.Parameter, width: int, eps: float, group):
        super().__init__()
        self.weight, self.width, self.variance_epsilon, self.group = weight, width, eps, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        squares = reduce_from_tp(h.pow(2).sum(-1, keepdim=True), self.group)  # (..., 1)
        squares = copy_to_tp(squares, self.group)  # its gradient summed over the ranks
        h = h * torch.rsqrt(squares / self.width + self.variance_epsilon)
        return self.weight * h.to(x.dtype)
