"""``train --hf --lora-rank R``: LoRA fine-tuning under tensor parallelism.

On the tiny models of ``hf_runs.py``: the losses and gradient norms at TP=2, 3 (uneven heads and
features), with sequence parallelism and recompute, and at TP=2 x DP=2 under FSDP2 and DDP equal
TP=1's; the checkpoints and the optimizer hold the adapters alone and the base never changes; a
resume at another TP size continues exactly; ``export --peft-out`` writes a folder PEFT loads with
every key, giving tensorpar's logits, and ``export --hf-out`` the merged model; ``--lora-init``
starts from such a folder; wrong flags are one line before any rank."""

import json

import hf_runs  # noqa: E402
import peft
import pytest
import torch
import transformers
from hf_runs import TRAIN, resolve, train, train_rank  # noqa: E402

from tensorpar.checkpoint.format import find_checkpoint  # noqa: E402
from tensorpar.checkpoint.load import CheckpointReader, load_checkpoint  # noqa: E402
from tensorpar.hf.lora import add_lora  # noqa: E402
from tensorpar.hf.pretrained import from_pretrained  # noqa: E402
from tensorpar.parallel.lora import lora_parameters  # noqa: E402
from tensorpar.parallel.mappings import gather_from_tp  # noqa: E402

from tests_common import read_metrics, tensorpar_here  # noqa: E402

STEPS = 4
LORA = TRAIN | {"steps": STEPS, "save_every": 2, "lora_rank": 4, "lora_alpha": 8.0,
                "lr": 1e-2}


def _train_keeping(cfg, recipe, resume_from):
    """``train_rank``, and then whether each base parameter of the trained model (on this rank)
    is still the file's, as ``from_pretrained`` loads it (the result's "base_changed": the names
    of those that are not, or that lack)."""
    built = []
    build = recipe.build

    def keeping(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]

    recipe.build = keeping
    result = train_rank(cfg, recipe, resume_from)
    trained = dict(built[0][0].named_parameters())
    import torch.distributed as dist

    fresh = from_pretrained(recipe.source, dist.group.WORLD if cfg.tp > 1 else None,
                            plan=recipe.plan, sequence_parallel=cfg.sequence_parallel)
    base = dict(fresh.named_parameters())
    result["base_changed"] = sorted(n for n, p in base.items() if n not in trained or not
                                    torch.equal(trained[n].detach().float(), p.detach()))
    result["base_count"] = len(base)
    return result


