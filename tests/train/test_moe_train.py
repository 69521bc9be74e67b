"""The GPT with MoE blocks in the trainer (``--moe-experts``, ``--ep``): 6 experts, top-2, one
shared expert, a z-loss, at (tp 2, ep 2) with sequence parallelism, recompute and passes of 1,
(dp 2, ep 2) under FSDP2 and (with passes of 1) DDP, (tp 2, dp 2, ep 4), (tp 2, pp 2, ep 2),
(pp 2, dp 2, ep 2) with micro-batches of 1, and under context parallelism (cp 2, ep 2) and
(tp 2, cp 2, ep 4) with sequence parallelism: every step's loss, gradient norm, aux loss and
expert loads equal one rank taking the same passes at ep 1 (at the full sequence); the summary's
EP all-to-alls and statistics all-reduces are the planner's count. One shared run per layout
(``_runs``), read by every assertion. The layer itself is checked against a dense reference (and
that against transformers) in tests/core/test_moe.py.

"The same passes": a pass's router statistics cover its tokens on every dp rank, so the one-rank
reference of a layout with dp ranks taking passes of M sequences runs passes of dp x M, the same
sequences (a step's pass i is rows [i·B/n, (i+1)·B/n) of the batch on every layout)."""

import dataclasses

import pytest

from tensorpar.gpt.model import GPTConfig
from tensorpar.planner.moe_comm import expected_calls
from tensorpar.planner.step import Step
from tensorpar.train.config import TrainConfig
from tensorpar.train.gpt_recipe import GPTRecipe
from tensorpar.train.loop import train_model_rank

MODEL = GPTConfig(n_layer=2, dim=16, n_head=2, n_kv_head=1, hidden_dim=16, moe_experts=6,
                  moe_top_k=2, moe_shared_experts=1, moe_z_coef=0.001)
STEPS, BATCH, SEQ = 2, 4, 16
TOL = 1e-5  # relative; measured at most 1.2e-7 (the gradient norms) over these layouts
LAYOUTS = {  # name: (ranks, flags)
    "tp2-ep2-sp-recompute-passes": (2, {"tp": 2, "ep": 2, "sequence_parallel": True,
                                        "recompute": True, "micro_batch_size": 1}),
    "dp2-ep2-fsdp": (2, {"tp": 1, "dp": 2, "ep": 2, "dp_mode": "fsdp"}),
    "dp2-ep2-ddp-passes": (2, {"tp": 1, "dp": 2, "ep": 2, "dp_mode": "ddp",
                               "micro_batch_size": 1}),
    "tp2-dp2-ep4": (4, {"tp": 2, "dp": 2, "ep": 4}),
    "tp2-pp2-ep2": (4, {"tp": 2, "pp": 2, "ep": 2, "micro_batch_size": 1}),
    "pp2-dp2-ep2-passes": (4, {"tp": 1, "pp": 2, "dp": 2, "ep": 2, "micro_batch_size": 1}),
    "cp2-ep2": (2, {"tp": 1, "cp": 2, "ep": 2}),
    "tp2-cp2-ep4-sp": (4, {"tp": 2, "cp": 2, "ep": 4, "sequence_parallel": True}),
}


def _reference_micro(flags: dict) -> int | None:
    """The one-rank reference's --micro-batch-size: the layout's passes over every dp rank."""
    micro = flags.get("micro_batch_size")
    return None if micro is None else micro * flags.get("dp", 1)


def _config(out, **flags) -> TrainConfig:
    cfg = TrainConfig(steps=STEPS, batch_size=BATCH, seq_len=SEQ, warmup_steps=1, out=str(out),
                      save_every=STEPS, seed=3, **flags)
    cfg.check()
    GPTRecipe(MODEL).check(cfg)
    return cfg


def _train(out, **flags):
    result = train_model_rank(_config(out, **flags), GPTRecipe(MODEL), None)
    return result.get("rows"), result["comm"]


