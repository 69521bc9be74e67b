"""Token shards (``tensorpar prepare``) and ``train --data DIR``: the ids are the tokenizer's own
encoding of every document plus one end-of-text each; the shards read as one sequence across
their files; batches over them are those over the same ids in memory, so a run on shards equals
across TP sizes and resumes exactly; and everything a user can get wrong is one line before any
rank starts."""

import json
import shutil

import numpy as np
import pytest
import torch

from tensorpar.data import prepare as prepare_module
from tensorpar.data.packing import TokenBatches
from tensorpar.data.prepare import prepare
from tensorpar.data.shards import TokenShards
from tensorpar.data.text import check_corpus, default_corpus, digest_of
from tensorpar.data.tokenizer import ByteTokenizer, HFTokenizer
from tensorpar.gpt.model import GPTConfig
from tensorpar.train.config import TrainConfig
from tensorpar.train.gpt_recipe import GPTRecipe
from tensorpar.train.loop import train_model_rank

from tests_common import bpe_tokenizer, char_tokenizer, tensorpar_here

TEXT = default_corpus()
MODEL = {"n_layer": 2, "dim": 32, "n_head": 4, "n_kv_head": 2, "hidden_dim": 64,
         "vocab_size": 512}
SEQ, BATCH = 32, 4


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return bpe_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two text files (one with non-ASCII text) and a JSON-lines file (a blank line and an
    empty text among its lines): the documents in the order prepare reads them."""
    root = tmp_path_factory.mktemp("corpus")
    docs = [TEXT[:30_000] + "\nnaïve café ✓ — ünïcode\n", TEXT[30_000:45_000]]
    (root / "a.txt").write_text(docs[0])
    (root / "b.txt").write_text(docs[1])
    lines = [TEXT[45_000 + 500 * i: 45_500 + 500 * i] for i in range(40)]
    with open(root / "c.jsonl", "w") as f:
        for i, text in enumerate(lines):
            f.write(json.dumps({"text": text, "id": i}) + "\n")
            if i == 3:
                f.write("\n" + json.dumps({"text": ""}) + "\n")
    return root, docs + lines


def _expected(tok_dir, docs) -> torch.Tensor:
    """transformers' own encoding of each document, without special tokens, then end-of-text."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    ids = []
    for doc in docs:
        ids += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return torch.tensor(ids)


@pytest.fixture(scope="module")
def shards(tok_dir, corpus, tmp_path_factory):
    root, docs = corpus
    out = tmp_path_factory.mktemp("shards") / "corpus"
    index = prepare([str(root / "*.txt"), str(root / "c.jsonl")], str(tok_dir), str(out),
                    shard_tokens=5_000, progress=False)
    return out, index, _expected(tok_dir, docs)


def test_prepare_writes_the_tokenizers_ids_and_one_end_of_text_per_document(shards, corpus,
                                                                            tok_dir):
    """The shards, read as one sequence, are the tokenizer's own ids of each document followed
    by its end-of-text id; the index counts the documents and tokens of each file; the id type
    follows the vocabulary (512: uint16); the hash is the one the trainer computes of the same
    ids in memory; the folder keeps the tokenizer."""
    out, index, want = shards
    read = TokenShards(out)
    assert len(read) == len(want) == index["tokens"]
    assert torch.equal(read[0:len(read)], want)
    assert len(index["shards"]) == -(-len(want) // 5_000) > 3
    across = slice(4_990, 10_020)  # runs across two shard ends
    assert torch.equal(read[across], want[across])
    assert index["documents"] == len(corpus[1]) == 42  # the blank line and "" left out
    assert [s["documents"] for s in index["sources"]] == [1, 1, 40]
    assert index["dtype"] == "uint16" and read.digest == digest_of(want)
    assert HFTokenizer(read.tokenizer_dir).same_as(HFTokenizer(tok_dir))
    eos = HFTokenizer(read.tokenizer_dir).eos_id
    assert int((want == eos).sum()) == 42 and want[-1] == eos


def test_a_long_text_file_is_encoded_in_pieces_with_the_same_ids(tok_dir, tmp_path,
                                                                monkeypatch):
    """A text file longer than a piece is cut before line breaks that follow a non-space: the
    byte-level BPE tokenizer gives the ids of the whole file."""
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 2_000)
    assert prepare_module.cuts_safely(HFTokenizer(tok_dir))
    text = TEXT[:60_000] + "  \n\n  trailing   spaces \n"
    (tmp_path / "long.txt").write_text(text)
    prepare([str(tmp_path / "long.txt")], str(tok_dir), str(tmp_path / "out"), progress=False)
    read = TokenShards(tmp_path / "out")
    assert torch.equal(read[0:len(read)], _expected(tok_dir, [text]))


