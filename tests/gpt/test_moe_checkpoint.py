"""Checkpoints of a model with routed experts keep every expert once and reshard across
(tp, dp, ep): two ``ParallelMoE`` layers (6 experts, top-2, shared experts split by TP) saved
with their AdamW moments at one layout load at another with every weight and moment equal to
what was saved, bit for bit, and the loaded layers compute what one device computes.

Layouts on n ranks, rank = d * tp + t (TP groups are consecutive ranks, data groups strided):
``ep="world"`` splits the experts over every rank (tp 2, dp 2, ep 4: 2, 2, 1, 1 experts),
``ep="tp"`` over the TP group (tp 2, dp 2, ep 2: the second data rank's TP group holds copies of
the first's experts, which are written once), as ``train --ep`` folds them
(``mesh/experts.py``).
"""

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from tensorpar.checkpoint.format import CheckpointError, find_checkpoint
from tensorpar.checkpoint.load import load_checkpoint
from tensorpar.checkpoint.save import save_checkpoint
from tensorpar.cli.compare import dense_shard
from tensorpar.parallel.ownership import ShardOwnership
from tensorpar.parallel.sharding import param_shard
from tensorpar.transformer.moe import MoEConfig, ParallelMoE
from tensorpar.transformer.reference import DenseMoE

CONFIG = MoEConfig(dim=16, hidden_dim=16, num_experts=6, top_k=2, shared_hidden_dim=8)
LAYERS = 2
LAYOUTS = {  # name: (ranks, tp, ep over)
    "tp1-ep1": (1, 1, "tp"), "tp2-dp2-ep4": (4, 2, "world"), "tp2-dp2-ep2": (4, 2, "tp"),
    "tp4-ep4": (4, 4, "tp"),
}
_GROUPS: dict = {}