@pytest.fixture(scope="module")
def runs(ranks, models, tmp_path_factory):
    """``runs(family, tp, dp, **flags)``: (run directory, rows, rank 0's result), made once.
    Without dp, each rank's result says which base parameters differ from the file's."""
    made = {}

    def get(family, tp, dp=None, **flags):
        key = (family, tp, dp, tuple(sorted(flags.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"lora-{family}-tp{tp}")
            cfg, recipe, _ = resolve(models[family], out=str(out), tp=tp, dp=dp,
                                     **(LORA | flags), data=str(models["data"]))
            rank = train_rank if dp else _train_keeping
            results = ranks(tp * (dp or 1)).run(rank, cfg, recipe, None)
            made[key] = out, results[0]["rows"], results[0] | {"ranks": results}
        return made[key]

    return get


def _same(rows, ref, tol, what):
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    worst = 0.0
    for a, b in zip(rows, ref, strict=True):
        for key in ("loss", "grad_norm"):
            err = abs(a[key] - b[key]) / abs(b[key])
            worst = max(worst, err)
            assert err <= tol, f"{what}: step {a['step']} {key} {a[key]} vs {b[key]} ({err:.1e})"
    return worst


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lora_equal_across_tp(runs, family):
    """Loss and gradient norm of 4 AdamW steps on the adapters at TP=2 (and for the Llama TP=3,
    TP=2 with sequence parallelism and with recompute; GPT-2's packed q|k|v at TP=3: test_lora.py)
    equal TP=1's to 1e-5 relative (measured at most 1.7e-7), and the loss falls."""
    ref = runs(family, 1)[1]
    assert ref[-1]["loss"] < ref[0]["loss"], ref
    cases = [(2, {})] + [(3, {}), (2, {"sequence_parallel": True}),
                         (2, {"recompute": True})] * (family == "llama")
    for tp, flags in cases:
        _same(runs(family, tp, **flags)[1], ref, 1e-5, f"{family} TP={tp} {flags}")


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_lora_tp2_dp2_equals_tp1(runs, mode):
    """TP=2 x DP=2 under FSDP2 and DDP: the adapters' gradients reduced over dp, the frozen
    base never (1e-5 relative to TP=1; measured 1.7e-7)."""
    _same(runs("llama", 2, 2, dp_mode=mode)[1], runs("llama", 1)[1], 1e-5, f"2x2 {mode}")


def test_lora_dropout_equal_across_tp(runs):
    """``--lora-dropout 0.2``: each mask is drawn dense and split, so TP=2 (and with sequence
    parallelism) trains as TP=1 (1e-5), and the steps differ from those without dropout."""
    ref = runs("llama", 1, lora_dropout=0.2)[1]
    plain = runs("llama", 1)[1]
    assert all(abs(a["loss"] - b["loss"]) > 1e-4 for a, b in zip(ref[1:], plain[1:], strict=True))
    for flags in ({}, {"sequence_parallel": True}):
        _same(runs("llama", 2, lora_dropout=0.2, **flags)[1], ref, 1e-5, f"dropout {flags}")


def test_base_in_bf16_steps_as_autocast_with_less_memory(runs):
    """``--base-dtype bf16 --dtype bf16`` holds the frozen projections and head in bf16: the
    values autocast computes with, so the steps are those of ``--dtype bf16`` with the base in
    fp32 (to fp32 rounding), with less memory on each rank."""
    fp32, bf16 = runs("llama", 2, dtype="bf16"), runs("llama", 2, dtype="bf16", base_dtype="bf16")
    _same(bf16[1], fp32[1], 1e-6, "bf16 base")
    for mine, theirs in zip(bf16[2]["sizes"], fp32[2]["sizes"], strict=True):
        assert mine["peak_memory"] < theirs["peak_memory"], (mine, theirs)


def test_checkpoint_holds_the_adapters_and_the_base_is_untouched(runs, models):
    """The checkpoint has each adapter's two factors and their AdamW moments, nothing of the
    base; the manifest names the base model; after the 4 steps the base's weights on each rank
    are the file's, bit for bit."""
    run, _, result = runs("llama", 2)
    for r in result["ranks"]:
        assert r["base_count"] > 0 and r["base_changed"] == [], r["base_changed"]
    reader = CheckpointReader(find_checkpoint(run))
    names = set(reader.tensors)
    weights = {n for n in names if not n.startswith("optimizer.")}
    assert weights and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in weights)
    assert len(weights) == 2 * 2 * 7  # 2 layers x 7 projections x (A, B)
    assert names == weights | {f"optimizer.{s}.{n}" for s in ("exp_avg", "exp_avg_sq")
                               for n in weights}
    assert reader.manifest["hf"]["source"] == str(models["llama"])
    assert reader.manifest["train"]["lora_rank"] == 4
    b = reader.read("model.layers.0.self_attn.q_proj.lora_B.weight")
    assert b.abs().max() > 0  # trained from zeros


def test_checked_run_passes_with_the_unchecked_steps(runs, models, tmp_path):
    """``train --check-collectives`` of a LoRA run at TP=2 (every collective compared across
    the ranks first) exits 0 with the unchecked run's steps, bit for bit."""
    done = tensorpar_here("train", "--check-collectives", "--hf", models["llama"], "--tp", 2,
                          "--data", models["data"], "--out", tmp_path,
                          *(x for k, v in LORA.items() for x in (f"--{k.replace('_', '-')}", v)))
    assert done.returncode == 0, done.stderr
    mine = [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path)]
    assert mine == [(r["step"], r["loss"], r["grad_norm"]) for r in runs("llama", 2)[1]]


