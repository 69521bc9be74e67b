"""``tensorpar export --ckpt RUN --hf-out DIR``: a GPT run as a Hugging Face folder that
transformers loads as a ``LlamaForCausalLM`` with no warning, whose logits equal tensorpar's to
fp32 rounding and whose greedy text equals ``tensorpar generate --temperature 0``, with a byte
tokenizer that gives tensorpar's ids; bad input is one line and leaves nothing behind.

One ``tensorpar train`` run (tied head) serves every test; the untied checkpoint is made from it
in this process (its head a perturbed copy of the embedding). ``train`` runs in this process
(``tests_common.tensorpar_here``, its rank forked from the session's server), ``generate`` as a
process of its own (the suite's one of ``tensorpar generate``) in the background while the
exports run here."""

import contextlib
import dataclasses
import io
import json
import logging
import shutil
import subprocess
import sys
import warnings
from unittest import mock

import pytest
import torch
import transformers

from tensorpar.checkpoint.load import CheckpointReader, load_checkpoint
from tensorpar.checkpoint.save import save_checkpoint
from tensorpar.cli.main import main
from tensorpar.data.tokenizer import ByteTokenizer
from tensorpar.gpt.generate import generate
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.hf import export
from tensorpar.parallel.ownership import ShardOwnership

from tests_common import TINY_GPT, checkout_env, leftovers, tensorpar_here

PROMPTS = ["The with statement", "Él dijo «ñ» 日本"]  # ASCII, and 2- and 3-byte UTF-8
NEW_TOKENS = 16
FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json"]


def run_main(*argv) -> tuple[int, str, str]:
    """``tensorpar ARGV`` in this process: (exit status, stdout, stderr). Without main's final
    ``gc.collect()`` (it frees process groups, which export has none of): with transformers
    loaded it takes a third of a second a call."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            mock.patch("gc.collect", lambda *args: 0):
        return main([str(a) for a in argv]), out.getvalue(), err.getvalue()


@contextlib.contextmanager
def transformers_messages():
    """Every warning transformers logs (at its default verbosity or above) or raises inside the
    block, collected in the list it yields."""
    messages, logs = [], transformers.utils.logging
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    verbosity = logs.get_verbosity()
    logs.set_verbosity_warning()  # another test module may have silenced it
    logs.get_logger().addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
        messages += [str(w.message) for w in caught]
    finally:
        logs.get_logger().removeHandler(handler)
        logs.set_verbosity(verbosity)


def load_hf(folder):
    """(model, tokenizer, loading info, messages) of an exported folder."""
    with transformers_messages() as messages:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, output_loading_info=True)
        tok = transformers.AutoTokenizer.from_pretrained(folder)
    return model.eval(), tok, info, messages


def dense_gpt(ckpt) -> GPT:
    model = GPT(GPTConfig(**CheckpointReader(ckpt).manifest["config"]))
    load_checkpoint(ckpt, model)
    return model.eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"tied", "untied"}: (checkpoint, exported folder); "cli_text": what ``tensorpar generate
    --temperature 0`` printed for PROMPTS from the tied run."""
    root = tmp_path_factory.mktemp("hf-export")
    tied = root / "tied"
    out = tensorpar_here("train", "--tp", 1, "--steps", 20, "--out", tied, *TINY_GPT)
    assert out.returncode == 0, out.stdout + out.stderr
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    gen = subprocess.Popen([sys.executable, "-m", "tensorpar", "generate", "--ckpt", str(tied),
                            "--tp", "1", "--temperature", "0", "--max-new-tokens",
                            str(NEW_TOKENS), *prompts], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=checkout_env())
    try:
        # untied: the trained weights, the head a perturbed copy of the embedding
        reader = CheckpointReader(tied)
        cfg = dataclasses.replace(GPTConfig(**reader.manifest["config"]), tie_embeddings=False)
        model, noise = GPT(cfg), torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                head = name == "lm_head.weight"
                p.copy_(1.5 * reader.read("embed.weight") + 0.02 * torch.randn(
                    p.shape, generator=noise) if head else reader.read(name))
        untied = root / "untied"
        save_checkpoint(untied, 20, model, ShardOwnership.gather(model),
                        meta={"config": dataclasses.asdict(cfg), "tokenizer": "bytes"})
        found = {}
        for name, ckpt in (("tied", tied), ("untied", untied)):
            folder = root / f"{name}-hf"
            rc, stdout, stderr = run_main("export", "--ckpt", ckpt, "--hf-out", folder)
            assert (rc, stdout, stderr) == (0, f"wrote {folder}\n", ""), (rc, stdout, stderr)
            found[name] = (ckpt, folder)
        stdout, stderr = gen.communicate(timeout=300)
    finally:
        gen.kill()
    assert gen.returncode == 0, stderr
    return found | {"cli_text": stdout}


