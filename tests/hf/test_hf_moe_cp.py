"""Hugging Face MoE models under context parallelism: the Qwen3-MoE of ``test_hf_moe.py`` (a dense
layer among the MoE ones, 6 experts, top-2, its router logits asked for by the config) split
over CP ranks, each routing its own chunks.

In the library (``hf/context.py``, two ranks): the router logits of each rank's chunks, summed
into the load-balancing loss over the CP group (``hf/moe.py``'s ``balancing_loss``), are the
dense model's aux loss on the whole rows, and with each rank's cross-entropy share every
gradient summed over CP is the dense model's; ``labels=`` with router logits is refused in one
line. In the trainer (``train --hf --cp``, the pool's ranks in process): the balancing loss's
statistics summed over dp x cp, the experts' gradients over the CP ranks too, so each step's
loss (the aux loss in it) and gradient norm equal one rank's at the full sequence.
"""

import pytest
import torch
import torch.distributed as dist
import transformers
from test_hf_moe import TRAIN, moe_configs

from tensorpar.cli.compare import dense_shard, max_rel_error
from tensorpar.data.text import default_corpus
from tensorpar.hf.moe import balancing_loss
from tensorpar.hf.pretrained import from_pretrained
from tensorpar.parallel.context import split_to_cp

from tests_common import char_tokenizer

# the largest relative error of the library case's logits, aux loss and gradients, ~10x the
# largest measured (torch 2.13 CPU)
TOL = 6e-6  # measured 6.3e-7 (a gradient; the logits 3.1e-7, the aux loss 0)
STEP_TOL = 1e-5  # each step's loss and gradient norm against one rank (measured 1.0e-7)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """The tiny Qwen3-MoE of ``test_hf_moe.py``, saved with its tokenizer, and ``data.txt``
    beside it: the runs' training text (8,000 characters, as ``test_hf_moe.py``'s runs)."""
    transformers.logging.set_verbosity_error()
    path = tmp_path_factory.mktemp("hf-moe-cp") / "qwen3_moe"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(moe_configs()["qwen3_moe"]).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    (path.parent / "data.txt").write_text(default_corpus()[:8_000])
    return path


def _library_body(path) -> dict:
    """cp 2 on rows of 15 tokens (chunks 4, 4, 4, 3): the largest error of this rank's logits,
    the balancing loss and every gradient summed over CP against the dense model; what
    ``labels=`` with router logits says."""
    transformers.logging.set_verbosity_error()
    cp_group = dist.new_group([0, 1])
    tp_group = dist.new_subgroups(group_size=1)[0]  # each rank alone
    ids = torch.randint(1, 96, (2, 15), generator=torch.Generator().manual_seed(2))
    dense = transformers.AutoModelForCausalLM.from_pretrained(path)
    model = from_pretrained(path, tp_group, cp_group=cp_group)
    ref = dense(input_ids=ids, labels=ids, use_cache=False)  # cross-entropy + coef x aux loss
    ref.loss.backward()
    out = model(input_ids=ids)  # this rank's chunks, its router logits
    shifted = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
    mine = split_to_cp(shifted, cp_group)
    ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), mine.flatten(),
                                           reduction="sum") / (shifted != -100).sum()
    config = model.config
    aux = balancing_loss(out.router_logits, config.num_experts, config.num_experts_per_tok,
                         cp_group)
    (ce + config.router_aux_loss_coef * aux).backward()
    dense_grads = dict(dense.named_parameters())
    grad = 0.0
    for name, p in model.named_parameters():
        summed = p.grad.clone()
        dist.all_reduce(summed, group=cp_group)
        grad = max(grad, max_rel_error(summed, dense_shard(dense_grads[name].grad, p.tp_shard)))
    try:
        model(input_ids=ids, labels=ids)
        said = None
    except ValueError as e:
        said = str(e)
    return {"errors": {"logits": max_rel_error(out.logits, split_to_cp(ref.logits, cp_group)),
                       "aux": max_rel_error(aux, ref.aux_loss), "grad": grad},
            "aux_loss": out.aux_loss, "said": said}


@pytest.mark.slow
def test_router_statistics_summed_over_cp_equal_the_dense_model(ranks, qwen3_moe):
    """Each CP rank's logits are the dense logits of its chunks; the balancing loss from its
    router logits, statistics summed over CP, is the dense aux loss (measured 0: the same
    sums); the cross-entropy share plus that loss gives every gradient, summed over CP, as the
    dense model's (measured 6.3e-7); the model's own aux loss (one rank's chunks) is left out;
    ``labels=`` with router logits is refused in one line on both ranks."""
    results = ranks(2).run(_library_body, qwen3_moe)
    for rank, r in enumerate(results):
        for kind, err in r["errors"].items():
            assert err <= TOL, f"rank {rank}: {kind} off by {err:.2e}"
        assert r["aux_loss"] is None
        assert r["said"] == results[0]["said"] and "\n" not in r["said"]
        assert "output_router_logits" in r["said"] and "balancing_loss" in r["said"]


# train --hf --cp against one rank: (tp, cp, ep, dp); ep 1: the experts cut across each TP group
LAYOUTS = [(1, 2, 1, 1), (2, 2, 1, 1), (1, 2, 2, 1), (1, 2, 4, 2)]
LAYOUT_IDS = ["tp{}-cp{}-ep{}-dp{}".format(*layout).removesuffix("-dp1") for layout in LAYOUTS]


@pytest.fixture(scope="module")
def trained(ranks, qwen3_moe, tmp_path_factory):
    """The metrics rows of one rank's run and of each layout's: {name: rows}."""
    from hf_runs import train

    root = tmp_path_factory.mktemp("hf-moe-cp-train")
    flags = TRAIN | {"data": str(qwen3_moe.parent / "data.txt")}
    runs = {"one": train(ranks, qwen3_moe, root / "one", 1, **flags)}
    for name, (tp, cp, ep, dp) in zip(LAYOUT_IDS, LAYOUTS, strict=True):
        runs[name] = train(ranks, qwen3_moe, root / name, tp, dp, cp=cp, ep=ep, **flags)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_train_hf_moe_at_cp_equals_one_rank(trained, layout):
    """``train --hf <qwen3-moe> --cp 2`` at tp 1 and 2, with the experts cut across the two
    CP ranks (--ep 2), and at --dp 2 with them cut across the CP and data ranks (--ep 4):
    each step's loss (its balancing loss over every token of the step's pass) and gradient
    norm equal one rank's at the full sequence (1e-5 relative; measured 1.0e-7, an fp32 ulp;
    with each CP rank balancing its own chunks the cp 2 loss moves by 8e-4 and the gradient
    norm by 1.8%)."""
    one, other = trained["one"], trained[layout]
    assert len(one) == len(other) == TRAIN["steps"]
    for a, b in zip(one, other, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= STEP_TOL * abs(a[key]), (a["step"], key, a[key], b[key])
