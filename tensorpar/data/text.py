"""The training data and a deterministic batch order; nothing to download.

``--data`` (and ``--val-data``) is a UTF-8 text file, tokenized at the start of the run and kept
in memory in the smallest integer type of the vocabulary, or a folder of token shards written by
``tensorpar prepare`` (``shards.py``), memory-mapped. The default corpus is Python's own help text
(``pydoc_data.topics``, about 465 KB of English that ships with every CPython). The GPT's
tokenizer is byte-level UTF-8 (vocabulary 256) unless ``--tokenizer DIR`` names another; a
fine-tuned Hugging Face model brings its own (``train/hf_recipe.py``).

Batches depend only on (seed, step): the corpus is cut into windows of ``seq_len + 1`` tokens, each
epoch visits them in a permutation seeded by (seed, epoch), and step s takes windows
``s*B .. s*B + B - 1`` of that sequence. Every rank of a TP group computes the same batch, a
resumed run continues exactly where it stopped, and the data position is just the step.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from tensorpar.data.chat import is_chat_file, read_examples
from tensorpar.data.shards import TokenShards, ids_hash, update_ids
from tensorpar.data.tokenizer import ByteTokenizer, HFTokenizer, describe, same_tokenizer
from tensorpar.runtime.seeds import derive_seed

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


def check_corpus(path: str | None, tokenizer, seq_len: int, flag: str = "--data") -> None:
    """What the launcher refuses before any rank: a path that is neither a text file nor a shard
    folder of the run's tokenizer, or data shorter than one window of ``seq_len + 1`` tokens."""
    if is_chat_file(path):  # examples: each one read, its errors named by line
        read_examples(path, tokenizer, seq_len, flag)
        return
    if path is not None and Path(path).is_dir():
        n = len(open_shards(path, tokenizer, flag))
        enough = n >= seq_len + 1
    else:
        enough = has_tokens(tokenizer, load_text(path, flag)[0], seq_len + 1)
    if not enough:
        raise ValueError(f"{flag} {path} has fewer than --seq-len {seq_len} + 1 tokens"
                         + (": not one validation window" if flag == "--val-data" else ""))


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
    ever err, the ranks' own count refuses the corpus (``TokenBatches``), as they refuse an id
    outside the vocabulary past the prefix read here (``HFTokenizer.encode``)."""
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


class TokenBatches:
    """Batches of (input, target) windows, (B, T) each, in an order fixed by (seed, step)."""

    def __init__(self, tokens: torch.Tensor | TokenShards, seq_len: int, batch_size: int,
                 seed: int, digest: str | None = None):
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise ValueError(f"the corpus has {len(tokens)} tokens, fewer than --seq-len "
                             f"{seq_len} + 1")
        self._perm: tuple[int, torch.Tensor] | None = None
        self.digest = digest_of(tokens) if digest is None else digest

    @classmethod
    def from_text(cls, text: str, seq_len: int, batch_size: int, seed: int,
                  tokenizer: ByteTokenizer | None = None) -> TokenBatches:
        """tokenizer: anything with ``encode(text) -> ids`` and ``vocab_size`` (default: bytes)."""
        return cls(token_ids(text, tokenizer), seq_len, batch_size, seed)

    def _window_order(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(derive_seed(self.seed, "data-order", epoch))
            # int32 (4 bytes a window; the same permutation as int64's)
            small = torch.int32 if self.windows < 2**31 else torch.int64
            self._perm = (epoch, torch.randperm(self.windows, generator=gen, dtype=small))
        return self._perm[1]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets for ``step``: (B, T) int64 each."""
        rows = []
        for i in range(step * self.batch_size, (step + 1) * self.batch_size):
            w = int(self._window_order(i // self.windows)[i % self.windows])
            rows.append(self.tokens[w * self.seq_len: (w + 1) * self.seq_len + 1])
        chunk = torch.stack(rows).long()  # (B, T + 1)
        return chunk[:, :-1], chunk[:, 1:]

    def epoch_of(self, step: int) -> float:
        return step * self.batch_size / self.windows


class ValidationWindows:
    """The validation data as consecutive, non-overlapping windows of ``seq_len + 1`` tokens, in
    order (no shuffle; the last partial window dropped), so that anyone can recompute the number:
    window i is ``tokens[i * (seq_len + 1): (i + 1) * (seq_len + 1)]``, its first ``seq_len``
    tokens the input and its last ``seq_len`` the targets.

    batches: how many batches of ``batch_size`` windows to use (None: all of them)."""

    def __init__(self, tokens: torch.Tensor | TokenShards, seq_len: int, batch_size: int,
                 batches: int | None = None):
        n = len(tokens) // (seq_len + 1)
        if n < 1:
            raise ValueError(f"the validation data has {len(tokens)} tokens, fewer than "
                             f"--seq-len {seq_len} + 1")
        if batches is not None:
            n = min(n, batches * batch_size)
        self.tokens, self.count, self.width = tokens, n, seq_len + 1
        self.batch_size = batch_size

    def __len__(self) -> int:
        return self.count

    def batches(self, dp: int, dp_rank: int):
        """This dp rank's part of each batch, (inputs, targets), every rank the same number of
        rows: the batch's windows dealt out by ``tensor_split``, a rank with fewer topped up with
        rows whose targets are all ignored (-100), which count for nothing."""
        for start in range(0, self.count, self.batch_size):
            end = min(start + self.batch_size, self.count)
            chunk = self.tokens[start * self.width: end * self.width].long().view(-1, self.width)
            mine = chunk.tensor_split(dp)[dp_rank]
            rows = -(-len(chunk) // dp)  # the largest share
            pad = torch.full((rows - len(mine), self.width), -100, dtype=torch.long)
            mine = torch.cat([mine, pad])
            yield mine[:, :-1].clamp(min=0), mine[:, 1:]
