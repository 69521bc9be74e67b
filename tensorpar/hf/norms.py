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