def _groups(n: int, tp: int, ep: str):
    """(tp_group, dp_group, ep_group) of this rank; collective on first use, cached per process
    (every rank asks for the same layouts in the same order)."""
    if (n, tp) not in _GROUPS:
        tp_group = dist.new_subgroups_by_enumeration(
            [list(range(d * tp, d * tp + tp)) for d in range(n // tp)])[0]
        dp_group = dist.new_subgroups_by_enumeration(
            [list(range(t, n, tp)) for t in range(tp)])[0]
        _GROUPS[n, tp] = tp_group, dp_group
    tp_group, dp_group = _GROUPS[n, tp]
    return tp_group, dp_group, {"world": None, "tp": tp_group}[ep]


class MoEStack(nn.Module):
    """Residual MoE layers: what a checkpoint of an MoE model holds (replicated routers, TP-split
    shared experts, EP-split routed experts)."""

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)[0]
        return x


def _dense(seed: int) -> MoEStack:
    torch.manual_seed(seed)
    return MoEStack([DenseMoE(CONFIG) for _ in range(LAYERS)])


def _sharded(dense: MoEStack, tp_group, ep_group) -> MoEStack:
    return MoEStack([ParallelMoE.from_dense(
        CONFIG, d.router.weight, d.experts.gate_up_proj, d.experts.down_proj,
        (d.shared.gate, d.shared.up, d.shared.down), tp_group=tp_group, ep_group=ep_group)
        for d in dense.layers])


def _local(model, opt) -> dict:
    """Each parameter's split and its local weight and AdamW moments, to compare."""
    out = {}
    for name, p in model.named_parameters():
        state = opt.state[p] if opt is not None else {}
        spec = param_shard(p)
        out[name] = (spec, p.detach().clone(),
                     *(state[s].clone() for s in ("exp_avg", "exp_avg_sq") if s in state))
    return out


def _save_body(path: str, layout: str):
    """One AdamW step with gradients made up per parameter (the same dense ones on every rank,
    each rank taking its slice), then a save; returns the local tensors saved."""
    n, tp, ep = LAYOUTS[layout]
    tp_group, dp_group, ep_group = _groups(n, tp, ep)
    model = _sharded(_dense(0), tp_group, ep_group)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    grads = _dense(1)  # its weights serve as the dense gradients
    for p, g in zip(model.parameters(), grads.parameters(), strict=True):
        p.grad = dense_shard(g.detach(), param_shard(p)).clone()
    opt.step()
    save_checkpoint(path, 3, model, ShardOwnership.gather(model, tp_group), opt, tp_group,
                    meta={"config": {}}, dp_group=dp_group)
    return _local(model, opt)


def _load_body(path: str, layout: str, x: torch.Tensor):
    """Load into layers built from other weights; return the local tensors and the output."""
    n, tp, ep = LAYOUTS[layout]
    tp_group, _, ep_group = _groups(n, tp, ep)
    model = _sharded(_dense(5), tp_group, ep_group)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    load_checkpoint(path, model, opt)
    with torch.no_grad():
        return _local(model, opt), model(x)


def _assemble(results: list[dict]) -> dict[str, list[torch.Tensor]]:
    """The dense weight and moments of each parameter, put together from every rank's slice
    (where two ranks hold the same slice, they agree)."""
    dense = {}
    for local in results:
        for name, (spec, *tensors) in local.items():
            if name not in dense:
                shape = list(tensors[0].shape)
                if spec.dim is not None:
                    shape[spec.dim] = spec.full_size
                dense[name] = [torch.full(shape, float("nan")) for _ in tensors]
            for whole, t in zip(dense[name], tensors, strict=True):
                part = whole if spec.dim is None else whole.narrow(spec.dim, spec.start,
                                                                   spec.stop - spec.start)
                assert part.isnan().all() or torch.equal(part, t), name
                part.copy_(t)
    return dense


@pytest.fixture(scope="module")
def saved(ranks, tmp_path_factory):
    """The two layouts with data parallelism, saved once each: {layout: (dir, dense tensors)}."""
    out = {}
    for layout in ("tp2-dp2-ep4", "tp2-dp2-ep2"):
        path = tmp_path_factory.mktemp(layout)
        out[layout] = path, _assemble(ranks(4).run(_save_body, str(path), layout))
    return out


@pytest.mark.parametrize("layout", ["tp2-dp2-ep4", "tp2-dp2-ep2"])
def test_every_expert_written_once(saved, layout):
    """The files hold every dense element of every weight and moment exactly once: the experts
    from the ranks that hold them (data ranks included), never again from their copies."""
    path, dense = saved[layout]
    ckpt = find_checkpoint(path)
    files = sorted(ckpt.glob("rank*.safetensors"))
    assert [f.name for f in files] == [f"rank{r:02d}-of04.safetensors" for r in range(4)]
    stored: dict[str, int] = {}
    for f in files:
        for key, t in load_file(f).items():
            stored[key] = stored.get(key, 0) + t.numel()
    want = {}
    for name, (weight, *moments) in dense.items():
        want[name] = weight.numel()
        want |= {f"optimizer.{s}.{name}": m.numel()
                 for s, m in zip(("exp_avg", "exp_avg_sq"), moments, strict=True)}
    assert stored == want
    writers = {f.name: sorted(k for k in load_file(f) if k.startswith("layers.0.experts.down"))
               for f in files}
    expected = {"tp2-dp2-ep4": [0, 1, 2, 3], "tp2-dp2-ep2": [0, 1]}[layout]
    assert [i for i, f in enumerate(files) if writers[f.name]] == expected


@pytest.mark.parametrize("saved_at", ["tp2-dp2-ep4", "tp2-dp2-ep2"])
@pytest.mark.parametrize("loaded_at", ["tp1-ep1", "tp4-ep4"])
def test_reshard_across_tp_dp_ep(ranks, saved, saved_at, loaded_at):
    """Loaded at another (tp, ep): every rank's weights and AdamW moments are its slices of what
    was saved, bit for bit, and the layers' output is one device's with the saved weights."""
    path, dense = saved[saved_at]
    x = torch.randn(2, 5, CONFIG.dim, generator=torch.Generator().manual_seed(0))
    reference = _dense(0)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(dense[name][0])
        y_ref = reference(x)
    results = ranks(LAYOUTS[loaded_at][0]).run(_load_body, str(path), loaded_at, x)
    for local, y in results:
        for name, (spec, *tensors) in local.items():
            assert len(tensors) == 3, name  # the weight and both moments
            for t, whole in zip(tensors, dense[name], strict=True):
                assert torch.equal(t, dense_shard(whole, spec)), name
        # measured 1.2e-7 (the routed sums in another order across EP sizes)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("change,message", [
    ({"num_experts": 8}, r"layers.0.experts.gate_up_proj holds 6 experts of \(32, 16\) in the "
                         r"checkpoint, the model 8 of \(32, 16\)"),
    ({"hidden_dim": 24}, r"layers.0.experts.gate_up_proj holds 6 experts of \(32, 16\) in the "
                         r"checkpoint, the model 6 of \(48, 16\)"),
])
def test_experts_that_do_not_match_refused(saved, change, message):
    """A checkpoint whose experts differ from the model's (their count, their shape) is one
    line naming both, before anything is loaded."""
    path, _ = saved["tp2-dp2-ep4"]
    config = MoEConfig(**{**CONFIG.__dict__, **change})
    model = MoEStack([ParallelMoE(config) for _ in range(LAYERS)])
    with pytest.raises(CheckpointError, match=message) as e:
        load_checkpoint(path, model)
    assert "\n" not in str(e.value)