@pytest.fixture(scope="module")
def loaded(runs):
    return {name: load_hf(runs[name][1]) for name in ("tied", "untied")}


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_folder_loads_as_llama_without_warnings(runs, loaded, name):
    """The folder holds config, generation config, one safetensors file and the tokenizer, and
    nothing else; transformers loads it as a LlamaForCausalLM with no missing, unexpected or
    mismatched key and no warning at all; the config says what the GPT is (head_dim, GQA,
    RMSNorm eps, rope theta, tied head, no bias, no special token)."""
    ckpt, folder = runs[name]
    assert sorted(p.name for p in folder.iterdir()) == FILES
    assert leftovers(folder.parent) == []
    model, tok, info, messages = loaded[name]
    assert messages == [] and all(not v for v in info.values()), (messages, info)
    assert type(model).__name__ == "LlamaForCausalLM" and tok.is_fast
    gpt, c = GPTConfig(**CheckpointReader(ckpt).manifest["config"]), model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.intermediate_size, c.vocab_size) == \
        (gpt.dim, gpt.n_layer, gpt.n_head, gpt.n_kv_head, gpt.head_dim, gpt.hidden_dim, 256)
    theta = getattr(c, "rope_parameters", {}).get("rope_theta") or c.rope_theta  # 5.x or 4.x
    assert (c.rms_norm_eps, theta, c.hidden_act) == (gpt.norm_eps, gpt.rope_theta, "silu")
    assert not c.attention_bias and not c.mlp_bias
    assert c.tie_word_embeddings == gpt.tie_embeddings == (name == "tied")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (name == "tied")
    assert c.bos_token_id is c.eos_token_id is c.pad_token_id is None


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_logits_equal_tensorpar(runs, loaded, name):
    """transformers' logits on the exported folder equal the dense tensorpar GPT's, loaded from
    the checkpoint, to fp32 rounding (relative 2e-6 of the largest), over 2 x 32 random ids."""
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        mine = dense_gpt(runs[name][0])(ids)
        theirs = loaded[name][0](ids).logits
    scale = mine.abs().max().item()
    assert (mine - theirs).abs().max().item() <= 2e-6 * scale  # measured 2.3e-7 (tied)


def _hf_greedy(model, tok, prompt: str) -> list[int]:
    enc = tok(prompt, return_tensors="pt")
    with transformers_messages() as messages, torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=NEW_TOKENS)
    assert messages == []
    return out[0].tolist()


def test_greedy_text_equals_tensorpar_generate(runs, loaded):
    """Tied: ``tensorpar generate --temperature 0`` (both prompts in one padded batch) prints
    what transformers' greedy ``generate`` on the folder gives, decoded by the exported
    tokenizer. Untied: tensorpar's ``generate`` gives the same token ids."""
    model, tok, _, _ = loaded["tied"]
    texts = [tok.decode(_hf_greedy(model, tok, p)) for p in PROMPTS]
    assert runs["cli_text"] == f"{texts[0]}\n--- 2\n{texts[1]}\n"
    model, tok, _, _ = loaded["untied"]
    gpt = dense_gpt(runs["untied"][0])
    for prompt in PROMPTS:
        ids = torch.tensor([ByteTokenizer().encode(prompt)])
        assert generate(gpt, ids, NEW_TOKENS)[0].tolist() == _hf_greedy(model, tok, prompt)


def test_tokenizer_maps_text_to_its_bytes(loaded):
    """The exported tokenizer gives tensorpar's ids (UTF-8 bytes) with no special token, decodes
    them back, keeps spaces as they are, and decodes any ids as ByteTokenizer does (invalid
    UTF-8 to U+FFFD)."""
    tok, mine = loaded["tied"][1], ByteTokenizer()
    assert len(tok) == 256 and tok.all_special_tokens == []
    for text in ["Hello , world .  x", " a  b ", "don't\n\tstop\x00\x7f", "héllo wörld",
                 "— 日本語 🎉 é", "x" * 300]:
        ids = tok(text)["input_ids"]
        assert ids == mine.encode(text), text
        assert tok.decode(ids) == text
    for ids in [list(range(256)), [0xE6, 0x97], [0xFF, 0x41, 0xC3], [0x80, 0xE2, 0x82, 0x41]]:
        assert tok.decode(ids) == mine.decode(ids), ids


def test_sharded_into_an_empty_folder(runs, loaded, tmp_path):
    """Above --max-shard-size the weights are split into files named by
    model.safetensors.index.json (transformers' own sharding), each under the limit but for a
    tensor larger than it; an existing empty folder is replaced by the export; it loads
    without warning to the same logits."""
    folder = tmp_path / "sharded"
    folder.mkdir()
    rc, stdout, stderr = run_main("export", "--ckpt", runs["tied"][0], "--hf-out", folder,
                                  "--max-shard-size", "30KB")
    assert (rc, stdout, stderr) == (0, f"wrote {folder}\n", "")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted({*index["weight_map"].values()})
    assert len(shards) >= 2 and not (folder / "model.safetensors").exists()
    assert sorted(p.name for p in folder.glob("*.safetensors")) == shards
    model, _, info, messages = load_hf(folder)
    assert messages == [] and all(not v for v in info.values())
    ids = torch.arange(32)[None]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded["tied"][0](ids).logits)
    assert leftovers(tmp_path) == []


