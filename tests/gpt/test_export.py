"""``tensorpar export`` as a user meets it (``cli.main`` in this process; the README's export
line runs ``python -m tensorpar``): an ``--out`` that cannot be written is one line and exit
status 2, checked before the checkpoint is read, and no temporary file is left anywhere, neither
in the working directory nor next to the target; a write that fails midway removes its temporary
file; a good export is named in a ``wrote`` line and replaces an existing file whole."""

import os
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tensorpar.checkpoint import export
from tensorpar.checkpoint.save import save_checkpoint
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.parallel.ownership import ShardOwnership

from tests_common import leftovers
from tests_common import tensorpar_here as tensorpar


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A one-block GPT saved at TP=1 in this process (no ranks needed at world size 1)."""
    run = tmp_path_factory.mktemp("run")
    model = GPT(GPTConfig(vocab_size=64, n_layer=1, dim=32, n_head=4, n_kv_head=2), seed=0)
    save_checkpoint(run, 3, model, ShardOwnership.gather(model), meta={"config": {}})
    return run


@pytest.mark.parametrize("target,message", [
    (".", "--out . is a directory; name the file to write, e.g. --out model.safetensors"),
    ("gpt.bin", "--out gpt.bin: expected a file name ending in .safetensors"),
    ("missing/gpt.safetensors", "--out missing/gpt.safetensors: directory missing does not "
                                "exist"),
    ("notes.txt/gpt.safetensors", "--out notes.txt/gpt.safetensors: notes.txt is not a "
                                  "directory"),
    ("/proc/gpt.safetensors", "--out /proc/gpt.safetensors: "),  # unwritable, even for root
])
def test_out_that_cannot_be_written(ckpt, tmp_path, target, message):
    """One line naming --out, exit 2, no traceback, no file anywhere (a directory as --out used
    to end in IsADirectoryError and leave the whole export as a hidden .tmp in the cwd)."""
    (tmp_path / "notes.txt").write_text("mine\n")
    out = tensorpar("export", "--ckpt", ckpt, "--out", target, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith(f"tensorpar export: {message}"), out.stderr
    assert out.stderr.count("\n") == 1 and out.stdout == "", out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    near = (tmp_path / target).parent  # the target's directory, where its temporary file goes
    assert leftovers(tmp_path, *[near] * near.is_relative_to(tmp_path)) == []


def test_export_writes_and_replaces(ckpt, tmp_path):
    """The dense weights, named in a ``wrote`` line; a second export replaces the file whole
    (written next to it under a temporary name, then renamed), leaving nothing else."""
    target = tmp_path / "gpt.safetensors"
    target.write_bytes(b"an older export")
    out = tensorpar("export", "--ckpt", ckpt, "--out", "gpt.safetensors", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "wrote gpt.safetensors\n" and out.stderr == ""
    weights = load_file(target)
    assert weights["embed.weight"].shape == (64, 32) and not any("optimizer" in k
                                                                 for k in weights)
    assert sorted(os.listdir(tmp_path)) == ["gpt.safetensors"]


def test_failed_write_leaves_nothing(ckpt, tmp_path, monkeypatch):
    """A write that fails after the checks (disk full) is one ValueError naming --out; the
    partial temporary file is removed and an existing target is left as it was."""
    target = tmp_path / "gpt.safetensors"
    target.write_bytes(b"the previous export")

    def full_disk(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export, "save_file", full_disk)
    with pytest.raises(ValueError, match=r"--out .*gpt.safetensors: cannot write it \(No space"):
        export.export_dense(ckpt, target)
    assert target.read_bytes() == b"the previous export"
    assert sorted(os.listdir(tmp_path)) == ["gpt.safetensors"]


def test_peft_out_of_a_gpt_run_says_it_needs_a_lora_run(ckpt, tmp_path):
    """--peft-out writes a LoRA run's adapters: on the GPT's checkpoint, one line saying so."""
    out = tensorpar("export", "--ckpt", ckpt, "--peft-out", tmp_path / "peft")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "--peft-out writes a LoRA run's adapters (train --hf PATH --lora-rank R): " in \
        out.stderr and "is tensorpar's GPT, which trains every weight" in out.stderr
    assert not (tmp_path / "peft").exists()
