"""``tensorpar train --hf``: a Hugging Face model fine-tuned in the GPT's training loop.

Tiny random Llama (GQA: 4 heads, 2 KV heads, so TP=4 shares KV heads), Qwen2 (q/k/v biases)
and GPT-2 (Conv1D, packed q|k|v, head tied to the embedding), saved with ``save_pretrained``
together with a byte-level BPE tokenizer (vocabulary 320) trained here with ``tokenizers``.
The invariants: the loss and gradient norm of every step at TP=2 and 4, after a resume at
another TP size from the run's own copy of the model's files (the source directory deleted),
and at TP=2 x DP=2 (FSDP2) equal TP=1's to fp32 rounding; dropout masks derive from (seed,
step), so a resume at the same TP size repeats a run with dropout exactly; the export is the
source's architecture and names, loaded by transformers with no missing or unexpected key and
the checkpoint's logits. The runs go through the rank pools (``train_model_rank``), one through
the CLI; refused requests are one line, before any rank starts.
"""

import contextlib
import dataclasses
import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tensorpar.checkpoint.format import find_checkpoint  # noqa: E402
from tensorpar.checkpoint.load import load_checkpoint  # noqa: E402
from tensorpar.gpt.data import default_corpus  # noqa: E402
from tensorpar.gpt.model import GPTConfig  # noqa: E402
from tensorpar.gpt.train import TrainConfig, train_model_rank  # noqa: E402
from tensorpar.hf.pretrained import from_pretrained  # noqa: E402
from tensorpar.hf.train import resolve_hf  # noqa: E402
from tensorpar.plan.comm import predicted_comm  # noqa: E402

from tests_common import read_metrics, tensorpar_cli, tensorpar_here  # noqa: E402

VOCAB, STEPS = 320, 10
SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
TRAIN = {"batch_size": 4, "seq_len": 16, "warmup_steps": 2, "lr": 3e-3, "seed": 1,
         "save_every": 5, "steps": STEPS}


def _configs(dropout: float = 0.0) -> dict:
    drops = dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), dropout)
    return {"llama": transformers.LlamaConfig(**SIZES),
            "qwen2": transformers.Qwen2Config(**SIZES),
            "gpt2": transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                            n_positions=64, n_inner=64, bos_token_id=0,
                                            eos_token_id=0, **drops)}


def _bpe(text: str):
    """A byte-level BPE of ``VOCAB`` tokens trained on ``text`` (a second), as transformers'
    fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """The directory of each tiny model (with its tokenizer), and ``data``: the training text."""
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("hf-train")
    text = default_corpus()[:24_000]
    (root / "data.txt").write_text(text)
    tokenizer = _bpe(text)
    dirs = {"data": root / "data.txt"}
    configs = _configs() | {"gpt2-dropout": _configs(0.1)["gpt2"],
                            "opt": transformers.OPTConfig(  # no tensor-parallel plan
                                vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                                num_attention_heads=4, word_embed_proj_dim=32)}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        dirs[name] = root / name
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(dirs[name])
        tokenizer.save_pretrained(dirs[name])
    return dirs


def _resolve(path, **train):
    """``resolve_hf`` as the CLI calls it (None: a flag not given)."""
    train_args = {f.name: None for f in dataclasses.fields(TrainConfig)} | train
    return resolve_hf(train_args, {f.name: None for f in dataclasses.fields(GPTConfig)},
                      None if path is None else str(path))


def _train_rank(cfg, recipe, resume_from):
    """``train_model_rank``; after a compiled run dynamo's caches are emptied: they hold the
    model, and the pool's rank runs other tests next (as tests/gpt/test_compile_train.py)."""
    try:
        return train_model_rank(cfg, recipe, resume_from)
    finally:
        if cfg.compile:
            import torch._dynamo

            torch._dynamo.reset()


def _train(ranks, path, out, tp, dp=None, whole=False, **train):
    """A run on the pool of tp x dp ranks; its metrics rows (whole: rank 0's result and the
    run's recipe)."""
    cfg, recipe, resume_from = _resolve(path, out=str(out), tp=tp, dp=dp, **train)
    result = ranks(tp * (dp or 1)).run(_train_rank, cfg, recipe, resume_from)[0]
    return (result, recipe) if whole else result["rows"]


