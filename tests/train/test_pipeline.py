"""Pipeline parallelism (``--pp``, ``--pp-virtual``): the GPT's stages under
torch.distributed.pipelining train exactly as the same run without a pipeline, at every
(tp, pp, dp) and schedule; a pipelined run's checkpoint resumes at another TP and pipeline size;
the flags it cannot take are one line before any rank."""

import pytest

from tensorpar.gpt.model import GPTConfig
from tensorpar.gpt.stages import describe_split
from tensorpar.parallel.stages import rank_stages, stage_blocks
from tensorpar.planner.pipeline import p2p
from tensorpar.train.config import TrainConfig
from tensorpar.train.loop import train_rank

MODEL = {"n_layer": 4, "dim": 32, "n_head": 4, "n_kv_head": 2, "hidden_dim": 64,
         "tie_embeddings": False}
STEPS = 3
# 8 sequences in micro-batches of 2: 4 micro-batches (2 per dp rank at dp 2)
FLAGS = {"steps": STEPS, "batch_size": 8, "micro_batch_size": 2, "seq_len": 16,
         "warmup_steps": 1, "seed": 3, "save_every": STEPS}


def _train(out, resume_from=None, model=None, **flags):
    cfg = TrainConfig(out=str(out), **(FLAGS | flags))
    result = train_rank(cfg, GPTConfig(**(MODEL | (model or {}))), resume_from)
    return {"rows": result.get("rows"), "comm": result["comm"], "sizes": result["sizes"]}


