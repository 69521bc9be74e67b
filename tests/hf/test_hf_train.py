"""``tensorpar train --hf``: a Hugging Face model fine-tuned in the GPT's training loop.

On the tiny models of ``hf_runs.py``. The invariants: the loss and gradient norm of every step
at TP=2 and 4, after a resume at another TP size from the run's own copy of the model's files
(the source directory deleted), and at TP=2 x DP=2 (FSDP2) equal TP=1's to fp32 rounding;
dropout masks derive from (seed, step), so a resume at the same TP size repeats a run with
dropout exactly; the export is the source's architecture and names, loaded by transformers with
no missing or unexpected key and the checkpoint's logits; ``--recompute`` and ``--compile``
follow the run; the summary's collective count is exact. The runs go through the rank pools
(``train_model_rank``); the command line and its refusals: ``test_hf_train_cli.py``.
"""

import contextlib
import json
import shutil

import pytest
import torch
from hf_runs import (  # noqa: E402
    STEPS,
    TRAIN,
    VOCAB,
    checkpoint_logits,
    exported_logits,
    train,
)

from tensorpar.checkpoint.format import find_checkpoint  # noqa: E402
from tensorpar.hf.pretrained import from_pretrained  # noqa: E402
from tensorpar.planner.comm import predicted_comm  # noqa: E402

from tests_common import tensorpar_here  # noqa: E402


@pytest.fixture(scope="module")
def runs(ranks, models, tmp_path_factory):
    """``runs(family, tp, sp)``: (run directory, metrics rows, rank 0's result, the recipe) of a
    STEPS-step run, made once."""
    made = {}

    def get(family: str, tp: int, sp: bool = False):
        if (family, tp, sp) not in made:
            out = tmp_path_factory.mktemp(f"{family}-tp{tp}{'-sp' * sp}")
            result, recipe = train(ranks, models[family], out, tp, whole=True, **TRAIN,
                                   sequence_parallel=sp, data=str(models["data"]))
            made[family, tp, sp] = out, result["rows"], result, recipe
        return made[family, tp, sp]

    return get


def _same(rows, ref, tol, what, steps=STEPS):
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(1, steps + 1))
    for a, b in zip(rows, ref, strict=True):
        for key in ("loss", "grad_norm"):
            err = abs(a[key] - b[key]) / abs(b[key])
            assert err <= tol, f"{what}: step {a['step']} {key} {a[key]} vs {b[key]} ({err:.1e})"


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_loss_equal_across_tp(runs, family):
    """10 AdamW steps (fp32): loss and gradient norm of every step at TP=2 and 4 (and for the
    Llama TP=2 with sequence parallelism) equal TP=1's to a relative 3e-6, and the loss falls."""
    ref = runs(family, 1)[1]
    for tp, sp in [(2, False), (4, False)] + [(2, True)] * (family == "llama"):
        # measured 2.7e-7 over the families and TP sizes (the Llama at TP=2)
        _same(runs(family, tp, sp)[1], ref, 3e-6, f"{family} TP={tp}{' + SP' * sp}")
    assert ref[-1]["loss"] < ref[0]["loss"] - 0.3