@pytest.fixture(scope="module")
def _runs(ranks, tmp_path_factory):
    """Each layout's rows and measured collectives, and the one-rank reference of each
    micro-batch size, run once for the module."""
    out = tmp_path_factory.mktemp("moe")
    refs = {micro: ranks(1).run(_train, out / f"ref-{micro}", tp=1, micro_batch_size=micro)[0]
            for micro in sorted({_reference_micro(f) for _, f in LAYOUTS.values()}, key=str)}
    runs = {name: ranks(n).run(_train, out / name, **flags)[0]
            for name, (n, flags) in LAYOUTS.items()}
    return refs, runs


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_equals_one_rank(_runs, name):
    """Loss, gradient norm and aux loss within 1e-5 of one rank's at every step; the expert
    loads (fewest and most tokens a step, every rank's tokens) the same."""
    refs, runs = _runs
    flags = LAYOUTS[name][1]
    (rows, _), (want, _) = runs[name], refs[_reference_micro(flags)]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for got, ref in zip(rows, want, strict=True):
        for key in ("loss", "grad_norm", "aux_loss"):
            assert abs(got[key] - ref[key]) <= TOL * abs(ref[key]), (name, got["step"], key,
                                                                      got[key], ref[key])
        assert got["expert_load"] == ref["expert_load"], (name, got["step"])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_collectives_are_the_planners_count(_runs, name):
    """The measured step's EP all-to-alls and statistics all-reduces (rank 0) are the calls
    ``planner/moe_comm.py`` counts for the step."""
    n, flags = LAYOUTS[name]
    _, comm = _runs[1][name]
    cfg = TrainConfig(batch_size=BATCH, seq_len=SEQ, **flags)
    shape = GPTRecipe(MODEL).shape()  # a pipeline rank holds its stage's blocks alone
    shape = dataclasses.replace(shape, n_layer=MODEL.n_layer // cfg.pp)
    want = expected_calls(Step.from_train_config(cfg, shape))
    assert comm["ep"]["counts"]["all_to_all"] == want["all_to_all"], (name, comm["ep"], want)
    assert comm["stats"]["counts"]["all_reduce"] == want["all_reduce"], (name, comm["stats"])


@pytest.mark.slow
def test_metrics_rows_hold_aux_loss_and_loads(_runs):
    """Each row: the aux loss, and per block [fewest, most] tokens of an expert, whose loads
    come from the step's 4 x 16 tokens."""
    (rows, _) = _runs[0][None]
    for row in rows:
        assert row["aux_loss"] > 0
        assert len(row["expert_load"]) == MODEL.n_layer
        for lo, hi in row["expert_load"]:
            assert 0 <= lo <= hi <= BATCH * SEQ


@pytest.mark.parametrize("model,flags,message", [
    ({}, {"tp": 1, "dp": 4, "ep": 3}, "--ep 3 does not divide the 4 ranks of a stage"),
    ({"moe_top_k": 7}, {"tp": 1}, "--moe-top-k 7 must be between 1 and --moe-experts 6"),
    ({"moe_experts": 0}, {"tp": 1, "dp": 2, "ep": 2}, "--ep 2 splits a Mixture of Experts"),
    ({}, {"tp": 2, "dp": 2, "ep": 2 * 4}, "--ep 8 does not divide the 4 ranks"),
    ({}, {"tp": 4, "dp": 2, "ep": 2}, "--ep 2 with --tp 4: an EP group holds whole TP groups"),
    ({"moe_balance": "bias"}, {"tp": 1}, "--moe-balance bias moves the sigmoid router"),
])
def test_bad_flags_are_one_line(model, flags, message):
    """Refused before any rank starts, in one line naming the numbers."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(")) as e:
        cfg = TrainConfig(**flags)
        cfg.check()
        GPTRecipe(GPTConfig(**{**MODEL.__dict__, **model})).check(cfg)
    assert "\n" not in str(e.value)
