"""``tensorpar train --hf`` as a user runs it: a run and its exports through the command line,
and requests refused in one line before any rank starts (the runs' invariants:
``test_hf_train.py``)."""

import json
import shutil

import pytest
import torch
from hf_runs import VOCAB, checkpoint_logits, exported_logits  # noqa: E402

from tests_common import read_metrics, tensorpar_cli, tensorpar_here  # noqa: E402


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
    got = exported_logits(run, tmp_path / "hf", ids)
    # measured 0: the same model class on the same weights; the floor: a few fp32 ulps
    torch.testing.assert_close(got, checkpoint_logits(run, ids), rtol=1e-6, atol=1e-6)
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
           "supported for the Llama family (llama, mistral, qwen2, qwen3, qwen3_moe), not "
           "model_type='gpt2'"),
    "compile with dropout": (lambda m, t: m["gpt2-dropout"], ["--compile", "--recompute"],
                             "--compile with --recompute is not supported with --hf for a model "
                             "that drops"),
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


def test_resume_before_the_first_checkpoint_is_the_fine_tunes(models, tmp_path):
    """``--resume`` without ``--hf`` of a fine-tune stopped before its first checkpoint (its
    RUN/hf/ copy of the model written, no step-*): one line asking for --hf, not a GPT run."""
    run = tmp_path / "run"
    shutil.copytree(models["llama"], run / "hf")
    out = tensorpar_here("train", "--resume", "--out", run, "--steps", 2)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "has no checkpoint of its fine-tune yet; pass --hf PATH" in out.stderr, out.stderr
    assert sorted(p.name for p in run.iterdir()) == ["hf"]
