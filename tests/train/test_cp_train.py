"""Context parallelism in the trainer (``train --cp N``): the GPT with each sequence split over
the CP ranks trains as one rank at the full sequence, at every (tp, cp, dp, pp) layout, with
sequence parallelism and recompute; the summary counts the K/V collectives against the analytic
count; the dropout streams differ by CP rank and a recomputed forward replays them; bad sizes
are one line before any rank."""

import io
import re

import pytest

from tensorpar.gpt.model import GPTConfig
from tensorpar.parallel.dropout import TensorParallelRNG
from tensorpar.runtime.seeds import derive_seed
from tensorpar.train.config import TrainConfig
from tensorpar.train.loop import train_rank

from tests_common import tensorpar_here

MODEL = {"n_layer": 2, "dim": 32, "n_head": 4, "n_kv_head": 2, "hidden_dim": 64}
STEPS = 5
# 30 tokens: uneven chunks at every CP size (cp 2: 8, 8, 7, 7; cp 4: 4, 4, 4, 4, 4, 4, 3, 3)
FLAGS = {"steps": STEPS, "batch_size": 4, "seq_len": 30, "warmup_steps": 1, "seed": 3,
         "save_every": STEPS}


def _train(out, model=None, **flags):
    cfg = TrainConfig(out=str(out), **(FLAGS | flags))
    result = train_rank(cfg, GPTConfig(**(MODEL | (model or {}))), None)
    return {"rows": result.get("rows"), "comm": result["comm"], "sizes": result["sizes"]}


@pytest.fixture(scope="module")
def runs(ranks, tmp_path_factory):
    """``runs(tp=1, cp=1, dp=1, pp=1, model=None, **flags)``: rank 0's result, made once."""
    made = {}
    # held-out text, scored after the last step (a pipeline has no validation yet)
    val = tmp_path_factory.mktemp("val") / "held-out.txt"
    val.write_text("Context parallelism splits the sequence itself over ranks. " * 8)

    def get(tp=1, cp=1, dp=1, pp=1, model=None, **flags):
        key = (tp, cp, dp, pp, tuple(sorted((model or {}).items())),
               tuple(sorted(flags.items())))
        if pp == 1:
            flags = flags | {"val_data": str(val), "eval_batches": 2}
        if key not in made:
            out = tmp_path_factory.mktemp(f"tp{tp}-cp{cp}-dp{dp}-pp{pp}")
            made[key] = ranks(tp * cp * dp * pp).run(
                _train, out, model, tp=tp, cp=cp, pp=pp, dp=dp if dp > 1 else None,
                **flags)[0]
        return made[key]

    return get


def _same(rows, ref, what, tol=1e-5):
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for a, b in zip(rows, ref, strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            if key == "val_loss" and a.get(key) is None:  # a pipeline's run: none
                continue
            err = abs(a[key] - b[key]) / abs(b[key])
            assert err <= tol, f"{what}: step {a['step']} {key} {a[key]} vs {b[key]} ({err:.1e})"


LAYOUTS = {  # id: (tp, cp, dp, pp, flags)
    "cp2": (1, 2, 1, 1, {}),
    "tp2-cp2": (2, 2, 1, 1, {}),
    "cp2-dp2": (1, 2, 2, 1, {}),
    "cp4": (1, 4, 1, 1, {}),
    "tp2-cp2-sp": (2, 2, 1, 1, {"sequence_parallel": True}),
    "cp2-pp2": (1, 2, 1, 2, {"micro_batch_size": 1}),  # 4 micro-batches, 1F1B
    "cp2-recompute": (1, 2, 1, 1, {"recompute": True}),
    "tp2-cp2-ddp": (2, 2, 1, 1, {"dp_mode": "ddp"}),  # DDP over the (dp, cp) ranks
}
# trainer runs are the full suite's (about 2 s each once the pools run); the fast tier keeps
# the layer's own tests (tests/core/test_context_parallel.py) and this file's refusals
FAST = ()


@pytest.mark.parametrize("layout", [
    pytest.param(k, marks=() if k in FAST else pytest.mark.slow) for k in LAYOUTS])
def test_cp_trains_as_one_rank(runs, layout):
    """Losses and gradient norms of 5 steps, and the validation loss after the last, equal one
    rank's at the full sequence (1e-5 relative): the loss is normalized by the step's tokens
    over dp x cp, the gradients are averaged over the flattened (dp, cp) mesh and the norm
    counts each gradient once."""
    tp, cp, dp, pp, flags = LAYOUTS[layout]
    _same(runs(tp, cp, dp, pp, **flags)["rows"], runs()["rows"], layout)


def _summary_text(result, **flags) -> str:
    from rich.console import Console

    from tensorpar.train.report import summary
    from tensorpar.train.shape import gpt_shape

    cfg = TrainConfig(**(FLAGS | flags))
    console = Console(file=io.StringIO(), width=300)
    console.print(summary(result["rows"], result["sizes"], result["comm"], cfg,
                          gpt_shape(GPTConfig(**MODEL))))
    return console.file.getvalue()


@pytest.mark.parametrize("layout", [
    pytest.param(k, marks=() if k in FAST else pytest.mark.slow)
    for k in ("cp2", "tp2-cp2", "cp2-dp2", "tp2-cp2-sp", "cp2-pp2", "cp2-recompute")])
def test_summary_counts_cp_collectives(runs, layout):
    """Rank 0's measured step: per block and pass one K/V all-gather forward (one more
    recomputed) and one reduce-scatter backward on the CP group, the TP collectives at the CP
    rank's tokens and the dp x cp ones (FSDP2's, the loss's and the norm's reductions, a
    pipeline's transfers) all equal the summary's analytic count; each rank's peak memory is
    within 10% of the summary's plan of a CP rank."""
    tp, cp, dp, pp, flags = LAYOUTS[layout]
    result = runs(tp, cp, dp, pp, **flags)
    # rank 0's blocks (a pipeline's first stage: half of them) times the step's passes
    blocks = MODEL["n_layer"] // pp * FLAGS["batch_size"] // flags.get("micro_batch_size",
                                                                     FLAGS["batch_size"])
    gathers = blocks * (2 if flags.get("recompute") else 1)
    assert result["comm"]["cp"]["counts"] == {"all_gather": gathers,
                                              "reduce_scatter": blocks}, result["comm"]
    text = _summary_text(result, tp=tp, cp=cp, pp=pp, dp=dp if dp > 1 else None, **flags)
    rows = [line for line in text.splitlines() if " per step " in line and " calls, " in line]
    assert any(line.lstrip("│ ").startswith("cp all_gather") for line in rows), text
    assert any(line.lstrip("│ ").startswith("dp ") for line in rows), text
    assert all("= the analytic count" in line for line in rows), text
    assert f"CP={cp}" in text, text
    # each rank's peak beside its plan as a CP rank (its tokens, the gathered K/V), within the
    # planner's 10% on CPU (measured 3.1-7.5% under, torch 2.13 CPU, on these 30-token rows)
    off = [float(x) for x in re.findall(r"\(planned [^)]*?([+-]\d+\.\d)%\)", text)]
    assert off and max(map(abs, off)) <= 10.0, (layout, off)


