"""AdamW as tensorpar trains with it: torch's fused kernel where the parameters allow it, with the
same steps as the single-tensor loop."""

import torch

from tensorpar.optim import adamw, fusable, implementation


def test_fused_on_cpu_and_same_steps_as_the_loop():
    """CPU float parameters get the fused AdamW; after 5 steps its weights equal the for-loop's
    to fp32 rounding (1e-6 relative)."""
    torch.manual_seed(0)
    start = [torch.randn(33, 17), torch.randn(17)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(5)]
    results = {}
    for kind in ("fused", "for-loop"):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        groups = [{"params": params[:1], "weight_decay": 0.1},
                  {"params": params[1:], "weight_decay": 0.0}]
        opt = adamw(groups, lr=1e-2) if kind == "fused" else \
            torch.optim.AdamW(groups, lr=1e-2, foreach=False)
        assert implementation(opt) == kind
        for step in grads:
            for p, g in zip(params, step, strict=True):
                p.grad = g.clone()
            opt.step()
        results[kind] = [p.detach() for p in params]
    for a, b in zip(results["fused"], results["for-loop"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_not_fusable_falls_back_to_torchs_default():
    """Parameters torch's fused kernel does not take (here on the meta device) get the default
    implementation, not an error."""
    p = torch.nn.Parameter(torch.empty(4, device="meta"))
    assert not fusable([p])
    assert implementation(adamw([p], lr=1e-3)) == "for-loop"
    assert fusable([torch.nn.Parameter(torch.ones(2))])
