"""GPT-2's fused q|k|v (``c_attn``, ``ShardSpec.parts`` = 3: each rank holds its heads' rows of
the q, the k and the v block) counted and stored whole: the global gradient norm equals the dense
model's, and a checkpoint saved at TP=2 loads at TP=1 and 3 with every q, k and v row in place."""

import json

import accelerate  # noqa: F401  (a dev dependency: missing, this file fails, not skips)
import pytest
import torch
import transformers
from safetensors.torch import load_file

from tensorpar.checkpoint.export import export_dense  # noqa: E402
from tensorpar.checkpoint.format import find_checkpoint  # noqa: E402
from tensorpar.checkpoint.load import load_checkpoint  # noqa: E402
from tensorpar.checkpoint.save import save_checkpoint  # noqa: E402
from tensorpar.cli.compare import dense_shard  # noqa: E402
from tensorpar.hf.parallelize import parallelize  # noqa: E402
from tensorpar.hf.plans import is_conv1d  # noqa: E402
from tensorpar.parallel.ownership import ShardOwnership, clip_grad_norm_  # noqa: E402

from tp_check import assert_close  # noqa: E402

QKV = "transformer.h.0.attn.c_attn"
# the largest relative error of each kind, ~10x the largest measured (2026-11-27, torch 2.13 CPU)
TOL = {"norm": 6e-7,  # the global gradient norm: measured 6.0e-8 (TP=2)
       "clipped grad": 7e-6,  # measured 6.7e-7 (TP=2)
       "exp_avg": 5e-6,  # AdamW's moments resharded to TP=1 and 3: measured 5.3e-7
       "exp_avg_sq": 1e-5}  # measured 1.2e-6


def _dense(path):
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _linear_layout(dense, name, t):
    """A dense tensor of ``name`` as tensorpar holds it: Conv1D weights (in, out) transposed."""
    if name.endswith(".weight") and is_conv1d(dense.get_submodule(name.rpartition(".")[0])):
        return t.t()
    return t


def _backward(model):
    ids = torch.randint(1, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()


def _grad_norm_body(path):
    torch.manual_seed(0)
    dense, model = _dense(path), parallelize(_dense(path))
    _backward(dense)
    _backward(model)
    ownership = ShardOwnership.gather(model)
    ref = torch.cat([p.grad.flatten() for p in dense.parameters()]).double().norm().item()
    norm = clip_grad_norm_(model, ownership, max_norm=0.0).item()  # 0: measure only
    # clipped to half: every shard scaled as the dense gradients are by torch's own clipping
    clip_grad_norm_(model, ownership, max_norm=ref / 2)
    torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm=ref / 2)
    grads = {name: p.grad for name, p in dense.named_parameters()}
    for name, p in model.named_parameters():
        assert_close(f"clipped grad {name}", p.grad,
                     dense_shard(_linear_layout(dense, name, grads[name]), p.tp_shard),
                     TOL["clipped grad"])
    return norm, ref


@pytest.mark.parametrize("n", [2, 3])
def test_gpt2_global_grad_norm(ranks, hf_dirs, n):
    """The global gradient norm (each rank summing the squares it owns: its rows of all three
    q|k|v blocks) equals the dense model's (``TOL``), the same on every rank, and clipping scales
    every shard as torch's clip_grad_norm_ scales the dense gradients. TP=3: heads 2, 1, 1."""
    results = ranks(n).run(_grad_norm_body, str(hf_dirs / "gpt2"))
    norm, ref = results[0]
    assert all(r[0] == norm for r in results), results
    assert abs(norm - ref) <= TOL["norm"] * ref, (norm, ref)


def _adam(model):
    # lr 0: the moments of one step, the weights unchanged (so they compare exactly)
    return torch.optim.AdamW(model.parameters(), lr=0.0)


def _save_body(path, out):
    torch.manual_seed(0)
    model = parallelize(_dense(path))
    opt = _adam(model)
    _backward(model)
    opt.step()
    save_checkpoint(out, 1, model, ShardOwnership.gather(model), opt, meta={"config": {}})


def _load_body(path, out):
    """Load into a model of other weights; compare with the dense model after the same step."""
    dense = _dense(path)
    opt = _adam(dense)
    _backward(dense)
    opt.step()
    torch.manual_seed(1)  # other weights, the same on every rank
    model = parallelize(transformers.AutoModelForCausalLM.from_config(dense.config))
    tp_opt = _adam(model)
    load_checkpoint(out, model, tp_opt)
    dense_params = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        ref = dense_params[name]
        assert torch.equal(p, dense_shard(_linear_layout(dense, name, ref), p.tp_shard)), name
        for s in ("exp_avg", "exp_avg_sq"):
            assert_close(f"{s} {name}", tp_opt.state[p][s],
                         dense_shard(_linear_layout(dense, name, opt.state[ref][s]), p.tp_shard),
                         TOL[s])
    return sum(p.numel() for p in model.parameters())


def test_gpt2_checkpoint_reshards(ranks, hf_dirs, tmp_path):
    """Saved at TP=2 from a parallelized HF GPT-2 (weights and AdamW moments), loaded at TP=1
    and TP=3 (heads 2, 1, 1): every weight equals its dense slice exactly, q, k and v rows
    included, and the moments match the dense model's. The files hold each dense element once,
    and the dense export is the dense model (Conv1D weights as (out, in))."""
    path, out = str(hf_dirs / "gpt2"), str(tmp_path)
    ranks(2).run(_save_body, path, out)
    for n in (1, 3):
        ranks(n).run(_load_body, path, out)
    dense = _dense(path)
    ckpt = find_checkpoint(tmp_path)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    # rank 0 stores rows [0, 32) of each 64-row block of q|k|v, rank 1 rows [32, 64)
    assert manifest["version"] == 2
    assert [(q["rank"], q["start"], q["stop"], q.get("offset", 0))
            for q in manifest["tensors"][f"{QKV}.weight"]["pieces"]] == \
        [(0, 0, 32, 0), (0, 64, 96, 32), (0, 128, 160, 64),
         (1, 32, 64, 0), (1, 96, 128, 32), (1, 160, 192, 64)]
    stored = {"weights": 0, "optimizer": 0}
    for f in ckpt.glob("rank*.safetensors"):
        for key, t in load_file(f).items():
            stored["optimizer" if key.startswith("optimizer.") else "weights"] += t.numel()
    numel = sum(p.numel() for p in dense.parameters())
    assert stored == {"weights": numel, "optimizer": 2 * numel}, (stored, numel)
    exported = load_file(export_dense(tmp_path, tmp_path / "dense.safetensors"))
    for name, p in dense.named_parameters():
        assert torch.equal(exported[name], _linear_layout(dense, name, p.detach())), name