def _interrupt(src, dst, step: int):
    """The run directory as a kill after step ``step``'s checkpoint leaves it: the newer
    checkpoint gone, metrics.jsonl past it."""
    shutil.copytree(src, dst)
    for ckpt in dst.glob("step-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    return find_checkpoint(dst)


@contextlib.contextmanager
def _gone(path):
    """``path`` moved away for the block: what runs in it cannot read it."""
    away = path.rename(path.with_name(f"{path.name}.away"))
    try:
        yield
    finally:
        away.rename(path)


def test_resume_at_another_tp_from_the_runs_copy(ranks, runs, models, tmp_path):
    """The Llama run at TP=4 (KV heads shared by two ranks each), resumed from step 5 at TP=2 by
    ``--resume`` without ``--hf`` while its source directory is gone (the run's copy in
    RUN/hf, no weights in it): every step equals the uninterrupted run's to a relative 1e-6."""
    whole, rows = runs("llama", 4)[:2]
    assert _interrupt(whole, tmp_path / "resumed", 5).name == "step-00000005"
    assert sorted(p.name for p in (tmp_path / "resumed" / "hf").iterdir()) == \
        ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    with _gone(models["llama"]):
        resumed = train(ranks, None, tmp_path / "resumed", 2, resume=True)
    _same(resumed, rows, 1e-6, "resumed at TP=2")  # measured 8.8e-8


def test_dropout_masks_repeat_on_resume_and_recompute(ranks, runs, models, tmp_path):
    """GPT-2 with dropout 0.1 at TP=2, 4 steps, resumed at TP=2 from step 2, and again with
    ``--recompute``, and with ``--compile`` (aot_eager, which draws eager's masks; the graph
    breaks where the TP regions swap generators): the same losses (the masks of step s derive
    from (seed, s), and a recomputed layer draws those of its first forward, in its TP regions
    and outside); the dropout was on (the losses differ from the same weights' without it)."""
    flags = TRAIN | {"steps": 4, "save_every": 2, "data": str(models["data"])}
    whole = train(ranks, models["gpt2-dropout"], tmp_path / "whole", 2, **flags)
    _interrupt(tmp_path / "whole", tmp_path / "resumed", 2)
    resumed = train(ranks, None, tmp_path / "resumed", 2, resume=True)
    # measured 0 for all three (the same masks and ops); the floor: a few fp32 ulps
    _same(resumed, whole, 1e-6, "resumed with dropout", steps=4)
    recomputed = train(ranks, models["gpt2-dropout"], tmp_path / "recomputed", 2, **flags,
                       recompute=True)
    _same(recomputed, whole, 1e-6, "recomputed with dropout", steps=4)
    compiled = train(ranks, models["gpt2-dropout"], tmp_path / "compiled", 2, **flags,
                     compile=True, compile_backend="aot_eager")
    _same(compiled, whole, 1e-6, "compiled with dropout", steps=4)
    assert abs(runs("gpt2", 2)[1][0]["loss"] - whole[0]["loss"]) > 1e-4


def test_tp2_dp2_fsdp_equals_tp1(ranks, runs, models, tmp_path):
    """TP=2 x DP=2 under FSDP2 (4 ranks, each TP group on half of every batch): every step's
    loss (the mean of the two halves') and gradient norm equal TP=1's to a relative 4e-6."""
    rows = train(ranks, models["llama"], tmp_path, 2, dp=2, dp_mode="fsdp", **TRAIN,
                 data=str(models["data"]))
    _same(rows, runs("llama", 1)[1], 4e-6, "TP=2 x DP=2")  # measured 3.5e-7


def test_accumulated_steps_equal_one_pass(ranks, runs, models, tmp_path):
    """``--micro-batch-size 1`` at TP=2 x DP=2 under FSDP2: each step of 4 sequences as 2 passes
    a dp rank, the gradients reduce-scattered once: every loss and gradient norm equals the
    one-pass TP=1 run's to a relative 3e-6 (the GPT's accumulation at every TP size:
    tests/train/test_accumulation.py)."""
    rows = train(ranks, models["llama"], tmp_path, 2, dp=2, dp_mode="fsdp",
                 **TRAIN | {"micro_batch_size": 1}, data=str(models["data"]))
    _same(rows, runs("llama", 1)[1], 3e-6, "TP=2 x DP=2, 2 passes")


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_export_is_the_source_architecture(runs, models, tmp_path, family):
    """The TP=2 run exported, its source directory gone: the source's class and config, the
    tokenizer copied, the head of GPT-2 tied again; its logits are the checkpoint's to fp32
    rounding."""
    run = runs(family, 2)[0]
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with _gone(models[family]):
        got = exported_logits(run, tmp_path / "hf", ids)
    # measured 0: the same model class on the same weights; the floor: a few fp32 ulps
    torch.testing.assert_close(got, checkpoint_logits(run, ids), rtol=1e-6, atol=1e-6)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == family and config["vocab_size"] == VOCAB
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == \
        (models[family] / "tokenizer.json").read_text()


def test_another_model_or_command_is_refused(runs, models, tmp_path):
    """``--resume --hf`` with a directory whose config.json is not the run's: one line; the
    GPT's generation asked for the run in the library is refused in one line (the command
    runs it: ``test_lora_train.py``)."""
    from tensorpar.gpt.generate import check_request

    run = runs("llama", 2)[0]
    out = tensorpar_here("train", "--resume", "--hf", models["qwen2"], "--out", run)
    assert out.returncode == 2 and "config.json differs from the run's" in out.stderr, out.stderr
    with pytest.raises(ValueError, match="fine-tuned by tensorpar train --hf, not the GPT"):
        check_request(str(run), ["x"], 8, 0.0, 1)


def test_recompute_equals_the_run_and_keeps_less(ranks, runs, models, tmp_path):
    """``--recompute`` (transformers' gradient checkpointing, each decoder layer keeping only
    its input) on the Llama at TP=2: every step's loss and gradient norm equal the run without it
    to 1e-6, the peak memory is lower, and the summary's analytic count (each layer's MLP exit
    all-reduced again in backward) equals what ran."""
    _, rows, result, _ = runs("llama", 2)
    again, recipe = train(ranks, models["llama"], tmp_path, 2, whole=True, **TRAIN,
                          recompute=True, data=str(models["data"]))
    _same(again["rows"], rows, 1e-6, "recomputed")  # measured 0; the floor: a few fp32 ulps
    peak = [r["sizes"][0]["peak_memory"] for r in (result, again)]
    assert peak[1] < 0.9 * peak[0], peak
    predicted = predicted_comm(recipe.shape(), TRAIN["batch_size"], TRAIN["seq_len"], 2,
                               recompute="full")
    assert again["comm"]["counts"] == dict(predicted["counts"])
    assert again["comm"]["bytes"] == dict(predicted["bytes"])


def _compiled_graphs(path, sp):
    """(graphs, breaks, reasons) of dynamo's trace of the converted Llama's forward and loss."""
    import torch._dynamo as dynamo

    from tensorpar.hf.plans import LLAMA_PLAN
    from tensorpar.parallel.cross_entropy import vocab_parallel_cross_entropy

    model = from_pretrained(path, None, plan=LLAMA_PLAN | {"lm_head": "column"},
                            sequence_parallel=sp).train()  # the head as train --hf splits it
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss(ids):
        logits = model(input_ids=ids, use_cache=False).logits
        return vocab_parallel_cross_entropy(logits, ids, vocab_size=VOCAB)

    try:
        ex = dynamo.explain(loss)(ids)
        return ex.graph_count, ex.graph_break_count, [str(b.reason)[:200] for b in
                                                      ex.break_reasons]
    finally:
        dynamo.reset()


@pytest.mark.parametrize("sp,recompute", [(False, False), (True, True)])
def test_compile_is_one_graph_and_equals_eager(ranks, runs, models, tmp_path, sp, recompute):
    """``--compile`` (aot_eager) on the Llama at TP=2: dynamo traces the converted model in one
    graph, no break (its blocks' hooks and fused ops, the collectives), with and without SP;
    and with SP and ``--recompute`` (transformers' checkpointing, no context_fn for a model
    without dropout) each of 4 steps of the compiled run equals the eager run's to a relative
    3e-6.
    (Compiled training without SP: the GPT's, tests/train/test_compile_train.py.)"""
    for graphs, breaks, reasons in ranks(2).run(_compiled_graphs, str(models["llama"]), sp):
        assert (graphs, breaks) == (1, 0), reasons
    if not sp:
        return
    # the first 4 steps of the eager run (the same learning rates: its 10 steps' schedule)
    rows = train(ranks, models["llama"], tmp_path, 2, **TRAIN | {"steps": 4},
                 lr_decay_steps=STEPS, sequence_parallel=sp, compile=True,
                 compile_backend="aot_eager", recompute=recompute, data=str(models["data"]))
    # measured 3.3e-7 (without SP)
    _same(rows, runs("llama", 2, sp)[1][:4], 3e-6, "compiled", steps=4)


@pytest.mark.parametrize("sp", [False, True])
def test_summary_counts_the_collectives_exactly(runs, sp):
    """The summary's analytic count for a converted Llama at TP=2 equals what the run measured,
    kind by kind, calls and bytes; under SP too (its embedding all-reduced, hf/sequence.py)."""
    _, _, result, recipe = runs("llama", 2, sp)
    predicted = predicted_comm(recipe.shape(), TRAIN["batch_size"], TRAIN["seq_len"], 2, sp)
    assert result["comm"]["counts"] == dict(predicted["counts"])
    assert result["comm"]["bytes"] == dict(predicted["bytes"])
