"""The records of a JSON-lines ``--data`` file, recognised and checked: each one becomes a
conversation (``messages``) or a prompt and its completion, or is refused naming its line.

Four forms are read; two are converted where the mapping is the usual one:

- chat: ``{"messages": [{"role": "user", "content": "..."}, ...]}``, roles system, user,
  assistant or tool, each content a string, an assistant's not empty, at least one assistant;
- prompt and completion: ``{"prompt": "...", "completion": "..."}``, the completion not empty;
- ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...]}``, ``from`` human,
  gpt or system (user and assistant too), read as messages of roles user, assistant, system;
- Alpaca: ``{"instruction": "...", "input": "...", "output": "..."}`` (``input`` optional), read
  as a user message (the instruction, then a blank line and the input when there is one) and an
  assistant message (the output).

A record in none of these forms, or one that breaks its form's rules, raises ``BadExample``
naming the line and what was expected; ``train --skip-bad-examples`` skips such records instead,
and the summary counts them. A file of ``{"text"}`` documents is not examples: ``tensorpar
prepare`` turns it into token shards. A ``.json`` file holding examples (a list, as Alpaca's
own file) is refused rather than read as text: written one a line as ``.jsonl`` it is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

JSON_LINES = (".jsonl", ".ndjson")
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
FORMS = ('{"messages": [{"role", "content"}, ...]}, {"prompt", "completion"}, ShareGPT\'s '
         '{"conversations": [{"from", "value"}, ...]} or Alpaca\'s {"instruction", "input", '
         '"output"}')


class BadExample(ValueError):
    """A record that is not a well-formed example: its message names the line."""


@dataclass(frozen=True)
class Example:
    """One record, read: a conversation (``messages``), or a ``prompt`` and its
    ``completion``; ``form`` says which of the file forms it came in."""

    form: str  # "messages", "prompt/completion", "ShareGPT", "Alpaca"
    messages: tuple | None = None  # ({"role", "content"}, ...), for the chat template
    prompt: str | None = None
    completion: str | None = None

    def key(self) -> str:
        """The example's content, for finding the same example in two files."""
        if self.messages is not None:
            return json.dumps([[m["role"], m["content"]] for m in self.messages])
        return json.dumps([self.prompt, self.completion])


def is_json_lines(path: str | None) -> bool:
    """Whether ``path`` is a file named as JSON lines (``.jsonl``, ``.ndjson``): read as
    examples, never as text."""
    return path is not None and str(path).lower().endswith(JSON_LINES) and Path(path).is_file()


def records(path: str, flag: str = "--data"):
    """(line number, the record, or the ``BadExample`` of a line that is not JSON) for each
    non-empty line; a file of ``{"text"}`` documents is refused whole (ValueError)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        first = True
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                yield n, BadExample(f"{flag} {path} line {n}: not JSON ({e})")
                continue
            if first and isinstance(record, dict) and "text" in record and \
                    not any(k in record for k in ("messages", "prompt", "conversations",
                                                  "instruction")):
                raise ValueError(f"{flag} {path} line {n}: a {{\"text\"}} document, not an "
                                 f"example (train reads JSON lines as examples: {FORMS}); to "
                                 "train on documents, tokenize them with tensorpar prepare and "
                                 "pass its folder")
            first = False
            yield n, record


def read_record(record, where: str) -> Example:
    """``record`` (a parsed line) as an ``Example``; ``BadExample`` naming ``where`` (the file
    and line) and what was expected otherwise."""
    if not isinstance(record, dict):
        raise BadExample(f"{where}: a JSON {type(record).__name__}, expected an object: {FORMS}")
    if "messages" in record:
        return Example("messages", messages=_messages(record["messages"], where))
    if "conversations" in record:
        return Example("ShareGPT", messages=_sharegpt(record["conversations"], where))
    if "prompt" in record or "completion" in record:
        prompt, completion = (_string(record, k, where) for k in ("prompt", "completion"))
        _answer(completion, "the completion", where)
        return Example("prompt/completion", prompt=prompt, completion=completion)
    if "instruction" in record or "output" in record:
        instruction, output = (_string(record, k, where) for k in ("instruction", "output"))
        extra = record.get("input") or ""
        if not isinstance(extra, str):
            raise BadExample(f"{where}: \"input\" is a {type(extra).__name__}, expected a string")
        _answer(output, "the output", where)
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        return Example("Alpaca", messages=({"role": "user", "content": user},
                                           {"role": "assistant", "content": output}))
    keys = ", ".join(f'"{k}"' for k in list(record)[:6]) or "none"
    raise BadExample(f"{where}: keys {keys}: expected {FORMS}")


def _string(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        got = "no" if value is None else f"a {type(value).__name__} for"
        raise BadExample(f"{where}: {got} \"{key}\", expected a string")
    return value


def _answer(text: str, what: str, where: str) -> None:
    if not text.strip():
        raise BadExample(f"{where}: {what} is empty: nothing to train on")


def _messages(messages, where: str) -> tuple:
    if not isinstance(messages, list) or not messages:
        raise BadExample(f"{where}: \"messages\" is {'empty' if messages == [] else 'not a list'}"
                         ": expected a list of {\"role\", \"content\"}")
    out = []
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            raise BadExample(f"{where}: message {i} is not an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise BadExample(f"{where}: message {i} has role {json.dumps(role)}: expected "
                             f"{', '.join(ROLES[:-1])} or {ROLES[-1]}")
        if not isinstance(content, str):
            got = "no" if content is None else f"a {type(content).__name__}"
            raise BadExample(f"{where}: message {i} ({role}) has {got} \"content\", expected a "
                             "string")
        if role == "assistant":
            _answer(content, f"message {i} (assistant)", where)
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise BadExample(f"{where}: no assistant message: nothing to train on")
    return tuple(out)


def _sharegpt(turns, where: str) -> tuple:
    if not isinstance(turns, list) or not turns:
        raise BadExample(f"{where}: \"conversations\" is "
                         f"{'empty' if turns == [] else 'not a list'}: expected a list of "
                         "{\"from\", \"value\"}")
    messages = []
    for i, t in enumerate(turns, 1):
        speaker = t.get("from") if isinstance(t, dict) else None
        if speaker not in SHAREGPT_ROLES:
            raise BadExample(f"{where}: turn {i} is from {json.dumps(speaker)}: expected "
                             f"{', '.join(list(SHAREGPT_ROLES)[:-1])} or system")
        messages.append({"role": SHAREGPT_ROLES[speaker], "content": t.get("value")})
    return _messages(messages, where)


def check_not_json_examples(path: str | None, flag: str = "--data") -> None:
    """A ``.json`` file that holds a list of examples (Alpaca's own ``alpaca_data.json``, ...)
    is refused rather than trained on as text: one line saying to write it as JSON lines."""
    if path is None or not str(path).lower().endswith(".json") or not Path(path).is_file():
        return
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return  # text that is no JSON: text it is
    first = data[0] if isinstance(data, list) and data else data
    try:
        read_record(first, "")
    except BadExample:
        return
    raise ValueError(f"{flag} {path} is JSON, not text: it holds examples; write them one a line "
                     f"as a .jsonl file ({FORMS}), which train reads as examples")


def example_keys(path: str, flag: str = "--data") -> set[str]:
    """The keys (``Example.key``) of the well-formed examples of ``path``."""
    keys = set()
    for n, record in records(path, flag):
        try:
            keys.add(read_record(record, f"line {n}").key())
        except BadExample:
            continue
    return keys