def _edit(ckpt, tmp_path, change):
    """A copy of the newest checkpoint of ``ckpt`` with ``change(manifest)`` applied."""
    src = CheckpointReader(ckpt).dir
    dst = tmp_path / "ckpt" / src.name
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    change(manifest)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _corrupt(ckpt, tmp_path):
    f = next(_edit(ckpt, tmp_path, lambda m: None).glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[:-1] + bytes([f.read_bytes()[-1] ^ 1]))
    return f.parent


def _config(**fields):
    return lambda ckpt, tmp: _edit(ckpt, tmp, lambda m: m["config"].update(fields))


BAD = {  # case: (checkpoint given the run and tmp_path, extra flags, the line's start)
    "neither": (None, [], "give one of --out FILE.safetensors (one dense file), --hf-out DIR"),
    "both": (None, ["--out", "x.safetensors", "--hf-out", "hf"], "give one of --out"),
    "shard size with --out": (None, ["--out", "x.safetensors", "--max-shard-size", "1GB"],
                              "--max-shard-size goes with --hf-out"),
    "size without unit": (None, ["--max-shard-size", "5"], "'5': expected a size with its unit"),
    "not empty": (None, ["--hf-out", "full"], "--hf-out full is not empty; name a new or empty"),
    "a file": (None, ["--hf-out", "notes.txt"], "--hf-out notes.txt is a file"),
    "no directory": (None, ["--hf-out", "missing/hf"], "--hf-out missing/hf: directory "),
    "no checkpoint": (lambda ckpt, tmp: tmp / "full", [], "no checkpoint in "),
    "corrupted": (_corrupt, [], "rank00-of01.safetensors is corrupted"),
    "unknown field": (_config(qk_norm=True), [], "model field qk_norm=True has no Llama "
                      "equivalent"),
    "GQA": (_config(n_kv_head=3), [], "model field n_kv_head=3 does not divide n_head=4"),
    "vocabulary": (_config(vocab_size=300), [], "vocab_size=300 (tokenizer 'bytes'): export "
                   "--hf-out writes the byte tokenizer"),
    "shapes": (_config(hidden_dim=64), [], "blocks.0.mlp.gate.weight is (96, 32); its config "
               "makes it (64, 32)"),
    "kind": (lambda ckpt, tmp: _edit(ckpt, tmp, lambda m: m.update(model_kind="whisper")), [],
             "holds a model of kind 'whisper'; export --hf-out writes 'gpt'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line(runs, tmp_path, monkeypatch, case):
    """Exit 2 and one line, ``tensorpar export: ...`` naming the flag or the field, before
    anything is written: no folder, no temporary file, the non-empty folder untouched."""
    make, flags, message = BAD[case]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "full").mkdir()
    for f in ("notes.txt", "full/keep.txt"):
        (tmp_path / f).write_text("mine\n")
    ckpt = runs["tied"][0] if make is None else make(runs["tied"][0], tmp_path)
    if "--hf-out" not in flags and "--out" not in flags and case != "neither":
        flags = ["--hf-out", "hf", *flags]
    rc, stdout, stderr = run_main("export", "--ckpt", ckpt, *flags)
    assert (rc, stdout) == (2, "") and stderr.startswith("tensorpar export: "), stderr
    assert stderr.count("\n") == 1 and message in stderr, stderr
    assert {p.name for p in tmp_path.iterdir()} <= {"ckpt", "full", "notes.txt"}
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    assert leftovers(tmp_path) == []


def test_failed_write_leaves_nothing(runs, tmp_path, monkeypatch):
    """A write that fails after the checks (disk full, here while writing the tokenizer, after
    the weights) is one ValueError naming --hf-out; the half-written temporary folder is gone
    and no target folder appears; a dropout the GPT trained with is named in a note."""
    ckpt = _edit(runs["tied"][0], tmp_path, lambda m: m["config"].update(dropout=0.1))

    def full_disk(folder):
        (folder / "tokenizer.json").write_text("half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "_write_tokenizer", full_disk)
    notes = []
    with pytest.raises(ValueError, match=r"--hf-out .*hf: cannot write it \(No space left"):
        export.export_hf(ckpt, tmp_path / "hf", note=notes.append)
    assert notes == ["the GPT's residual dropout 0.1 has no Llama field; the export has no "
                     "dropout (inference is unchanged)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_every_gpt_field_has_a_llama_answer():
    """The export knows every GPTConfig field: a new field must say how Llama (or, for the MoE
    blocks, Mixtral or Qwen2-MoE) holds it (or be refused by name, as an unknown field is)."""
    assert set(export.LLAMA_FIELDS) | set(export.MOE_FIELDS) == \
        {f.name for f in dataclasses.fields(GPTConfig)}