@pytest.fixture(scope="module")
def runs(ranks, models, tmp_path_factory):
    """``runs(family, tp, sp)``: (run directory, metrics rows, rank 0's result, the recipe) of a
    STEPS-step run, made once."""
    made = {}

    def get(family: str, tp: int, sp: bool = False):
        if (family, tp, sp) not in made:
            out = tmp_path_factory.mktemp(f"{family}-tp{tp}{'-sp' * sp}")
            result, recipe = _train(ranks, models[family], out, tp, whole=True, **TRAIN,
                                    sequence_parallel=sp, data=str(models["data"]))
            made[family, tp, sp] = out, result["rows"], result, recipe
        return made[family, tp, sp]

    return get


def _same(rows, ref, tol, what):
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for a, b in zip(rows, ref, strict=True):
        for key in ("loss", "grad_norm"):
            err = abs(a[key] - b[key]) / abs(b[key])
            assert err <= tol, f"{what}: step {a['step']} {key} {a[key]} vs {b[key]} ({err:.1e})"


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_loss_equal_across_tp(runs, family):
    """10 AdamW steps (fp32): loss and gradient norm of every step at TP=2 and 4 (and for the
    Llama TP=2 with sequence parallelism) equal TP=1's to a relative 1e-5, and the loss falls."""
    ref = runs(family, 1)[1]
    for tp, sp in [(2, False), (4, False)] + [(2, True)] * (family == "llama"):
        _same(runs(family, tp, sp)[1], ref, 1e-5, f"{family} TP={tp}{' + SP' * sp}")
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
    RUN/hf, no weights in it): every step equals the uninterrupted run's to a relative 1e-5."""
    whole, rows = runs("llama", 4)[:2]
    assert _interrupt(whole, tmp_path / "resumed", 5).name == "step-00000005"
    assert sorted(p.name for p in (tmp_path / "resumed" / "hf").iterdir()) == \
        ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    with _gone(models["llama"]):
        resumed = _train(ranks, None, tmp_path / "resumed", 2, resume=True)
    _same(resumed, rows, 1e-5, "resumed at TP=2")


def test_dropout_masks_repeat_on_resume_and_recompute(ranks, runs, models, tmp_path):
    """GPT-2 with dropout 0.1 at TP=2, resumed at TP=2 from step 5, and again with
    ``--recompute``: the same losses (the masks of step s derive from (seed, s), and a
    recomputed layer draws those of its first forward, in its TP regions and outside); the
    dropout was on (the losses differ from the same weights' without it)."""
    whole = _train(ranks, models["gpt2-dropout"], tmp_path / "whole", 2, **TRAIN,
                   data=str(models["data"]))
    _interrupt(tmp_path / "whole", tmp_path / "resumed", 5)
    resumed = _train(ranks, None, tmp_path / "resumed", 2, resume=True)
    _same(resumed, whole, 1e-6, "resumed with dropout")
    recomputed = _train(ranks, models["gpt2-dropout"], tmp_path / "recomputed", 2, **TRAIN,
                        recompute=True, data=str(models["data"]))
    _same(recomputed, whole, 1e-6, "recomputed with dropout")
    assert abs(runs("gpt2", 2)[1][0]["loss"] - whole[0]["loss"]) > 1e-4


def test_tp2_dp2_fsdp_equals_tp1(ranks, runs, models, tmp_path):
    """TP=2 x DP=2 under FSDP2 (4 ranks, each TP group on half of every batch): every step's
    loss (the mean of the two halves') and gradient norm equal TP=1's to a relative 1e-5."""
    rows = _train(ranks, models["llama"], tmp_path, 2, dp=2, dp_mode="fsdp", **TRAIN,
                  data=str(models["data"]))
    _same(rows, runs("llama", 1)[1], 1e-5, "TP=2 x DP=2")


