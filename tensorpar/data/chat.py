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
confined to it (``packing.ExampleBatches``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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
