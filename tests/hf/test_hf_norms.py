"""``hf/norms.py``: the Llama family's RMSNorms run ``F.rms_norm`` on float32 activations (the
same function as transformers' forward, to fp32 rounding, in one op) and transformers' own
forward in other dtypes (bit for bit); ``parallelize`` fuses every one of them."""

import importlib

import pytest
import torch
import transformers

from tensorpar.hf import norms  # noqa: E402
from tensorpar.hf.parallelize import parallelize  # noqa: E402

from tp_check import assert_close  # noqa: E402

FAMILIES = {"LlamaRMSNorm": "llama", "MistralRMSNorm": "mistral", "Qwen2RMSNorm": "qwen2",
            "Qwen3RMSNorm": "qwen3"}


def _norm(cls_name: str) -> torch.nn.Module:
    module = importlib.import_module(f"transformers.models.{FAMILIES[cls_name]}."
                                     f"modeling_{FAMILIES[cls_name]}")
    norm = getattr(module, cls_name)(24, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(24) + 0.5)
    return norm


@pytest.mark.parametrize("cls_name", norms.FUSABLE)
def test_fused_norm_is_transformers_norm(cls_name):
    """fp32: output and the gradients of x and the weight equal transformers' forward to
    1e-6 relative; bf16: the fused module runs transformers' forward, bit for bit."""
    plain, fused = _norm(cls_name), _norm(cls_name)
    fused.load_state_dict(plain.state_dict())
    assert norms.fuse_rms_norms(fused) == [""]
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(0))
    outs, grads = [], []
    for norm in (plain, fused):
        xi = x.clone().requires_grad_()
        y = norm(xi)
        (y * torch.linspace(-1, 1, 24)).sum().backward()
        outs.append(y)
        grads += [xi.grad, norm.weight.grad]
    # measured over the 4 classes: output and weight grad 0, x grad 7.8e-8; 1e-6 is the floor
    # (a few fp32 ulps: the fused kernel may sum in another order on another CPU)
    assert_close("output", outs[1], outs[0], 1e-6)
    assert_close("x grad", grads[2], grads[0], 1e-6)
    assert_close("weight grad", grads[3], grads[1], 1e-6)
    xb = x.bfloat16()
    assert torch.equal(fused.bfloat16()(xb), plain.bfloat16()(xb))


def test_parallelize_fuses_every_norm(hf_configs):
    """The converted Llama's layer norms and final norm all run ``F.rms_norm``."""
    model = transformers.AutoModelForCausalLM.from_config(hf_configs["llama"])
    parallelize(model)
    fused = [name for name, m in model.named_modules()
             if getattr(m.forward, "__func__", None) is norms._forward]
    names = [name for name, m in model.named_modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert fused == names and "model.norm" in names and len(names) > 2
