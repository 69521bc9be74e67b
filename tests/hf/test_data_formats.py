"""JSON-lines data is read as examples, never as text (``data/formats.py``): ShareGPT and Alpaca
records are the messages they convert to; a malformed record is one line naming its line, before
any rank starts, or with ``--skip-bad-examples`` skipped and counted; validation data that is
the training data is warned of."""

import json
import shutil

import pytest

transformers = pytest.importorskip("transformers")

from tensorpar.data.chat import describe_examples, read_examples  # noqa: E402
from tensorpar.data.text import overlap_warning  # noqa: E402
from tensorpar.data.tokenizer import HFTokenizer  # noqa: E402

from tests_common import tensorpar_here  # noqa: E402

TEMPLATE = ("{%- for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}"
            "{%- if m['role'] == 'assistant' %}{{ eos_token }}{%- endif %}{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{%- endif %}")
CHAT = [{"role": "user", "content": "What is a class?"},
        {"role": "assistant", "content": "A blueprint for objects."}]


@pytest.fixture(scope="module")
def model(models, tmp_path_factory):
    """The tiny Llama with a chat template."""
    root = tmp_path_factory.mktemp("formats") / "llama"
    shutil.copytree(models["llama"], root)
    tok = transformers.AutoTokenizer.from_pretrained(root)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(root)
    return root


def _write(path, *records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return str(path)


def test_sharegpt_and_alpaca_are_the_messages_they_convert_to(model, tmp_path):
    """ShareGPT's human/gpt turns are user/assistant messages; Alpaca's instruction, input and
    output a user message (instruction, blank line, input) and the assistant's answer: the same
    ids and the same trained tokens as the messages written out, and the summary says so."""
    tok = HFTokenizer(model)
    share = _write(tmp_path / "share.jsonl", {"conversations": [
        {"from": "human", "value": CHAT[0]["content"]},
        {"from": "gpt", "value": CHAT[1]["content"]}]})
    alpaca = _write(tmp_path / "alpaca.jsonl", {"instruction": "Define:", "input": "class",
                                                "output": CHAT[1]["content"]})
    chat = _write(tmp_path / "chat.jsonl", {"messages": CHAT}, {"messages": [
        {"role": "user", "content": "Define:\n\nclass"}, CHAT[1]]})
    want = read_examples(chat, tok, 64)
    got = [read_examples(p, tok, 64) for p in (share, alpaca)]
    assert [g.ids[0] for g in got] == want.ids and [g.trained[0] for g in got] == want.trained
    assert "ShareGPT read as messages" in describe_examples(got[0], 64)
    assert describe_examples(want, 64).startswith("2 examples (answers by prefix)")


BAD = {
    "no content": ({"messages": [CHAT[0], {"role": "assistant"}]},
                   'line 2: message 2 (assistant) has no "content", expected a string'),
    "role typo": ({"messages": [CHAT[0], {"role": "asistant", "content": "x"}]},
                  'line 2: message 2 has role "asistant": expected system, user, assistant or '
                  "tool"),
    "empty messages": ({"messages": []}, 'line 2: "messages" is empty'),
    "empty answer": ({"messages": [CHAT[0], {"role": "assistant", "content": " "}]},
                     "line 2: message 2 (assistant) is empty: nothing to train on"),
    "no answer": ({"messages": [CHAT[0]]}, "line 2: no assistant message"),
    "sharegpt speaker": ({"conversations": [{"from": "bot", "value": "x"}]},
                         'line 2: turn 1 is from "bot": expected human'),
    "unknown keys": ({"question": "q", "answer": "a"},
                     'line 2: keys "question", "answer": expected {"messages"'),
    "not json": ("{'messages': []}", "line 2: not JSON"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_record_is_named_by_its_line(model, tmp_path, case):
    """Each malformed record is refused naming the file, the line and what was expected."""
    record, said = BAD[case]
    data = _write(tmp_path / "data.jsonl", {"messages": CHAT}, record)
    with pytest.raises(ValueError) as e:
        read_examples(data, HFTokenizer(model), 64)
    assert f"--data {data} {said}" in str(e.value), str(e.value)


@pytest.mark.parametrize("case", ["no content", "role typo"])
def test_a_malformed_record_stops_train_in_one_line(model, tmp_path, case):
    """train refuses the file before any rank starts: one line, exit status 2, no traceback."""
    record, said = BAD[case]
    data = _write(tmp_path / "data.jsonl", {"messages": CHAT}, record)
    r = tensorpar_here("train", "--hf", model, "--tp", 1, "--data", data, "--seq-len", 32,
                       "--out", tmp_path / "run")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and f"--data {data} {said}" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_documents_and_pack_without_data_are_refused_plainly(model, tmp_path):
    """A file of {"text"} documents is not trained on as JSON text: its refusal points to
    tensorpar prepare; a .json list of examples is not text either; --pack without --data says
    --data is missing."""
    docs = _write(tmp_path / "docs.jsonl", {"text": "one document"})
    r = tensorpar_here("train", "--hf", model, "--tp", 1, "--data", docs, "--out", tmp_path / "a")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert 'line 1: a {"text"} document, not an example' in r.stderr
    assert "tensorpar prepare" in r.stderr
    alpaca = tmp_path / "alpaca_data.json"
    alpaca.write_text(json.dumps([{"instruction": "Define:", "input": "", "output": "x"}]))
    r = tensorpar_here("train", "--hf", model, "--tp", 1, "--data", alpaca, "--out",
                       tmp_path / "c")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert f"--data {alpaca} is JSON, not text: it holds examples; write them one a line" in \
        r.stderr
    r = tensorpar_here("train", "--hf", model, "--tp", 1, "--pack", "--out", tmp_path / "b")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "--pack packs chat or instruction examples into sequences: add --data" in r.stderr


def test_skip_bad_examples_skips_and_counts(model, tmp_path):
    """With skip_bad the malformed records are left out, the rest read as without them, and the
    summary's line counts them and shows the first."""
    tok = HFTokenizer(model)
    bad = [r for r, _ in BAD.values()]
    data = _write(tmp_path / "data.jsonl", {"messages": CHAT}, *bad, {"messages": CHAT})
    ex = read_examples(data, tok, 64, skip_bad=True)
    clean = read_examples(_write(tmp_path / "c.jsonl", {"messages": CHAT}, {"messages": CHAT}),
                          tok, 64)
    assert ex.ids == clean.ids and len(ex.skipped) == len(BAD)
    line = describe_examples(ex, 64)
    assert f"; {len(BAD)} malformed skipped (--skip-bad-examples), the first: " in line
    assert "line 2: message 2 (assistant) has no \"content\"" in line


def test_validation_data_that_is_training_data_is_warned_of(tmp_path):
    """The same file, a copy of it, or examples in both: a warning; held-out data: none."""
    data = _write(tmp_path / "a.jsonl", {"messages": CHAT}, {"prompt": "p", "completion": "c"})
    copy = shutil.copy(data, tmp_path / "copy.jsonl")
    some = _write(tmp_path / "b.jsonl", {"prompt": "p", "completion": "c"},
                  {"prompt": "q", "completion": "d"})
    other = _write(tmp_path / "c.jsonl", {"prompt": "q", "completion": "d"})
    assert "is the --data file" in overlap_warning(data, data)
    assert "is the --data file" in overlap_warning(data, str(copy))
    assert overlap_warning(data, some).startswith("1 of the 2 --val-data examples are also in")
    assert overlap_warning(data, other) is None and overlap_warning(data, None) is None
    text = tmp_path / "t.txt"
    text.write_text("some text")
    assert "is the --data file" in overlap_warning(str(text), str(text))
