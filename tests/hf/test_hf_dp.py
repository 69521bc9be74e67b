"""Hugging Face models under TP x DP: ``parallelize(model, group=mesh["tp"].get_group())``, then
``data_parallel(model, mesh)`` (FSDP2 or DDP over the mesh's "dp" dim), at TP=2 x DP=2.

Each dp rank takes its half of one global batch. The invariant: the mean of the dp ranks' losses
is the dense model's loss on the whole batch, every gradient (FSDP2's DTensor gathered over dp
with ``full_tensor()``) is its TP slice of the dense gradient, and after one AdamW step the next
loss is the dense model's next loss; all in fp32, to ``TOL``.

The head is a plain ``column`` layer and the loss ``vocab_parallel_cross_entropy`` on the local
logits, so no rank ever holds the (B, T, V) logits (the model's own ``labels=`` loss does the
same with the built-in plan's head: ``test_labels_loss.py``).
Families: Llama with GQA (4 heads, 2 KV heads: one KV head per rank), also under DDP;
Llama-MQA (one KV head that both TP ranks hold: its gradients summed over them inside the
forward); Qwen3 (per-head q/k norms, replicated, their partial gradients summed over TP);
Qwen2 with its head tied to the vocab-split embedding (one parameter, in FSDP2's root unit).
The MQA and Qwen3 paths read what they need off the module, never off the parameter, which
FSDP2 swaps in forward for a gathered tensor without the ``tp_shard`` tag.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from hf_split import assert_split, planned_collectives  # noqa: E402

from tensorpar.cli.compare import dense_shard  # noqa: E402
from tensorpar.hf.parallelize import parallelize  # noqa: E402
from tensorpar.hf.plans import LLAMA_PLAN  # noqa: E402
from tensorpar.mesh.data_parallel import data_parallel, inner, is_dp_sharded  # noqa: E402
from tensorpar.mesh.mesh import init_parallel  # noqa: E402
from tensorpar.parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: E402
from tensorpar.runtime.counting import CollectiveCounter  # noqa: E402
from tensorpar.train.optim import adamw  # noqa: E402

from tp_check import assert_close  # noqa: E402

TP, DP = 2, 2
PLAN = LLAMA_PLAN | {"lm_head": "column"}  # vocab-split logits, never gathered
LR = 1e-3
# the largest relative error of each kind, ~10x the largest measured over the cases of
# test_hf_tp2_dp2_matches_dense (2026-11-27, torch 2.13 CPU)
TOL = {"loss": 1e-6,  # measured 1.05e-7 (Qwen3): one fp32 ulp
       "grad": 8e-6,  # measured 8.3e-7 (Qwen3)
       "next loss": 1e-6}  # measured 1.1e-7 (the MQA)


def _load(path):
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(path).train()


def _dense_loss(model, ids):
    logits = model(ids).logits[:, :-1]  # (B, T-1, V)
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _tp_dp_loss(model, ids, tp_group, vocab):
    """This dp rank's loss on its ids, and the mean over the dp ranks (for comparing only)."""
    logits_local = model(ids).logits[:, :-1]  # (B/dp, T-1, V/tp)
    loss = vocab_parallel_cross_entropy(logits_local, ids[:, 1:], tp_group, vocab_size=vocab)
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # every rank of the world: the tp ranks agree, so / world is / dp
    return loss, mean / dist.get_world_size()


def _tp_dp_body(path, mode):
    mesh = init_parallel(tp=TP, dp=DP)
    tp_group, dp_rank = mesh["tp"].get_group(), mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    ids = torch.randint(1, 96, (4, 12))  # the global batch, the same on every rank
    mine = ids.chunk(DP)[dp_rank]  # this dp rank's half
    dense = _load(path)
    tp_model = parallelize(_load(path), PLAN, group=tp_group)
    assert_split(tp_model, dense, tp_group)  # before FSDP2 shards it over dp
    model = data_parallel(tp_model, mesh, mode)
    vocab = dense.config.vocab_size
    sharded = any(is_dp_sharded(p) for p in model.parameters())
    assert sharded == (mode == "fsdp")

    ref = _dense_loss(dense, ids)
    with CollectiveCounter({"tp": tp_group}) as fwd:
        loss, mean = _tp_dp_loss(model, mine, tp_group, vocab)
    assert_close("loss", mean, ref, TOL["loss"])
    ref.backward()
    with CollectiveCounter({"tp": tp_group}) as bwd:
        loss.backward()
    # on the tp group, the split's collectives (the head's logits stay split) and the loss's
    # all-gather of its per-token statistics; FSDP2's and DDP's run on the dp group
    planned_fwd, planned_bwd = planned_collectives(dense, TP, gather=False)
    tp_counts = [dict(c.by_group.get("tp", {}).get("counts", {})) for c in (fwd, bwd)]
    assert tp_counts == [planned_fwd | {"all_gather": 1}, planned_bwd], tp_counts
    dense_params = dict(dense.named_parameters())
    for name, p in inner(model).named_parameters():
        grad = p.grad.full_tensor() if is_dp_sharded(p.grad) else p.grad
        assert_close(f"grad {name}", grad, dense_shard(dense_params[name].grad, p.tp_shard),
                     TOL["grad"])

    # one AdamW step, the optimizer made after wrapping: the same next loss
    for m in (dense, model):
        adamw(m.parameters(), lr=LR).step()
    _, mean = _tp_dp_loss(model, mine, tp_group, vocab)
    with torch.no_grad():
        assert_close("next loss", mean, _dense_loss(dense, ids), TOL["next loss"])
    return len(list(model.parameters()))


@pytest.mark.parametrize("family, mode", [("llama", "fsdp"), ("llama", "ddp"),
                                          ("llama-mqa", "fsdp"), ("qwen3", "fsdp"),
                                          ("qwen2-tied", "fsdp")])
def test_hf_tp2_dp2_matches_dense(ranks, hf_dirs, family, mode):
    """TP=2 x DP=2 on 4 ranks: loss, every gradient and the loss after one AdamW step equal the
    dense model's on the whole batch (module docstring)."""
    ranks(TP * DP).run(_tp_dp_body, str(hf_dirs / family), mode)