def test_dropout_streams_differ_by_cp_rank():
    """The CP rank is one more coordinate of both dropout streams (no two CP ranks share a
    mask); without CP the streams are what they were."""
    plain, *by_cp = [TensorParallelRNG(5, None, 1, c) for c in (None, 0, 1)]
    for rng in (plain, *by_cp):
        rng.set_step(7)
    assert plain.seeds["replicated"] == derive_seed(5, "dropout-replicated", 7, 1)
    assert plain.seeds["sharded"] == derive_seed(5, "dropout-sharded", 7, 1, 0)
    seeds = {(r, rng.seeds[r]) for rng in (plain, *by_cp) for r in rng.seeds}
    assert len(seeds) == 6
    masks = [rng.mask((64,), 0.5, "replicated") for rng in by_cp]
    assert not bool((masks[0] == masks[1]).all())


@pytest.mark.slow
def test_recompute_replays_the_cp_ranks_masks(runs):
    """With dropout at cp 2, a recomputed block draws the masks of its first forward: the run
    with --recompute equals the one without (to rounding)."""
    drop = {"dropout": 0.2}
    plain = runs(cp=2, model=drop)["rows"]
    _same(runs(cp=2, model=drop, recompute=True)["rows"], plain, "cp2 dropout recompute")


@pytest.mark.parametrize("argv,said", [
    (["--cp", "4", "--seq-len", "7"], "--cp: a sequence of 7 tokens cannot be cut into 8 chunks "
     "for 4 CP ranks (each rank holds 2 chunks; need seq_len >= 8, or cp <= 3)"),
    (["--cp", "2", "--tp", "4", "--seq-len", "6", "--sequence-parallel"],
     "--sequence-parallel splits each CP rank's tokens over --tp 4, but --seq-len 6 over --cp 2 "
     "leaves a rank 3"),
    (["--cp", "0"], "--cp 0 must be >= 1"),
    (["--cp", "2", "--compile"], "--cp with --compile is not supported yet"),
])
def test_bad_cp_is_one_line(tmp_path, argv, said):
    r = tensorpar_here("train", "--out", tmp_path / "run", "--steps", "1", *argv)
    assert r.returncode == 2 and r.stderr.startswith(f"tensorpar train: {said}"), r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr


def test_cp_that_does_not_divide_the_world_is_refused(monkeypatch):
    """Under torchrun: --cp that does not divide the world, one line before any collective."""
    from tensorpar.mesh.mesh import init_parallel

    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match=r"^--cp 4 does not divide the world size 6$"):
        init_parallel(tp=1, cp=4)
    monkeypatch.setenv("WORLD_SIZE", "12")  # 4 and 6 each divide 12, together not
    with pytest.raises(ValueError, match=r"^--pp 4 x --cp 6 = 24 does not divide the world "
                                         r"size 12$"):
        init_parallel(tp=1, pp=4, cp=6)


def test_cp_of_a_model_that_does_not_split_is_refused(tmp_path):
    """A recipe without ``context_parallel`` (a Hugging Face model's, for now): one line."""
    from tensorpar.train.resume import check_before_ranks

    class Other:
        kind = "hf"

    with pytest.raises(ValueError, match=r"^--cp 2: context parallelism trains tensorpar's GPT; "
                                         r"this model \(hf\) does not split"):
        check_before_ranks(TrainConfig(cp=2, out=str(tmp_path / "run")), Other(), None)