def _checkpoint_logits(run, ids):
    """The logits of the run's newest checkpoint, loaded at TP=1 in this process from the
    run's copy of the model's files."""
    manifest = json.loads((find_checkpoint(run) / "manifest.json").read_text())
    model = from_pretrained(run / "hf", plan=manifest["hf"]["plan"], weights=False)
    load_checkpoint(run, model)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def _exported_logits(run, out, ids):
    """Export the run with ``tensorpar export --hf-out``; the logits transformers computes
    from the folder, which it loads with no missing, unexpected or resized tensor."""
    done = tensorpar_here("export", "--ckpt", run, "--hf-out", out)
    assert done.returncode == 0, done.stderr
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_export_is_the_source_architecture(runs, models, tmp_path, family):
    """The TP=2 run exported, its source directory gone: the source's class and config, the
    tokenizer copied, the head of GPT-2 tied again; its logits are the checkpoint's to fp32
    rounding."""
    run = runs(family, 2)[0]
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with _gone(models[family]):
        got = _exported_logits(run, tmp_path / "hf", ids)
    torch.testing.assert_close(got, _checkpoint_logits(run, ids), rtol=1e-5, atol=1e-5)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == family and config["vocab_size"] == VOCAB
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == \
        (models[family] / "tokenizer.json").read_text()


def test_cli_trains_and_exports(models, tmp_path):
    """``tensorpar train --hf DIR --tp 2`` as a user runs it: progress lines, the summary with
    the planned memory, metrics.jsonl, a checkpoint of kind "hf" and the run's copy of the
    model's files (no weights); then ``export --hf-out`` (transformers' logits equal the
    checkpoint's) and ``export --out`` (dense, the HF names)."""
    run = tmp_path / "run"
    out = tensorpar_cli("train", "--hf", models["llama"], "--tp", 2, "--steps", 6, "--save-every",
                        3, "--seq-len", 16, "--batch-size", 4, "--data", models["data"],
                        "--out", run)
    assert out.returncode == 0, out.stdout + out.stderr
    for text in ("step 6/6", "loss (first -> final step)", "tokens/s", "rank 1", "planned",
                 "all_reduce per step"):
        assert text in out.stdout, out.stdout
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 7))
    manifest = json.loads((run / "step-00000006" / "manifest.json").read_text())
    assert manifest["model_kind"] == "hf" and manifest["tp_size"] == 2
    assert manifest["config"]["model_type"] == "llama" and manifest["hf"]["files"] == "hf"
    assert not list((run / "hf").glob("*.safetensors"))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    got = _exported_logits(run, tmp_path / "hf", ids)
    torch.testing.assert_close(got, _checkpoint_logits(run, ids), rtol=1e-5, atol=1e-5)
    done = tensorpar_here("export", "--ckpt", run, "--out", tmp_path / "dense.safetensors")
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    dense = load_file(tmp_path / "dense.safetensors")
    assert dense["model.layers.0.self_attn.k_proj.weight"].shape == (16, 32)  # 2 KV heads of 8


def _no_tokenizer(models, tmp_path):
    shutil.copytree(models["llama"], tmp_path / "m")
    for f in (tmp_path / "m").glob("tokenizer*"):
        f.unlink()
    return tmp_path / "m"