@pytest.fixture(scope="module")
def runs(ranks, tmp_path_factory):
    """``runs(tp, pp=1, dp=1, **flags)``: the metrics rows of that run, made once;
    ``runs.folder(...)``: its run directory."""
    made = {}

    def made_once(tp, pp=1, dp=1, model=None, **flags):
        key = (tp, pp, dp, tuple(sorted((model or {}).items())), tuple(sorted(flags.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"pp{pp}-tp{tp}-dp{dp}")
            made[key] = out, ranks(tp * pp * dp).run(_train, out, None, model, tp=tp, pp=pp,
                                                     dp=dp if dp > 1 else None,
                                                     **flags)[0]["rows"]
        return made[key]

    def get(*args, **kwargs):
        return made_once(*args, **kwargs)[1]

    get.folder = lambda *args, **kwargs: made_once(*args, **kwargs)[0]
    return get


def _same(rows, ref, what, tol=1e-5, steps=STEPS):
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(1, steps + 1))
    for a, b in zip(rows, ref, strict=True):
        for key in ("loss", "grad_norm"):
            err = abs(a[key] - b[key]) / abs(b[key])
            assert err <= tol, f"{what}: step {a['step']} {key} {a[key]} vs {b[key]} ({err:.1e})"


def test_stages_cut_the_blocks_as_tensor_split():
    """5 blocks over 2 stages: 3 and 2; interleaved, stage s on rank s % pp; the summary's line."""
    assert stage_blocks(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_blocks(8, 4) == [range(2 * i, 2 * i + 2) for i in range(4)]
    assert rank_stages(2, 2, 1) == [1, 3]
    assert describe_split(5, 2) == "blocks 0-2 | 3-4 (5 over 2 stages)"
    # 1F1B at pp 4, 8 micro-batches: each boundary one activation and one gradient each
    sends = [p2p(4, 1, 8, r, 1, 16, 32, 1, False) for r in range(4)]
    assert [s["activations"] + s["gradients"] for s in sends] == [8, 16, 16, 8]


@pytest.mark.parametrize("tp,pp,dp,flags", [
    (1, 2, 1, {}), (2, 2, 1, {}), (1, 2, 1, {"pp_virtual": 2}),
    pytest.param(1, 4, 1, {}, marks=pytest.mark.slow),
    pytest.param(2, 2, 2, {"dp_mode": "fsdp"}, marks=pytest.mark.slow),
    pytest.param(1, 2, 2, {"dp_mode": "ddp"}, marks=pytest.mark.slow),
    pytest.param(2, 2, 2, {"dp_mode": "ddp"}, marks=pytest.mark.slow),
], ids=["tp1-pp2", "tp2-pp2", "tp1-pp2-v2", "tp1-pp4", "tp2-pp2-dp2-fsdp", "tp1-pp2-dp2-ddp",
        "tp2-pp2-dp2-ddp"])
def test_pipeline_trains_as_tp1(runs, tp, pp, dp, flags):
    """Losses and gradient norms of 3 steps equal TP=1's without a pipeline (1e-5 relative;
    the same micro-batches: the pipeline's are accumulation's)."""
    _same(runs(tp, pp, dp, **flags), runs(1), f"tp{tp} pp{pp} dp{dp} {flags}")


TIED = {"tie_embeddings": True}  # the default GPT: its head is its embedding table
# 6 steps, a checkpoint at step 3 too (test_tied_resume_at_another_tp_and_pipeline_size resumes
# it)
SIX = {"steps": 6, "save_every": 3}


@pytest.mark.parametrize("tp,pp,dp,flags", [
    (1, 2, 1, {}),
    pytest.param(2, 2, 1, {}, marks=pytest.mark.slow),
    pytest.param(1, 4, 1, {}, marks=pytest.mark.slow),
    pytest.param(1, 2, 1, {"pp_virtual": 2}, marks=pytest.mark.slow),
    pytest.param(2, 2, 2, {"dp_mode": "fsdp"}, marks=pytest.mark.slow),
    pytest.param(1, 2, 2, {"dp_mode": "ddp"}, marks=pytest.mark.slow),
], ids=["tp1-pp2", "tp2-pp2", "tp1-pp4", "tp1-pp2-v2", "tp2-pp2-dp2-fsdp", "tp1-pp2-dp2-ddp"])
def test_tied_pipeline_trains_as_one_rank(runs, tp, pp, dp, flags):
    """The default GPT, its head tied to its embedding, under a pipeline: the first and the last
    stage each hold the table, their gradients summed over the two once a step (the table
    counted once in the gradient norm). 6 steps of 4 micro-batches: losses and gradient norms
    equal one rank's without a pipeline (1e-5 relative), so the copies stay equal."""
    _same(runs(tp, pp, dp, model=TIED, **SIX, **flags), runs(1, model=TIED, **SIX),
          f"tied tp{tp} pp{pp} dp{dp} {flags}", steps=6)


def test_point_to_point_transfers_are_counted(ranks, tmp_path):
    """The measured step's sends and receives on pipeline rank 0 are the analytic count: at
    (tp 2, pp 2) with sequence parallelism, 4 micro-batches of 2 x 8 of the 16 tokens x 32
    fp32: 4 activations out and 4 gradients in, 2 KiB each."""
    comm = ranks(4).run(_train, tmp_path, None, None, tp=2, pp=2, sequence_parallel=True,
                        steps=2)[0]["comm"]["pp"]
    assert comm["counts"] == {"send": 4, "recv": 4, "all_reduce": 2}, comm
    assert comm["bytes"]["send"] == comm["bytes"]["recv"] == 4 * 2 * 8 * 32 * 4, comm


@pytest.mark.slow
def test_tied_table_sum_is_counted(ranks, tmp_path):
    """A tied run's pipeline traffic on rank 0 (the first stage, TP rank 0) is the summary's
    analytic count (``planner.expected.plan_run``): at (tp 2, pp 2) with sequence parallelism the
    sends and receives of the untied run, and one more all-reduce, over the embedding group, of
    its (256 / 2, 32) fp32 shard of the table's gradient. The summary finds every collective
    of the step, TP and pipeline, equal to the analytic count."""
    import io

    from rich.console import Console

    from tensorpar.planner.expected import plan_run
    from tensorpar.planner.step import Step
    from tensorpar.train.report import summary
    from tensorpar.train.shape import gpt_shape

    flags = {"tp": 2, "pp": 2, "sequence_parallel": True, "steps": 2}
    got = ranks(4).run(_train, tmp_path, None, TIED, **flags)[0]
    comm = got["comm"]["pp"]
    assert comm["counts"] == {"send": 4, "recv": 4, "all_reduce": 3}, comm
    assert comm["bytes"]["all_reduce"] == 8 + 128 * 32 * 4, comm
    cfg = TrainConfig(out=str(tmp_path), **(FLAGS | flags))
    shape = gpt_shape(GPTConfig(**(MODEL | TIED)))
    assert {k: comm[k] for k in ("counts", "bytes")} == \
        plan_run(Step.from_train_config(cfg, shape), []).pp
    out = io.StringIO()
    Console(file=out, width=400).print(summary(got["rows"], got["sizes"], got["comm"], cfg,
                                               shape))
    counted = [line for line in out.getvalue().splitlines() if " per step " in line]
    assert len(counted) == 6 and all("= the analytic count" in line for line in counted), \
        out.getvalue()


@pytest.mark.slow
def test_tied_resume_at_another_tp_and_pipeline_size(ranks, runs, tmp_path):
    """A tied (tp 2, pp 2) run's step-3 checkpoint resumes at (tp 4, pp 1), and a tied run's
    without a pipeline at (tp 1, pp 2): steps 4-6 equal the uninterrupted run's (1e-5). The
    checkpoint holds the table once, under the embedding's name, as a run without a pipeline
    stores it (the last stage's copy is not saved): it exports as that run's tied model, dense
    and as a Hugging Face folder with tied word embeddings. (The checkpoints are the 6-step
    runs' of test_tied_pipeline_trains_as_one_rank, saved at step 3 too.)"""
    import json

    import torch
    from safetensors.torch import load_file

    from tensorpar.checkpoint.export import export_dense
    from tensorpar.gpt.model import GPT
    from tensorpar.hf.export import export_hf

    want = runs(1, model=TIED, **SIX)
    cuts = {(tp, pp): runs.folder(tp, pp, model=TIED, **SIX) for tp, pp in ((2, 2), (1, 1))}
    step3 = {k: v / "step-00000003" for k, v in cuts.items()}
    manifest = json.loads((step3[2, 2] / "manifest.json").read_text())
    assert [p["rank"] for p in manifest["tensors"]["embed.weight"]["pieces"]] == [0, 1]
    dense = {k: load_file(export_dense(step3[k], tmp_path / f"{k}.safetensors"))
             for k in step3}
    assert dense[2, 2].keys() == dense[1, 1].keys() == GPT(GPTConfig(**(MODEL | TIED))) \
        .state_dict().keys()
    for name, t in dense[2, 2].items():
        torch.testing.assert_close(t, dense[1, 1][name], rtol=1e-5, atol=1e-6)
    hf = export_hf(cuts[2, 2], tmp_path / "hf")
    assert json.loads((hf / "config.json").read_text())["tie_word_embeddings"] is True
    for (tp, pp), src in (((4, 1), (2, 2)), ((1, 2), (1, 1))):
        rows = ranks(tp * pp).run(_train, tmp_path / f"tp{tp}-pp{pp}", str(step3[src]), TIED,
                                  tp=tp, pp=pp, **SIX)[0]["rows"]
        assert [r["step"] for r in rows] == [4, 5, 6], rows
        for got, ref in zip(rows, want[3:], strict=True):
            for key in ("loss", "grad_norm"):
                assert abs(got[key] - ref[key]) <= 1e-5 * ref[key], (tp, pp, got, ref)


@pytest.mark.parametrize("tp,virtual,tied", [(1, 1, False), (2, 2, False),
                                              pytest.param(2, 1, True, marks=pytest.mark.slow)],
                         ids=["1-1", "2-2", "tied-2-1"])
def test_planned_stage_peaks_are_the_measured_ones(ranks, tmp_path, tp, virtual, tied):
    """Each pipeline rank's peak tensor memory in a step is the planner's for its stages
    (``plan_pipeline``: its blocks, embedding or head, the micro-batches 1F1B or the interleaved
    order keeps in flight, the receive buffers), within 6%, at 1F1B and interleaved; a tied
    head's table (weights, gradient, AdamW) on the last stage too."""
    from tensorpar.planner.pipeline import plan_pipeline
    from tensorpar.planner.step import Step
    from tensorpar.train.shape import gpt_shape

    model = {"dim": 128, "n_head": 8, "hidden_dim": 256} | (TIED if tied else {})
    sizes = ranks(tp * 2).run(_train, tmp_path, None, model, tp=tp, pp=2, pp_virtual=virtual,
                              seq_len=32, steps=2)[0]["sizes"]
    plan = plan_pipeline(Step(gpt_shape(GPTConfig(**(MODEL | model))), tp, 8, 32, "fp32", pp=2,
                              virtual=virtual, micro_batches=4))
    for s in sizes:
        want = plan["stages"][s["pp_rank"]]["total"] + s["data_bytes"]
        # measured (torch 2.13 CPU): the planner 0.4-4.7% under
        assert s["peak_memory"] == pytest.approx(want, rel=0.06), (s, want)


@pytest.mark.slow
@pytest.mark.parametrize("tp,flags", [(1, {"dropout": 0.1}),
                                      (2, {"dropout": 0.1, "sequence_parallel": True,
                                           "recompute": True})],
                         ids=["dropout", "sp-recompute-dropout"])
def test_pipeline_keeps_the_masks_of_the_run_without_one(runs, tp, flags):
    """With dropout (and sequence parallelism and recompute) the stages draw the masks the same
    run draws without a pipeline: block i of micro-batch j takes key j * L + i + 1."""
    model = {"dropout": flags["dropout"]}
    rest = {k: v for k, v in flags.items() if k != "dropout"}
    ref = runs(tp, model=model, **rest)
    if not rest:  # the masks drop something
        assert abs(ref[0]["loss"] - runs(tp)[0]["loss"]) > 1e-4
    _same(runs(tp, 2, model=model, **rest), ref, f"pp2 tp{tp} {flags}")


def test_resume_at_another_tp_and_pipeline_size(ranks, runs, tmp_path):
    """Stopped after step 2 at (tp 2, pp 2), resumed at (tp 4, pp 1) and (tp 1, pp 4): step 3
    equals the uninterrupted run's (1e-5). The checkpoint is one manifest over both stages'
    files, and exports as the whole model: every tensor of it, whole; ``generate --ckpt`` at
    TP=2 reads it and writes the greedy text of the exported weights on one device."""
    import torch
    from safetensors.torch import load_file

    from tensorpar.checkpoint.export import export_dense
    from tensorpar.data.tokenizer import ByteTokenizer
    from tensorpar.gpt.generate import generate, generate_rank
    from tensorpar.gpt.model import GPT

    cut = tmp_path / "cut"
    ranks(4).run(_train, cut, None, None, tp=2, pp=2, steps=2, lr_decay_steps=STEPS)
    dense = load_file(export_dense(cut / "step-00000002", tmp_path / "dense.safetensors"))
    whole = GPT(GPTConfig(**MODEL))
    assert {k: v.shape for k, v in dense.items()} == \
        {k: v.shape for k, v in whole.state_dict().items()}
    whole.load_state_dict(dense)
    tok = ByteTokenizer()
    greedy = generate(whole, torch.tensor([tok.encode("def ")]), 12)[0].tolist()
    texts = ranks(2).run(generate_rank, str(cut), ["def "], 12, 0.0, 0)[0]
    assert texts == [tok.decode(greedy)]
    want = runs(1)[-1]
    for tp, pp in ((4, 1), (1, 4)):
        rows = ranks(tp * pp).run(_train, tmp_path / f"tp{tp}-pp{pp}", str(cut / "step-00000002"),
                                  None, tp=tp, pp=pp, lr_decay_steps=STEPS)[0]["rows"]
        got = rows[-1]
        assert got["step"] == STEPS, rows
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - want[key]) <= 1e-5 * want[key], (tp, pp, got, want)


def test_pipeline_flags_are_checked_before_any_rank(tmp_path):
    """Too few micro-batches for the stages; too many stages for the blocks; interleaved
    rounds."""
    from tensorpar.train.run import resolve

    def check(message, model=None, **flags):
        args = {"out": str(tmp_path / "x")} | FLAGS | flags
        with pytest.raises(ValueError, match=message):
            resolve(args, MODEL | {"tie_embeddings": None} | (model or {}))

    check("--pp 4 needs at least 4 micro-batches per step", tp=1, pp=4, micro_batch_size=4)
    check("--n-layer 4 cannot be cut into 6 pipeline stages", tp=1, pp=3, pp_virtual=2,
          micro_batch_size=1)
    check("--pp-virtual 2: the interleaved schedule runs the 5 micro-batches", tp=1, pp=2,
          pp_virtual=2, batch_size=5, micro_batch_size=1)


def test_pipeline_micro_batches_chosen_when_not_given(tmp_path, capsys):
    """Without --micro-batch-size, --pp takes 2 x pp micro-batches (pp when 2 x pp does not
    divide the batch of a data-parallel copy) and says so in one line; none dividing it: the
    pipeline's own refusal."""
    from tensorpar.train.run import resolve

    def chosen(**flags):
        args = {"out": str(tmp_path / "x"), "tp": 1, "micro_batch_size": None} | flags
        return resolve(args, MODEL | {"tie_embeddings": False})[0].micro_batch_size

    assert chosen(pp=2, batch_size=8) == 2
    assert capsys.readouterr().err == ("tensorpar train: note: --pp 2: 4 micro-batches of 2 "
                                       "sequences a step (--micro-batch-size 2; pass it to "
                                       "choose)\n")
    assert chosen(pp=2, batch_size=6) == 3  # 2 micro-batches: 4 does not divide 6
    assert chosen(pp=2, batch_size=16, dp=2) == 2
    assert chosen(pp=2, batch_size=8, micro_batch_size=4) == 4  # given: kept
    with pytest.raises(ValueError, match="--pp 4 needs at least 4 micro-batches per step"):
        chosen(pp=4, batch_size=3)