def test_batches_over_shards_are_those_over_the_same_ids(shards):
    """(seed, step) -> the same windows, into the second epoch, from the memory map as from the
    ids in memory; the data hash is the same too."""
    out, _, want = shards
    on_disk = TokenBatches(TokenShards(out), SEQ, BATCH, seed=3, digest=TokenShards(out).digest)
    in_memory = TokenBatches(want.to(torch.int32), SEQ, BATCH, seed=3)
    assert on_disk.digest == in_memory.digest
    last = on_disk.windows // BATCH + 2  # into the second epoch
    for step in (0, 1, last - 1, last):
        for a, b in zip(on_disk.batch(step), in_memory.batch(step), strict=True):
            assert torch.equal(a, b)


def _train(out, data, tok_dir, steps, resume_from=None, **flags):
    cfg = TrainConfig(steps=steps, batch_size=BATCH, seq_len=SEQ, warmup_steps=2, out=str(out),
                      save_every=2, seed=5, data=str(data), val_data=str(data), eval_batches=2,
                      **flags)
    return train_model_rank(cfg, GPTRecipe(GPTConfig(**MODEL), str(tok_dir)),
                            resume_from).get("rows")


def _losses(rows):
    """Each step's training loss, and the validation loss (over the shards' first 8 windows)
    after steps 2 and 4."""
    return {r["step"]: r["loss"] for r in rows} | \
        {-r["step"]: r["val_loss"] for r in rows if "val_loss" in r}


@pytest.fixture(scope="module")
def straight(ranks, shards, tok_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    return _losses(ranks(1).run(_train, out, shards[0], tok_dir, 4, tp=1)[0])


def test_training_on_shards_equals_across_tp_and_resumes_exactly(ranks, shards, tok_dir,
                                                                 straight, tmp_path):
    """4 steps at TP=1, at TP=2 (training and validation losses to 1e-6 relative; measured
    7.7e-8), and at TP=2 stopped after step 2 and resumed (equal to the uninterrupted TP=2 run:
    the data position is the step). The stopped run is the TP=2 run's directory as it stood
    after step 2 (its step-2 checkpoint and rows; the warmup's 2 steps take the same learning
    rates whatever the run's length)."""
    tp2 = _losses(ranks(2).run(_train, tmp_path / "tp2", shards[0], tok_dir, 4, tp=2)[0])
    assert sorted(tp2) == sorted(straight) == [-4, -2, 1, 2, 3, 4]
    for step, loss in tp2.items():
        assert abs(loss - straight[step]) <= 1e-6 * straight[step], (step, loss, straight)
    shutil.copytree(tmp_path / "tp2", tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "step-00000004")
    metrics = tmp_path / "cut" / "metrics.jsonl"
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(keepends=True)
                               if json.loads(line)["step"] <= 2))
    resumed = _losses(ranks(2).run(_train, tmp_path / "cut", shards[0], tok_dir, 4,
                                   str(tmp_path / "cut" / "step-00000002"), tp=2)[0])
    assert {s: resumed[s] for s in (3, 4, -4)} == {s: tp2[s] for s in (3, 4, -4)}


def test_data_that_is_not_text_or_shards_is_refused_in_one_line(shards, tok_dir, tmp_path):
    """A folder without an index, a binary file, a shard cut short, shards of another
    tokenizer: each one line naming the path and what was expected."""
    tok = HFTokenizer(tok_dir)
    (tmp_path / "empty").mkdir()
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 4)
    cut = tmp_path / "cut"
    shutil.copytree(shards[0], cut)
    with open(cut / "tokens-00001.bin", "r+b") as f:
        f.truncate(100)
    cases = [(tmp_path / "empty", tok, "a folder without index.json: expected a text file or "
              "a folder of token shards written by tensorpar prepare"),
             (tmp_path / "blob.bin", tok, "not UTF-8 text (byte 0x80 at offset 128)"),
             (cut, tok, "tokens-00001.bin is 100 bytes; the index says 10,000 bytes"),
             (shards[0], ByteTokenizer(), f"was tokenized by {shards[0] / 'tokenizer'} (512 "
              "tokens), not by the run's tokenizer, bytes (256 tokens)"),
             (tmp_path / "nowhere", tok, "no such file or folder")]
    for path, tokenizer, message in cases:
        with pytest.raises(ValueError) as e:
            check_corpus(str(path), tokenizer, SEQ)
        assert message in str(e.value) and str(path) in str(e.value), str(e.value)


def test_prepare_refuses_bad_input_before_reading(tok_dir, corpus, tmp_path):
    """Each refusal is one line naming the file (or flag) and the cause; nothing is left at
    --out."""
    root = corpus[0]
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    no_eos = tmp_path / "no-eos"
    char_tokenizer().save_pretrained(str(no_eos))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    cases = [([str(root / "*.md")], tok_dir, "out1", "matches no file"),
             ([str(root)], tok_dir, "out2", "is a folder: name its files"),
             ([str(tmp_path / "bad.jsonl")], tok_dir, "out3", "line 2: expected an object "
              "with a \"text\" string"),
             ([str(tmp_path / "latin1.txt")], tok_dir, "out4", "not UTF-8 text (byte 0xe9 at 3)"),
             ([str(root / "a.txt")], no_eos, "out5", "has no end-of-text token"),
             ([str(root / "a.txt")], tok_dir, "taken", "exists: choose another folder"),
             ([str(root / "a.txt")], tmp_path / "nothing", "out6", "not a tokenizer folder")]
    for files, tok, out, message in cases:
        with pytest.raises(ValueError) as e:
            prepare(files, str(tok), str(tmp_path / out), progress=False)
        assert message in str(e.value), str(e.value)
        assert out == "taken" or not (tmp_path / out).exists()


