"""bf16 under FSDP2 (``data_parallel(..., param_dtype=torch.bfloat16)``, what ``tensorpar train
--dtype bf16`` builds): the layers compute with bf16 gathered weights while the parameters, their
gradients and so the optimizer stay fp32, sharded; on the wire the weights travel in bf16 and the
gradients in fp32, and tensorpar's TP collectives carry the bf16 residual stream (gloo)."""

import math

import torch

from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.mesh.data_parallel import data_parallel
from tensorpar.mesh.mesh import init_parallel
from tensorpar.parallel.ownership import ShardOwnership, clip_grad_norm_
from tensorpar.planner.comm import predicted_comm
from tensorpar.planner.data_parallel import dp_comm
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.runtime.dtensors import is_dtensor
from tensorpar.train.shape import gpt_shape

MODEL = {"vocab_size": 64, "n_layer": 2, "dim": 32, "n_head": 4, "n_kv_head": 2,
         "hidden_dim": 64}
B, T = 2, 16  # sequences per dp rank, tokens


def _bf16_step(tp, dp):
    """One bf16 forward and backward under autocast (the trainer's), and the gradient norm, on
    this rank: what each layer's forward saw of its parameters, what the parameters and their
    gradients are after, the collectives of each group."""
    mesh = init_parallel(tp=tp, dp=dp)
    tp_group, dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
    model = GPT(GPTConfig(**MODEL), tp_group, seed=0)
    ownership = ShardOwnership.gather(model, tp_group)
    data_parallel(model, mesh, "fsdp", param_dtype=torch.bfloat16)
    seen = {}

    def record(name):
        def hook(module, args):
            for p_name, p in module.named_parameters():
                seen[f"{name}.{p_name}"] = (p.dtype, is_dtensor(p))
        return hook

    # the modules inside the FSDP2 units (the root, each block), whose gathering runs before:
    # each records its parameters, its submodules' too (the fused QKV and gate/up ops read the
    # projections' weights without calling them)
    units = {model, *model.blocks}
    for name, module in model.named_modules():
        if module not in units:
            module.register_forward_pre_hook(record(name))
    ids = torch.randint(0, MODEL["vocab_size"], (B * dp, T),
                        generator=torch.Generator().manual_seed(0))
    ids = ids[mesh["dp"].get_local_rank() * B:][:B]
    with CollectiveCounter({"tp": tp_group, "dp": dp_group}) as comm:
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(ids, ids)
        loss.backward()
        norm = clip_grad_norm_(model, ownership, 1.0, tp_group, dp_group)
    params = {name: (p.dtype, is_dtensor(p), p.grad.dtype, is_dtensor(p.grad))
              for name, p in model.named_parameters()}
    return {"seen": seen, "params": params, "norm": norm.item(), "loss": loss.item(),
            "comm": {group: {k: dict(v) for k, v in counted.items()}
                     for group, counted in comm.by_group.items()}}


def test_bf16_fsdp_computes_in_bf16_keeps_fp32(ranks):
    """TP=2 x DP=2: every layer's forward sees its weights gathered whole and in bf16 (plain
    tensors, not the DTensor shards), while every parameter stays an fp32 DTensor shard and so
    does its gradient after backward. The dp group gathers bf16 weights (half fp32's bytes) and
    reduce-scatters fp32 gradients (fp32's bytes), the tp group carries bf16 activations and
    activation gradients: each equal to the planner's count (``bf16_params``); the gradient
    norm is finite."""
    tp, dp = 2, 2
    shape = gpt_shape(GPTConfig(**MODEL))
    for rank, got in enumerate(ranks(tp * dp).run(_bf16_step, tp, dp)):
        assert len(got["seen"]) == len(got["params"]), got["seen"].keys()
        assert set(got["seen"].values()) == {(torch.bfloat16, False)}, (rank, got["seen"])
        assert set(got["params"].values()) == {(torch.float32, True, torch.float32, True)}, \
            (rank, got["params"])
        assert math.isfinite(got["norm"]) and math.isfinite(got["loss"])
        want_dp = dp_comm(shape, tp, dp, "fsdp", rank=rank % tp, report_loss=False,
                          bf16_params=True)
        fp32_dp = dp_comm(shape, tp, dp, "fsdp", rank=rank % tp, report_loss=False)
        assert got["comm"]["dp"]["bytes"] == want_dp["bytes"], rank
        assert 2 * want_dp["bytes"]["all_gather"] == fp32_dp["bytes"]["all_gather"]
        assert want_dp["bytes"]["reduce_scatter"] == fp32_dp["bytes"]["reduce_scatter"]
        want_tp = predicted_comm(shape, B, T, tp, dtype="bf16", bf16_params=True)
        assert {k: got["comm"]["tp"][k] for k in ("counts", "bytes")} == \
            {k: want_tp[k] for k in ("counts", "bytes")}, rank