BAD = {  # case: (the --hf directory, given models and tmp_path; extra flags; the message)
    "no directory": (lambda m, t: t / "missing", [], "no config.json (not a Hugging Face model"),
    "no tokenizer": (_no_tokenizer, [], "no tokenizer (tokenizer.json, tokenizer_config.json"),
    "GPT flags": (lambda m, t: m["llama"], ["--dim", 64, "--n-layer", 3],
                  "leave out the GPT's model flags --n-layer, --dim"),
    "heads": (lambda m, t: m["llama"], ["--tp", 8], "at --tp 8: model.layers.0.self_attn: "),
    "SP": (lambda m, t: m["gpt2"], ["--tp", 2, "--sequence-parallel"],
           "supported for the Llama family (llama, mistral, qwen2, qwen3), not "
           "model_type='gpt2'"),
    "compile with dropout": (lambda m, t: m["gpt2-dropout"], ["--compile"],
                             "--compile is not supported with --hf for a model that drops"),
    "short data": (lambda m, t: m["llama"], ["--data", "SHORT"],
                   "has fewer than --seq-len 16 + 1 tokens"),
    "no plan": (lambda m, t: m["opt"], [], "no tensor-parallel plan for OPTForCausalLM"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_are_refused_before_any_rank(models, tmp_path, case):
    """Exit 2 and one line naming the cause (the plan's error lists the linear layers below
    it), before any rank starts: nothing written."""
    make, flags, message = BAD[case]
    (tmp_path / "short.txt").write_text("a few words")
    flags = [tmp_path / "short.txt" if f == "SHORT" else f for f in flags]
    out = tensorpar_here("train", "--hf", make(models, tmp_path), "--seq-len", 16, "--out",
                         tmp_path / "run", *flags)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "run").exists()
    assert case == "no plan" or out.stderr.count("\n") == 1, out.stderr


def test_another_model_or_command_is_refused(runs, models, tmp_path):
    """``--resume --hf`` with a directory whose config.json is not the run's, and ``generate
    --ckpt`` (the GPT's) of the run: one line each."""
    run = runs("llama", 2)[0]
    out = tensorpar_here("train", "--resume", "--hf", models["qwen2"], "--out", run)
    assert out.returncode == 2 and "config.json differs from the run's" in out.stderr, out.stderr
    out = tensorpar_here("generate", "--ckpt", run, "--prompt", "x")
    assert out.returncode == 2 and "fine-tuned by tensorpar train --hf: export it" in out.stderr


def test_resume_before_the_first_checkpoint_is_the_fine_tunes(models, tmp_path):
    """``--resume`` without ``--hf`` of a fine-tune stopped before its first checkpoint (its
    RUN/hf/ copy of the model written, no step-*): one line asking for --hf, not a GPT run."""
    run = tmp_path / "run"
    shutil.copytree(models["llama"], run / "hf")
    out = tensorpar_here("train", "--resume", "--out", run, "--steps", 2)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "has no checkpoint of its fine-tune yet; pass --hf PATH" in out.stderr, out.stderr
    assert sorted(p.name for p in run.iterdir()) == ["hf"]


def test_recompute_equals_the_run_and_keeps_less(ranks, runs, models, tmp_path):
    """``--recompute`` (transformers' gradient checkpointing, each decoder layer keeping only
    its input) on the Llama at TP=2: every step's loss and gradient norm equal the run without it
    to 1e-6, the peak memory is lower, and the summary's analytic count (each layer's MLP exit
    all-reduced again in backward) equals what ran."""
    _, rows, result, _ = runs("llama", 2)
    again, recipe = _train(ranks, models["llama"], tmp_path, 2, whole=True, **TRAIN,
                           recompute=True, data=str(models["data"]))
    _same(again["rows"], rows, 1e-6, "recomputed")
    peak = [r["sizes"][0]["peak_memory"] for r in (result, again)]
    assert peak[1] < 0.9 * peak[0], peak
    predicted = predicted_comm(recipe.spec(), TRAIN["batch_size"], TRAIN["seq_len"], 2,
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
    graph, no break (its blocks' hooks and fused ops, the collectives), and every step equals
    the eager run's to a relative 1e-6 (with ``--recompute`` too: transformers' checkpointing,
    no context_fn for a model without dropout)."""
    for graphs, breaks, reasons in ranks(2).run(_compiled_graphs, str(models["llama"]), sp):
        assert (graphs, breaks) == (1, 0), reasons
    rows = _train(ranks, models["llama"], tmp_path, 2, **TRAIN, sequence_parallel=sp,
                  compile=True, compile_backend="aot_eager", recompute=recompute,
                  data=str(models["data"]))
    _same(rows, runs("llama", 2, sp)[1], 1e-6, "compiled")


@pytest.mark.parametrize("sp", [False, True])
def test_summary_counts_the_collectives_exactly(runs, sp):
    """The summary's analytic count for a converted Llama at TP=2 equals what the run measured,
    kind by kind, calls and bytes; under SP too (its embedding all-reduced, hf/sequence.py)."""
    _, _, result, recipe = runs("llama", 2, sp)
    predicted = predicted_comm(recipe.spec(), TRAIN["batch_size"], TRAIN["seq_len"], 2, sp)
    assert result["comm"]["counts"] == dict(predicted["counts"])
    assert result["comm"]["bytes"] == dict(predicted["bytes"])
