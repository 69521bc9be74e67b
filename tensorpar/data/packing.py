"""How tokens become batches, in an order fixed by (seed, step): text cut into windows, and
chat or instruction examples one a row or packed; and the validation data in its own order.

Text (``TokenBatches``): the corpus (``text.py``; a shard folder reads the same) is cut into
windows of ``seq_len + 1`` tokens, each epoch visits them in a permutation seeded by (seed,
epoch), and step s takes windows ``s*B .. s*B + B - 1`` of that sequence. Examples
(``ExampleBatches``, of ``chat.py``): the same order over the examples; a row is one example
padded on the right, or with ``--pack`` as many consecutive examples as fit. Every rank of a TP
group computes the same batch, a resumed run continues exactly where it stopped, and the data
position is just the step.
"""

from __future__ import annotations

import hashlib
import json

import torch

from tensorpar.data.chat import IGNORE_INDEX, Examples
from tensorpar.data.shards import TokenShards
from tensorpar.data.text import digest_of, token_ids
from tensorpar.data.tokenizer import ByteTokenizer
from tensorpar.runtime.seeds import derive_seed


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


class ExampleBatches:
    """Batches of (input, target, positions), (B, T) each: examples in an order fixed by
    (seed, epoch), the targets ``IGNORE_INDEX`` but at answer tokens. Unpacked, a row is one
    example padded on the right; packed (``pack``), a row holds the next examples of the order
    that fit, each with positions from 0 (a model given those positions confines attention to
    each example: transformers builds a block-diagonal causal mask from positions that restart),
    the rest padding. Every example's predictions are those it has alone."""

    def __init__(self, examples: Examples, seq_len: int, batch_size: int, seed: int,
                 pad_id: int = 0, pack: bool = False):
        self.examples, self.seq_len, self.batch_size = examples, seq_len, batch_size
        self.seed, self.pad_id, self.pack = seed, pad_id, pack
        self.windows = len(examples.ids)  # as TokenBatches: the units an epoch visits
        h = hashlib.sha256()
        for ids, trained in zip(examples.ids, examples.trained, strict=True):
            h.update(json.dumps([ids, trained]).encode())
        self.digest = h.hexdigest()[:16]
        self.tokens = None  # nothing of the corpus the memory meter counts beyond the lists
        # each example's inputs and targets, made once (a step only copies them into its rows)
        self._pairs = []
        for ids, trained in zip(examples.ids, examples.trained, strict=True):
            ids, trained = torch.tensor(ids), torch.tensor(trained)
            self._pairs.append((ids[:-1], torch.where(trained[1:], ids[1:], IGNORE_INDEX)))
        self._perm: tuple[int, torch.Tensor] | None = None
        self._rows: list[list[list[int]]] = []  # packed: each epoch's rows of example indices

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(derive_seed(self.seed, "data-order", epoch))
            self._perm = (epoch, torch.randperm(self.windows, generator=gen))
        return self._perm[1]

    def _epoch_rows(self, epoch: int) -> list[list[int]]:
        """Epoch ``epoch``'s rows: its order's examples, greedily, as many as fit a row."""
        while len(self._rows) <= epoch:
            rows, row, used = [], [], 0
            for e in self._order(len(self._rows)).tolist():
                n = len(self.examples.ids[e]) - 1  # the positions it fills
                if row and used + n > self.seq_len:
                    rows.append(row)
                    row, used = [], 0
                row.append(e)
                used += n
            rows.append(row)
            self._rows.append(rows)
        return self._rows[epoch]

    def _row(self, i: int) -> list[int]:
        """The examples of row ``i`` counted from the start of training."""
        if not self.pack:
            return [int(self._order(i // self.windows)[i % self.windows])]
        epoch = 0
        while i >= len(self._epoch_rows(epoch)):
            i -= len(self._epoch_rows(epoch))
            epoch += 1
        return self._epoch_rows(epoch)[i]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T = self.batch_size, self.seq_len
        x = torch.full((B, T), self.pad_id, dtype=torch.long)
        y = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        pos = torch.zeros((B, T), dtype=torch.long)
        for r in range(B):
            at = 0
            for e in self._row(step * B + r):
                inputs, targets = self._pairs[e]
                n = len(inputs)
                x[r, at:at + n] = inputs
                y[r, at:at + n] = targets
                pos[r, at:at + n] = torch.arange(n)
                at += n
            pos[r, at:] = torch.arange(T - at)  # the padding: a block of its own
        return x, y, pos

    def epoch_of(self, step: int) -> float:
        if not self.pack:
            return step * self.batch_size / self.windows
        rows, epoch = step * self.batch_size, 0
        while rows >= len(self._epoch_rows(epoch)):
            rows -= len(self._epoch_rows(epoch))
            epoch += 1
        return epoch + rows / len(self._epoch_rows(epoch))


class ValidationExamples:
    """Chat or instruction examples as validation data (``--val-data FILE.jsonl``): in the file's
    order, one example a row padded on the right to ``seq_len``, ``batch_size`` rows a batch (the
    first ``batches`` batches; None: all). The validation loss is then the mean over the answer
    tokens, as training's."""

    def __init__(self, examples: Examples, seq_len: int, batch_size: int,
                 batches: int | None = None, pad_id: int = 0):
        rows = ExampleBatches(examples, seq_len, 1, 0, pad_id)._pairs
        self.rows = rows if batches is None else rows[:batches * batch_size]
        self.seq_len, self.batch_size, self.pad_id = seq_len, batch_size, pad_id

    def __len__(self) -> int:
        return len(self.rows)

    def batches(self, dp: int, dp_rank: int):
        """This dp rank's part of each batch, (inputs, targets), every rank the same number of
        rows (as ``ValidationWindows``: a rank with fewer has rows that count for
        nothing)."""
        for start in range(0, len(self.rows), self.batch_size):
            chunk = self.rows[start:start + self.batch_size]
            share = -(-len(chunk) // dp)  # the largest share
            mine = [chunk[i] for i in torch.arange(len(chunk)).tensor_split(dp)[dp_rank]]
            x = torch.full((share, self.seq_len), self.pad_id, dtype=torch.long)
            y = torch.full((share, self.seq_len), IGNORE_INDEX, dtype=torch.long)
            for r, (inputs, targets) in enumerate(mine):
                x[r, :len(inputs)], y[r, :len(targets)] = inputs, targets
            yield x, y
