"""The training text, read and tokenized; nothing to download.

``--data`` (and ``--val-data``) is a UTF-8 text file, tokenized at the start of the run and kept
in memory in the smallest integer type of the vocabulary, or a folder of token shards written by
``tensorpar prepare`` (``shards.py``), memory-mapped. The default corpus is Python's own help text
(``pydoc_data.topics``, about 465 KB of English that ships with every CPython). The GPT's
tokenizer is byte-level UTF-8 (vocabulary 256) unless ``--tokenizer DIR`` names another; a
fine-tuned Hugging Face model brings its own (``train/hf_recipe.py``).

How the tokens become batches: ``packing.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from tensorpar.data.chat import Examples, is_chat_file, read_examples
from tensorpar.data.formats import check_not_json_examples, example_keys
from tensorpar.data.shards import TokenShards, ids_hash, update_ids
from tensorpar.data.tokenizer import ByteTokenizer, HFTokenizer, describe, same_tokenizer

EXPECTED = "expected a UTF-8 text file or a folder of token shards written by tensorpar prepare"


def default_corpus() -> str:
    """Python's help topics, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def load_text(path: str | None, flag: str = "--data") -> tuple[str, str]:
    """The corpus text and a label for it (the file path, or ``pydoc_data``). flag: the option
    that named the file, for the error."""
    if path is None:
        return default_corpus(), "pydoc_data"
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path} is a folder: {EXPECTED}")
    if not p.is_file():
        raise ValueError(f"{flag} {path}: no such file or folder")
    raw = p.read_bytes()
    try:
        return raw.decode("utf-8"), str(p)
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path}: not UTF-8 text (byte {raw[e.start]:#04x} at offset "
                         f"{e.start:,}): {EXPECTED}") from None


class Corpus(NamedTuple):
    """Token ids (a tensor, or memory-mapped ``TokenShards``: either sliced ``tokens[a:b]``), a
    label for them (the path, or ``pydoc_data``) and a hash of the ids."""

    tokens: torch.Tensor | TokenShards
    label: str
    digest: str


def read_corpus(path: str | None, tokenizer, flag: str = "--data") -> Corpus:
    """``--data`` (or ``--val-data``, by ``flag``): a text file tokenized by ``tokenizer``, or a
    shard folder, memory-mapped, whose tokenizer must be ``tokenizer``."""
    if path is not None and Path(path).is_dir():
        shards = open_shards(path, tokenizer, flag)
        return Corpus(shards, str(path), shards.digest)
    text, label = load_text(path, flag)
    ids = token_ids(text, tokenizer)
    return Corpus(ids, label, digest_of(ids))


def open_shards(path: str, tokenizer, flag: str = "--data") -> TokenShards:
    """The shard folder ``path``, checked against the run's tokenizer: the same ids for every
    text (the folder keeps a copy of the tokenizer it was written with)."""
    shards = TokenShards(path, flag)
    theirs = HFTokenizer(shards.tokenizer_dir, flag=flag)
    if not same_tokenizer(tokenizer, theirs):
        raise ValueError(f"{flag} {path} was tokenized by {describe(theirs)}, not by the run's "
                         f"tokenizer, {describe(tokenizer)}: prepare it with the run's tokenizer")
    return shards


def check_corpus(path: str | None, tokenizer, seq_len: int, flag: str = "--data",
                 skip_bad: bool = False) -> Examples | None:
    """What the launcher refuses before any rank: a path that is neither a text file nor a shard
    folder of the run's tokenizer, or data shorter than one window of ``seq_len + 1`` tokens.
    Examples (a JSON-lines file) are each read, a malformed one named by its line (skipped with
    ``skip_bad``), and returned."""
    if is_chat_file(path):
        return read_examples(path, tokenizer, seq_len, flag, skip_bad)
    check_not_json_examples(path, flag)
    if path is not None and Path(path).is_dir():
        n = len(open_shards(path, tokenizer, flag))
        enough = n >= seq_len + 1
    else:
        enough = has_tokens(tokenizer, load_text(path, flag)[0], seq_len + 1)
    if not enough:
        raise ValueError(f"{flag} {path} has fewer than --seq-len {seq_len} + 1 tokens"
                         + (": not one validation window" if flag == "--val-data" else ""))
    return None


def overlap_warning(data: str | None, val_data: str | None) -> str | None:
    """A warning when the validation data is (partly) the training data: the same file, the
    same bytes, or examples found in both; None otherwise."""
    if val_data is None:
        return None
    train, val = Path(data) if data is not None else None, Path(val_data)
    if train is not None and train.exists() and val.exists():
        if train.resolve() == val.resolve() or (train.is_file() and val.is_file() and
                                                train.read_bytes() == val.read_bytes()):
            return (f"--val-data {val_data} is the --data file: the validation loss is the "
                    "training data's, not held-out data's")
        if is_chat_file(data) and is_chat_file(val_data):
            theirs, ours = example_keys(data), example_keys(val_data, "--val-data")
            if shared := len(theirs & ours):
                return (f"{shared} of the {len(ours)} --val-data examples are also in --data "
                        f"{data}: the validation loss is not all held-out data's")
    return None


def digest_of(ids: torch.Tensor) -> str:
    """The hash of the ids as int64, read a chunk at a time (bounded memory); a shard folder's
    index holds the same hash of its ids."""
    h = ids_hash()
    update_ids(h, ids.numpy())
    return h.hexdigest()[:16]


def has_tokens(tokenizer, text: str, n: int) -> bool:
    """Whether ``text`` holds at least ``n`` tokens, tokenizing no more of it than it takes (the
    launcher's check of ``--data``, before the ranks tokenize the whole): bytes are counted;
    another tokenizer reads prefixes 4 times longer each time, and a prefix with 8 tokens to
    spare settles it (cutting a text changes only its last few tokens). Where that rule would
    ever err, the ranks' own count refuses the corpus (``packing.TokenBatches``), as they
    refuse an id outside the vocabulary past the prefix read here (``HFTokenizer.encode``)."""
    if isinstance(tokenizer, ByteTokenizer):
        return len(text.encode("utf-8")) >= n
    size = 16 * (n + 8)  # characters
    while size < len(text):
        if len(tokenizer.encode(text[:size])) >= n + 8:
            return True
        size *= 4
    return len(tokenizer.encode(text)) >= n


def token_dtype(vocab_size: int) -> torch.dtype:
    """The smallest dtype holding the ids 0 .. vocab_size - 1, for the corpus kept in memory."""
    if vocab_size <= 2**8:
        return torch.uint8
    return torch.uint16 if vocab_size <= 2**16 else torch.int32  # GPT-2's 50257: 2 bytes


def token_ids(text: str, tokenizer=None) -> torch.Tensor:
    """``text`` as token ids, in the smallest integer type of the vocabulary (bytes: uint8, an
    eighth of int64; batches come out int64). tokenizer: anything with ``encode(text) -> ids``
    and ``vocab_size`` (default: bytes). Bytes are read as they are: a list of ints is 8 bytes a
    token and seconds a 50 MB corpus (0.7 GB and 2.9 s, against 0.06 s)."""
    tok = tokenizer or ByteTokenizer()
    if isinstance(tok, ByteTokenizer):
        data = bytearray(text.encode("utf-8"))
        return torch.frombuffer(data, dtype=torch.uint8) if data else \
            torch.empty(0, dtype=torch.uint8)
    return torch.tensor(tok.encode(text), dtype=token_dtype(tok.vocab_size))
