"""Chat and instruction data: JSON lines of examples, each trained on its answer alone.

A ``--data`` file ending in ``.jsonl`` whose first record has ``"messages"`` or ``"prompt"`` is
read as examples, one a line (otherwise a ``.jsonl`` file is plain text)::

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
    {"prompt": "Translate: chat", "completion": " cat"}

- ``messages`` are rendered with the tokenizer's chat template. The loss is on the assistant's
  tokens only: where the template marks them (``{% generation %}``), the tokenizer's own mask
  (``apply_chat_template(..., return_assistant_tokens_mask=True)``); otherwise each assistant
  message is the difference between the conversation rendered up to it with the generation
  prompt and rendered through it (a template for which that is not a prefix is refused).
- ``prompt`` / ``completion``: the prompt's ids (with the tokenizer's own special tokens, a BOS
  where it adds one), then the completion's and an end-of-text id; the loss is on the completion
  and the end-of-text.

Every other position is ignored (-100) through the vocab-parallel loss, and a step's loss is the
mean over the step's answer tokens (also under gradient accumulation: ``loop.Run.step``).

Each example is at most ``--seq-len`` + 1 tokens: a longer one is cut to that length (its answer
may lose its end), and counted; an example whose answer would lose every token is dropped, and
counted. Batches are ``--batch-size`` rows, in an order seeded by (seed, epoch) as the windows
of text, so a resumed run continues exactly: a row is one example padded on the right to
``--seq-len`` (the padding ignored; causal attention never lets a real token see it), or with
``--pack`` as many consecutive examples as fit, positions restarting at each and attention
confined to it (``ExampleBatches``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tensorpar.runtime.seeds import derive_seed

IGNORE_INDEX = -100  # a target that counts for no loss (the losses' ignore_index)


def is_chat_file(path: str | None) -> bool:
    """Whether ``path`` is a JSON-lines file of examples (its first record has ``messages`` or
    ``prompt``)."""
    if path is None or not str(path).endswith(".jsonl") or not Path(path).is_file():
        return False
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(record, dict) and ("messages" in record or "prompt" in record)
    return False


@dataclass
class Examples:
    """Tokenized examples: ``ids[i]`` and ``trained[i]`` (True where the loss counts), and the
    counts of the length policy."""

    ids: list[list[int]]
    trained: list[list[bool]]
    truncated: int = 0
    dropped: int = 0
    masking: str = ""  # how the answers were found: "template mask", "prefix", "completion"


def read_examples(path: str, tokenizer, seq_len: int, flag: str = "--data") -> Examples:
    """The examples of ``path``, tokenized by ``tokenizer`` (an ``HFTokenizer``), each cut to
    ``seq_len`` + 1 tokens (see the module docstring). ValueError, naming the line, for a record
    that is neither form."""
    tok = getattr(tokenizer, "tok", None)
    if tok is None:
        raise ValueError(f"{flag} {path}: chat and instruction examples need a Hugging Face "
                         "tokenizer (train --hf, or the GPT with --tokenizer DIR)")
    out = Examples([], [])
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{flag} {path} line {n}: not JSON ({e})") from None
            if isinstance(record, dict) and isinstance(record.get("messages"), list):
                ids, trained, how = _conversation(tok, record["messages"], f"{path} line {n}")
            elif isinstance(record, dict) and isinstance(record.get("prompt"), str) and \
                    isinstance(record.get("completion"), str):
                ids, trained, how = _completion(tok, record["prompt"], record["completion"])
            else:
                raise ValueError(f"{flag} {path} line {n}: expected {{\"messages\": [...]}} or "
                                 "{\"prompt\": ..., \"completion\": ...}")
            out.masking = out.masking or how
            if len(ids) > seq_len + 1:
                ids, trained = ids[:seq_len + 1], trained[:seq_len + 1]
                if not any(trained[1:]):
                    out.dropped += 1
                    continue
                out.truncated += 1
            if any(trained[1:]):
                out.ids.append(ids)
                out.trained.append(trained)
    if not out.ids:
        raise ValueError(f"{flag} {path}: no example with an answer to train on")
    return out


def _completion(tok, prompt: str, completion: str) -> tuple[list[int], list[bool], str]:
    head = tok(prompt)["input_ids"]
    tail = tok(completion, add_special_tokens=False)["input_ids"]
    if tok.eos_token_id is not None:
        tail = tail + [tok.eos_token_id]
    return head + tail, [False] * len(head) + [True] * len(tail), "completion"


def _conversation(tok, messages: list, where: str) -> tuple[list[int], list[bool], str]:
    if tok.chat_template is None:
        raise ValueError(f"{where}: the tokenizer has no chat template for \"messages\"")
    if "{% generation %}" in tok.chat_template or "{%- generation %}" in tok.chat_template:
        rendered = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
        return list(rendered["input_ids"]), [bool(m) for m in rendered["assistant_masks"]], \
            "template mask"
    ids = _render(tok, messages, False)
    trained = [False] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tok, messages[:i], True)
        through = _render(tok, messages[:i + 1], False)
        if ids[:len(before)] != before or ids[:len(through)] != through:
            raise ValueError(f"{where}: the chat template does not render a conversation's "
                             "start as a prefix of the whole, so the assistant's tokens cannot "
                             "be found; use a template with {% generation %} marks")
        trained[len(before):len(through)] = [True] * (len(through) - len(before))
    return ids, trained, "prefix"


def _render(tok, messages: list, generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        add_generation_prompt=generation_prompt)["input_ids"])


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
        rows (as ``data.ValidationWindows``: a rank with fewer has rows that count for
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


def describe_examples(examples: Examples, seq_len: int) -> str:
    """The summary's line on the examples: how many, how the answers were found, the policy's
    counts."""
    line = f"{len(examples.ids):,} examples (answers by {examples.masking})"
    if examples.truncated or examples.dropped:
        line += (f"; longer than --seq-len {seq_len} + 1: {examples.truncated} cut, "
                 f"{examples.dropped} dropped (no answer token left)")
    return line


def pad_id(tokenizer) -> int:
    """The id right padding uses (never trained on, never attended to by a real token)."""
    tok = getattr(tokenizer, "tok", None)
    for candidate in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None)):
        if candidate is not None:
            return candidate
    return 0