def test_resume_at_another_tp_continues_exactly(ranks, runs, models, tmp_path):
    """Stopped after step 2 at TP=2, resumed at TP=3 from the adapters and the base: steps 3-4
    equal the uninterrupted TP=3 run's (1e-5)."""
    train(ranks, models["llama"], tmp_path / "cut", 2, **(LORA | {"steps": 2,
                                                                 "lr_decay_steps": STEPS}),
          data=str(models["data"]))
    rows = train(ranks, None, tmp_path / "cut", 3, resume=True, steps=STEPS)
    ref = runs("llama", 3)[1]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for a, b in zip(rows[2:], ref[2:], strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * b[key], (a, b)


def _tensorpar_logits(run, base, ids, group=None):
    """The LoRA run's logits at this group's TP size: the base, the adapters, the checkpoint."""
    model = from_pretrained(base, group)
    add_lora(model, 4, 8.0)
    load_checkpoint(run, model)
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits
    vocab = model.config.vocab_size
    return logits if logits.shape[-1] == vocab else gather_from_tp(logits, group, vocab)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_peft_folder_and_merged_model(ranks, runs, models, tmp_path, family):
    """export --peft-out: PEFT loads it on the base with no missing or unexpected adapter key,
    and its logits equal tensorpar's at TP=2 (1e-5), its greedy text generate --ckpt's at TP=1
    and 2, its base_model_name_or_path absolute; export --hf-out (no progress bar): each adapted
    weight is base + (alpha / r) B A, and transformers' logits equal PEFT's."""
    run = runs(family, 2)[0]
    done = tensorpar_here("export", "--ckpt", str(run), "--peft-out", str(tmp_path / "peft"))
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["fan_in_fan_out"] == (family == "gpt2")
    assert config["base_model_name_or_path"] == str(models[family].resolve())  # absolute
    base = transformers.AutoModelForCausalLM.from_pretrained(models[family])
    model = peft.PeftModel.from_pretrained(base, tmp_path / "peft")
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    loaded = {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}
    assert sorted(saved) == sorted(loaded)
    assert all(torch.equal(saved[n], loaded[n]) for n in saved)
    ids = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
    mine = ranks(2).run(_tensorpar_logits, run, models[family], ids)[0]
    assert (mine - want).abs().max() <= 1e-5 * want.abs().max()
    done = tensorpar_here("export", "--ckpt", str(run), "--hf-out", str(tmp_path / "merged"))
    assert done.returncode == 0 and done.stderr == "", done.stderr  # no progress bar
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        got = merged.eval()(input_ids=ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    tok = transformers.AutoTokenizer.from_pretrained(models[family])
    prompt = tok("The with statement")["input_ids"]
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    for tp in ("1", "2"):  # generate --ckpt runs the adapters on their base, at any TP
        said = tensorpar_here("generate", "--ckpt", str(run), "--tp", tp, "--prompt",
                              "The with statement", "--max-new-tokens", "8")
        assert said.returncode == 0, said.stderr
        assert said.stdout == tok.decode(greedy[0]) + "\n", (said.stdout, tok.decode(greedy[0]))
    reader = CheckpointReader(find_checkpoint(run))
    name = "model.layers.1.mlp.down_proj" if family == "llama" else "transformer.h.1.mlp.c_fc"
    delta = 2.0 * reader.read(f"{name}.lora_B.weight") @ reader.read(f"{name}.lora_A.weight")
    dense = transformers.AutoModelForCausalLM.from_pretrained(models[family]).state_dict()
    want_w = dense[f"{name}.weight"] + (delta.t() if family == "gpt2" else delta)
    assert torch.allclose(merged.state_dict()[f"{name}.weight"], want_w, atol=1e-7, rtol=0)


def _adapters(base, peft_dir, group=None):
    cfg, recipe, _ = resolve(base, out="/nonexistent-unused", tp=2, lora_init=str(peft_dir))
    model = from_pretrained(base, group)
    from tensorpar.hf.lora import read_peft

    add_lora(model, cfg.lora_rank, cfg.lora_alpha, None, 0, read_peft(peft_dir)[1])
    return cfg.lora_rank, cfg.lora_alpha, {n: p.detach().clone() for n, p in
                                           lora_parameters(model)}


def test_lora_init_starts_from_a_peft_folder(ranks, runs, models, tmp_path):
    """--lora-init DIR: the run takes the folder's rank and alpha, and its adapters at TP=2 are
    the run's it came from, piece for piece."""
    run = runs("llama", 2)[0]
    assert tensorpar_here("export", "--ckpt", str(run), "--peft-out",
                          str(tmp_path / "peft")).returncode == 0
    got = ranks(2).run(_adapters, models["llama"], tmp_path / "peft")
    want = ranks(2).run(_checkpoint_adapters, run, models["llama"])
    for (rank, alpha, mine), theirs in zip(got, want, strict=True):
        assert (rank, alpha) == (4, 8.0) and sorted(mine) == sorted(theirs)
        assert all(torch.equal(mine[n], theirs[n]) for n in mine)


def _checkpoint_adapters(run, base, group=None):
    model = from_pretrained(base, group)
    add_lora(model, 4, 8.0)
    load_checkpoint(run, model)
    return {n: p.detach().clone() for n, p in lora_parameters(model)}


def test_lora_flags_are_checked_before_any_rank(models, tmp_path):
    """The GPT refuses LoRA; an unknown target names what there is; a rank below 1; dropout
    without LoRA or of 1; a bf16 base without bf16 compute."""
    from tensorpar.train.run import resolve as resolve_any

    cases = [(lambda: resolve_any({"lora_rank": 4, "out": str(tmp_path / "g")}, {}),
              "--lora-rank and --lora-init fine-tune a Hugging Face model"),
             (lambda: resolve(models["llama"], out=str(tmp_path / "a"), lora_rank=4,
                              lora_targets="q_proj,qkv"),
              "--lora-targets qkv: no such projection in the model's blocks (it has down_proj, "
              "gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj)"),
             (lambda: resolve(models["llama"], out=str(tmp_path / "b"), lora_rank=0),
              "--lora-rank 0 must be >= 1"),
             (lambda: resolve(models["llama"], out=str(tmp_path / "c"), lora_dropout=0.1),
              "--lora-dropout: for LoRA, add --lora-rank R"),
             (lambda: resolve(models["llama"], out=str(tmp_path / "d"), lora_rank=4,
                              lora_dropout=1.0), "--lora-dropout 1.0 must be in [0, 1)"),
             (lambda: resolve(models["llama"], out=str(tmp_path / "e"), lora_rank=4,
                              base_dtype="bf16"),
              "--base-dtype bf16 computes in bf16: add --dtype bf16")]
    for call, message in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert message in str(e.value), str(e.value)


def test_generate_from_a_full_fine_tune(ranks, models, tmp_path):
    """generate --ckpt of a run that trained every weight prints, at TP=2, the greedy text
    transformers gives on the run exported with export --hf-out."""
    run = tmp_path / "full"
    train(ranks, models["llama"], run, 2, **(TRAIN | {"steps": 1}), data=str(models["data"]))
    assert tensorpar_here("export", "--ckpt", str(run), "--hf-out",
                          str(tmp_path / "hf")).returncode == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        greedy = model.generate(torch.tensor([tok("A class")["input_ids"]]), max_new_tokens=8,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    said = tensorpar_here("generate", "--ckpt", str(run), "--tp", "2", "--prompt", "A class",
                          "--max-new-tokens", "8")
    assert said.returncode == 0, said.stderr
    assert said.stdout == tok.decode(greedy[0]) + "\n", (said.stdout, tok.decode(greedy[0]))


def test_a_mismatched_lora_init_or_resume_is_one_line_before_any_rank(runs, models, tmp_path):
    """--lora-init with PEFT's adapter for a model of another width, a training run or a missing
    folder, and --resume of a rank-4 LoRA run with --lora-rank 8 or other --lora-targets: one
    line, exit status 2, no rank started."""
    wide = transformers.LlamaConfig(**{**hf_runs.SIZES, "hidden_size": 48})
    adapter = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(wide),
                                  peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    adapter.save_pretrained(tmp_path / "wide")
    run = runs("llama", 2)[0]
    cases = [(("--hf", models["llama"], "--lora-init", tmp_path / "wide", "--out", tmp_path / "a"),
              f"--lora-init {tmp_path / 'wide'}: model.layers.0.self_attn.q_proj.lora_A is (4, 48),"
              " the model needs (4, 32) (rank 4, model.layers.0.self_attn.q_proj 32 -> 32): an "
              "adapter made for a model of another size"),
             (("--hf", models["llama"], "--lora-init", run, "--out", tmp_path / "b"),
              f"--lora-init {run} is a training run, not a PEFT adapter folder: write its "
              f"adapters with tensorpar export --ckpt {run} --peft-out DIR"),
             (("--hf", models["llama"], "--lora-init", tmp_path / "none", "--out", tmp_path / "c"),
              f"--lora-init {tmp_path / 'none'}: no such folder"),
             (("--resume", "--out", run, "--lora-rank", 8),
              f"--lora-rank 8: the run in {run} trains adapters of rank 4"),
             (("--resume", "--out", run, "--lora-targets", "q_proj"),
              f"--lora-targets q_proj: the run in {run} adapts every projection")]
    for args, said in cases:
        r = tensorpar_here("train", "--tp", 1, *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1 and said in r.stderr, r.stderr
    assert not any((tmp_path / d).exists() for d in "abc")


CHAT_TEMPLATE = ("{%- for m in messages %}{{ '<|' + m['role'] + '|>' }}"
                 "{%- if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + eos_token }}"
                 "{% endgeneration %}{%- else %}{{ m['content'] }}{%- endif %}{%- endfor %}")


@pytest.fixture(scope="module")
def chat_llama(models, tmp_path_factory):
    """The tiny Llama with a chat template, and a file of conversations for it."""
    import shutil

    root = tmp_path_factory.mktemp("lora-chat")
    shutil.copytree(models["llama"], root / "model")
    tok = transformers.AutoTokenizer.from_pretrained(root / "model")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(root / "model")
    words = "the with statement class import def return yield lambda".split()
    with open(root / "chat.jsonl", "w") as f:
        for i in range(12):
            messages = [{"role": "user", "content": " ".join(words[i % 9:])},
                        {"role": "assistant", "content": " ".join(words[:(i % 5) + 2])}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return root


@pytest.mark.parametrize("case", [
    ("llama", 2, {}), ("llama", 2, {"sequence_parallel": True}), ("llama", 3, {}),
    ("llama", 2, {"recompute": True}),
    ("llama", 2, {"recompute": True, "sequence_parallel": True}),
    ("llama", 2, {"lora_dropout": 0.2}),
    ("llama", 2, {"lora_dropout": 0.2, "sequence_parallel": True}),
    ("llama", 2, {"dtype": "bf16"}), ("gpt2", 2, {}), ("chat", 2, {}),
    ("chat", 2, {"pack": True, "sequence_parallel": True})])
def test_summary_counts_lora_collectives_exactly(ranks, runs, models, chat_llama, case,
                                                tmp_path):
    """A LoRA run's summary: every collective of its measured step is the analytic count
    (``planner.comm.lora_sites``), kind by kind, calls and bytes: on text, chat and packed chat
    data, with and without sequence parallelism, with recompute, adapter dropout and bf16; at
    TP=3, where the Llama's KV heads are shared by two ranks. Without SP, no adapter adds a
    collective but the first block's A-gradient sum (z and dz ride the base's all-reduces)."""
    from tensorpar.planner.comm import lora_sites, predicted_comm
    from tensorpar.planner.shapes import shape_from_hf_config

    family, tp, flags = case
    if family == "chat":
        result, _ = train(ranks, chat_llama / "model", tmp_path, tp, whole=True,
                          **(LORA | flags | {"steps": 1, "seq_len": 48}),
                          data=str(chat_llama / "chat.jsonl"))
        seq = 48
    else:
        result, seq = runs(family, tp, **flags)[2], LORA["seq_len"]
    path = models["llama" if family == "chat" else family]
    shape = shape_from_hf_config(json.loads((path / "config.json").read_text()), family)
    lora = lora_sites(shape, LORA["lora_rank"], None, "lora_dropout" in flags,
                      input_grad=flags.get("recompute", False))
    predicted = predicted_comm(shape, LORA["batch_size"], seq, tp,
                               flags.get("sequence_parallel", False), flags.get("dtype", "fp32"),
                               "full" if flags.get("recompute") else "none", lora=lora)
    assert result["comm"]["counts"] == dict(predicted["counts"]), predicted["breakdown"]
    assert result["comm"]["bytes"] == dict(predicted["bytes"]), predicted["breakdown"]


def _lora_loss_and_grads(path, compiled):
    """Rank's loss and adapter gradients of one forward and backward of the converted Llama
    with LoRA (random B too, so every gradient is non-zero), compiled (aot_eager) or not."""
    import torch._dynamo as dynamo

    from tensorpar.hf.plans import LLAMA_PLAN
    from tensorpar.parallel.cross_entropy import vocab_parallel_cross_entropy
    from tensorpar.runtime.groups import init_tensor_parallel

    group = init_tensor_parallel()
    model = from_pretrained(path, group, plan=LLAMA_PLAN | {"lm_head": "column"}).train()
    add_lora(model, 4, 8.0, seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, p in lora_parameters(model):
            p.normal_(0, 0.05, generator=gen)
    ids = torch.randint(0, 320, (2, 17), generator=torch.Generator().manual_seed(1))

    def loss_fn(ids):
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        return vocab_parallel_cross_entropy(logits, ids[:, 1:], group=group, vocab_size=320)

    try:
        loss = (torch.compile(loss_fn, backend="aot_eager") if compiled else loss_fn)(ids)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in lora_parameters(model)}
    finally:
        dynamo.reset()


def test_compiled_lora_equals_eager(ranks, models):
    """Compiled (aot_eager) at TP=2, the adapters' products and gradients riding the base's
    collectives (the column op's custom backward, the row's flat all-reduce) give eager's loss
    and every factor's gradient (relative 1e-6; measured 3.7e-7)."""
    eager = ranks(2).run(_lora_loss_and_grads, str(models["llama"]), False)
    compiled = ranks(2).run(_lora_loss_and_grads, str(models["llama"]), True)
    for (le, ge), (lc, gc) in zip(eager, compiled, strict=True):
        assert abs(le - lc) <= 1e-6 * abs(le), (le, lc)
        for name, g in ge.items():
            err = (gc[name] - g).abs().max().item()
            assert err <= 1e-6 * g.abs().max().item(), (name, err)
