"""Chat and instruction data: JSON lines of examples, each trained on its answer alone.

A ``--data`` file ending in ``.jsonl`` (or ``.ndjson``) is read as examples, one a line, in any
form ``formats.py`` recognises (chat ``messages``, ``prompt`` / ``completion``, ShareGPT,
Alpaca); a record it refuses stops the run naming its line, or with ``--skip-bad-examples`` is
skipped and counted::

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

import dataclasses
from dataclasses import dataclass

from tensorpar.data.formats import BadExample, is_json_lines, read_record, records

IGNORE_INDEX = -100  # a target that counts for no loss (the losses' ignore_index)


def is_chat_file(path: str | None) -> bool:
    """Whether ``path`` is a JSON-lines file, read as examples (``formats.py``)."""
    return is_json_lines(path)


@dataclass
class Examples:
    """Tokenized examples: ``ids[i]`` and ``trained[i]`` (True where the loss counts), and the
    counts of the length policy."""

    ids: list[list[int]]
    trained: list[list[bool]]
    truncated: int = 0
    dropped: int = 0
    masking: str = ""  # how the answers were found: "template mask", "prefix", "completion"
    forms: tuple = ()  # the file forms read (formats.Example.form), in order of first use
    skipped: list = dataclasses.field(default_factory=list)  # the malformed records' errors


def read_examples(path: str, tokenizer, seq_len: int, flag: str = "--data",
                  skip_bad: bool = False) -> Examples:
    """The examples of ``path``, tokenized by ``tokenizer`` (an ``HFTokenizer``), each cut to
    ``seq_len`` + 1 tokens (see the module docstring). A malformed record (``formats.py``)
    raises its ``BadExample``, naming the line; with ``skip_bad`` it is skipped and counted."""
    tok = getattr(tokenizer, "tok", None)
    if tok is None:
        raise ValueError(f"{flag} {path}: chat and instruction examples need a Hugging Face "
                         "tokenizer (train --hf, or the GPT with --tokenizer DIR)")
    out = Examples([], [])
    for n, record in records(path, flag):
        try:
            if isinstance(record, BadExample):
                raise record
            ids, trained, how, form = _tokenized(tok, record, f"{flag} {path} line {n}")
        except BadExample as e:
            if not skip_bad:
                raise
            out.skipped.append(str(e))
            continue
        out.masking = out.masking or how
        out.forms += (form,) * (form not in out.forms)
        if len(ids) > seq_len + 1:
            ids, trained = ids[:seq_len + 1], trained[:seq_len + 1]
            if not any(trained[1:]):
                out.dropped += 1
                continue
            out.truncated += 1
        out.ids.append(ids)
        out.trained.append(trained)
    if not out.ids:
        skipped = f" ({len(out.skipped)} malformed, skipped)" if out.skipped else ""
        raise ValueError(f"{flag} {path}: no example with an answer to train on{skipped}")
    return out


def _tokenized(tok, record, where: str) -> tuple[list[int], list[bool], str, str]:
    """A record's ids, which of them are trained, how the answer was found, and its form."""
    example = read_record(record, where)
    if example.messages is None:
        return *_completion(tok, example.prompt, example.completion), example.form
    if tok.chat_template is None:
        what = "messages" if example.form == "messages" else f"{example.form} records"
        raise ValueError(f"{where}: the tokenizer has no chat template for {what}")
    try:
        ids, trained, how = _conversation(tok, list(example.messages), where)
    except ValueError:
        raise
    except Exception as e:  # the template's own refusal (jinja's TemplateError): this record's
        raise BadExample(f"{where}: the chat template refused it: {e}") from None
    if not any(trained[1:]):
        raise BadExample(f"{where}: the chat template renders no assistant token")
    return ids, trained, how, example.form


def _completion(tok, prompt: str, completion: str) -> tuple[list[int], list[bool], str]:
    head = tok(prompt)["input_ids"]
    tail = tok(completion, add_special_tokens=False)["input_ids"]
    if tok.eos_token_id is not None:
        tail = tail + [tok.eos_token_id]
    return head + tail, [False] * len(head) + [True] * len(tail), "completion"


def _conversation(tok, messages: list, where: str) -> tuple[list[int], list[bool], str]:
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
    n = len(examples.ids)
    converted = [f for f in examples.forms if f in ("ShareGPT", "Alpaca")]
    read_as = f"; {' and '.join(converted)} read as messages" if converted else ""
    line = f"{n:,} example{'s' * (n != 1)} (answers by {examples.masking}{read_as})"
    if examples.skipped:
        k = len(examples.skipped)
        line += f"; {k} malformed skipped (--skip-bad-examples), the first: {examples.skipped[0]}"
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
