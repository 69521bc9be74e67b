"""AdamW as tensorpar trains with it: torch's fused kernel where the parameters allow it, with the
same steps as the single-tensor loop; each implementation's step memory as the planner counts it."""

import pytest
import torch

from tensorpar.planner.memory import ADAMW, adamw_temporaries
from tensorpar.planner.meter import MemoryMeter
from tensorpar.train.optim import adamw, fusable, implementation

from tests_common import ADAMW_OPTIONS


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


@pytest.mark.parametrize("kind", ADAMW)
def test_step_temporaries_as_planned(kind):
    """What each AdamW implementation allocates during a steady-state step (MemoryMeter) equals
    the planner's term exactly: none fused, a temporary per parameter foreach, two of one
    parameter in the loop (sizes chosen so that the three differ)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(256, 64), (64,), (32, 64), (100,)]]
    opt = torch.optim.AdamW(params, lr=1e-3, **ADAMW_OPTIONS[kind])
    assert implementation(opt) == kind
    for _ in range(2):  # the second step: the moments exist
        for p in params:
            p.grad = torch.randn_like(p)
        with MemoryMeter() as meter:
            opt.step()
    sizes = [p.numel() for p in params]
    assert meter.peak_bytes - meter.entry_bytes == adamw_temporaries(kind, sum(sizes), max(sizes))


def test_groups_and_explicit_choices_are_kept():
    """Parameters given as a generator inside a group all reach torch; a caller's own
    ``foreach`` or ``fused`` wins over the automatic choice."""
    model = torch.nn.Linear(3, 4)
    opt = adamw([{"params": model.parameters(), "weight_decay": 0.0}], lr=1e-3)
    assert len(opt.param_groups[0]["params"]) == 2 and implementation(opt) == "fused"
    assert implementation(adamw(model.parameters(), lr=1e-3, foreach=True)) == "foreach"
    assert implementation(adamw(model.parameters(), lr=1e-3, fused=False)) == "for-loop"