def test_prepare_command_says_what_it_wrote(tok_dir, corpus, tmp_path):
    """The command's last line counts documents and tokens and gives the speed; a refusal is
    one line and exit status 2."""
    root = corpus[0]
    done = tensorpar_here("prepare", str(root / "b.txt"), str(root / "c.jsonl"),
                          "--tokenizer", str(tok_dir), "--out", str(tmp_path / "s"))
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "s" / "index.json").read_text())
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"tensorpar prepare: wrote {tmp_path / 's'}: 41 documents, "
                           f"{index['tokens']:,} tokens (uint16, 1 shard) from 2 files in "), last
    assert last.endswith(" tokens/s"), last
    refused = tensorpar_here("prepare", str(root / "b.txt"), "--tokenizer", str(tok_dir),
                             "--out", str(tmp_path / "s"))
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"tensorpar prepare: --out {tmp_path / 's'} exists: choose another folder, or remove "
        "it"]
    assert np.fromfile(tmp_path / "s" / "tokens-00000.bin", dtype="<u2").size == index["tokens"]


def _resolve(model=None, tokenizer=None, hf=None, **train):
    import dataclasses

    from tensorpar.train.run import resolve

    return resolve({f.name: None for f in dataclasses.fields(TrainConfig)} | train,
                   {f.name: None for f in dataclasses.fields(GPTConfig)} | (model or {}),
                   hf, tokenizer)


def test_the_gpts_tokenizer(shards, tok_dir, tmp_path, ranks):
    """--tokenizer sets the vocabulary (a larger --vocab-size is allowed, a smaller one refused);
    shards without --tokenizer give theirs; a resumed run keeps the run's copy and refuses
    another; --hf takes none."""
    small = {"n_layer": 1, "dim": 32, "n_head": 4, "n_kv_head": 2}
    text = tmp_path / "text.txt"
    text.write_text(TEXT[:5_000])
    _, recipe, _ = _resolve(small, str(tok_dir), data=str(text), out=str(tmp_path / "a"))
    assert recipe.model_cfg.vocab_size == 512 and recipe.tokenizer_dir == str(tok_dir)
    _, recipe, _ = _resolve(small | {"vocab_size": 520}, str(tok_dir), data=str(text),
                            out=str(tmp_path / "a"))
    assert recipe.model_cfg.vocab_size == 520
    with pytest.raises(ValueError, match="--vocab-size 500: the tokenizer, .* needs 512 or more"):
        _resolve(small | {"vocab_size": 500}, str(tok_dir), data=str(text),
                 out=str(tmp_path / "a"))
    _, recipe, _ = _resolve(small, data=str(shards[0]), out=str(tmp_path / "a"))
    assert recipe.tokenizer_dir == str(shards[0] / "tokenizer")
    with pytest.raises(ValueError, match="--tokenizer is the GPT's"):
        _resolve(None, str(tok_dir), hf=str(tmp_path), out=str(tmp_path / "a"))
    out = tmp_path / "run"
    cfg, recipe, _ = _resolve(small, data=str(shards[0]), out=str(out), tp=1, steps=1,
                              seq_len=SEQ, batch_size=BATCH)
    ranks(1).run(train_model_rank, cfg, recipe, None)
    _, resumed, _ = _resolve(resume=True, steps=2, out=str(out))
    assert resumed.tokenizer_dir == str(out / "tokenizer")
    other = tmp_path / "other"
    bpe_tokenizer(other, vocab_size=300)
    with pytest.raises(ValueError, match="is not the tokenizer of the run being resumed"):
        _resolve(None, str(other), resume=True, steps=2, out=str(out))


def test_a_tokenizer_that_cuts_unsafely_gets_whole_documents(tmp_path, monkeypatch):
    """A sentencepiece-style tokenizer (a prefix space on every text it encodes) fails the cut
    probes, so prepare encodes each document whole: its own ids, however small the pieces."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Metaspace(prepend_scheme="always")
    tok.train_from_iterator([TEXT[:50_000]], trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "</s>"], show_progress=False))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(tmp_path / "sp")
    assert not prepare_module.cuts_safely(HFTokenizer(tmp_path / "sp"))
    monkeypatch.setattr(prepare_module, "PIECE_CHARS", 2_000)
    text = TEXT[:20_000]
    (tmp_path / "doc.txt").write_text(text)
    prepare([str(tmp_path / "doc.txt")], str(tmp_path / "sp"), str(tmp_path / "out"),
            progress=False)
    read = TokenShards(tmp_path / "out")
    assert torch.equal(read[0:len(read)], _expected(tmp_path / "sp", [text]))
