"""Chat and instruction data for ``train --hf`` (``train/chat.py``): the loss is on the
assistant's (the completion's) tokens alone, as transformers computes it on the dense model with
the tokenizer's own assistant mask, packed or not; the prefix rule finds the same tokens where a
template has no ``{% generation %}`` marks; too-long examples are cut or dropped and counted."""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_runs import train  # noqa: E402

from tensorpar.gpt.tokenizer import HFTokenizer  # noqa: E402
from tensorpar.train.chat import ExampleBatches, describe_examples, read_examples  # noqa: E402

TURNS = ("{%- for m in messages %}{{ '<|' + m['role'] + '|>' }}"
         "{%- if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + eos_token }}"
         "{% endgeneration %}{%- else %}{{ m['content'] }}{%- endif %}{%- endfor %}"
         "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{%- endif %}")
PLAIN = TURNS.replace("{% generation %}", "").replace("{% endgeneration %}", "")
SEQ, BATCH = 96, 4


@pytest.fixture(scope="module")
def chat(models, tmp_path_factory):
    """The tiny Llama with a chat template that marks the assistant's part, another copy whose
    template does not, and a file of conversations (one and two turns, one too long)."""
    root = tmp_path_factory.mktemp("chat")
    for name, template in (("marked", TURNS), ("plain", PLAIN)):
        shutil.copytree(models["llama"], root / name)
        tok = transformers.AutoTokenizer.from_pretrained(root / name)
        tok.chat_template = template
        tok.save_pretrained(root / name)
    words = "the with statement class import def return yield lambda".split()
    with open(root / "chat.jsonl", "w") as f:
        for i in range(10):
            q, a = " ".join(words[i % 9:] + words[:i % 9][:3]), " ".join(words[:(i % 5) + 2])
            messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            if i % 3 == 0:
                messages += [{"role": "user", "content": "and then?"},
                             {"role": "assistant", "content": "then " + a}]
            f.write(json.dumps({"messages": messages}) + "\n")
        long = [{"role": "user", "content": " ".join(words * 20)},
                {"role": "assistant", "content": "yes"}]
        f.write(json.dumps({"messages": long}) + "\n")
    return root


def _examples(chat, name):
    return read_examples(str(chat / "chat.jsonl"), HFTokenizer(chat / name), SEQ)


def test_the_prefix_rule_finds_the_templates_own_mask(chat):
    """Without {% generation %} marks, each assistant message is what rendering through it adds
    to rendering up to it with the generation prompt: the same tokens the marked template's own
    mask gives; the too-long example loses every answer token and is dropped, and counted."""
    marked, plain = _examples(chat, "marked"), _examples(chat, "plain")
    assert (marked.masking, plain.masking) == ("template mask", "prefix")
    assert marked.ids == plain.ids and marked.trained == plain.trained
    assert len(marked.ids) == 10 and marked.dropped == 1 and marked.truncated == 2
    assert describe_examples(marked, SEQ).startswith("10 examples (answers by template mask); "
                                                     "longer than --seq-len 96 + 1: 2 cut, 1 "
                                                     "dropped")


def test_first_step_loss_is_transformers_with_the_assistant_mask(ranks, chat, tmp_path):
    """The first step's loss at TP=2 (and at TP=2 with two passes of accumulation) equals the
    dense model's mean cross-entropy over the batch's assistant tokens, found by the tokenizer's
    apply_chat_template(..., return_assistant_tokens_mask=True) (1e-5 relative; measured 1.5e-9
    and, accumulated, 8.4e-8)."""
    data = str(chat / "chat.jsonl")
    flags = {"steps": 1, "batch_size": BATCH, "seq_len": SEQ, "seed": 3, "lr": 1e-3,
             "warmup_steps": 1, "data": data}
    first = train(ranks, chat / "marked", tmp_path / "a", 2, **flags)[0]["loss"]
    accumulated = train(ranks, chat / "marked", tmp_path / "b", 2, micro_batch_size=2,
                        **flags)[0]["loss"]
    tok = transformers.AutoTokenizer.from_pretrained(chat / "marked")
    records = [json.loads(line) for line in open(data)]
    order = ExampleBatches(_examples(chat, "marked"), SEQ, BATCH, 3)._order(0)[:BATCH]
    kept = []  # each conversation cut to SEQ + 1 tokens, kept if an answer token is left
    for r in records:
        rendered = tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
        ids, mask = rendered["input_ids"][:SEQ + 1], rendered["assistant_masks"][:SEQ + 1]
        if any(mask[1:]):
            kept.append((ids, mask))
    model = transformers.AutoModelForCausalLM.from_pretrained(chat / "marked").eval()
    total, count = 0.0, 0
    for e in order.tolist():
        ids = torch.tensor([kept[e][0]])
        labels = torch.where(torch.tensor(kept[e][1]).bool(), ids[0], -100)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        total += torch.nn.functional.cross_entropy(logits, labels[1:], reduction="sum",
                                                   ignore_index=-100).item()
        count += int((labels[1:] != -100).sum())
    want = total / count
    assert abs(first - want) <= 1e-5 * want, (first, want)
    assert abs(accumulated - want) <= 1e-5 * want, (accumulated, want)


def test_prompt_completion_trains_the_completion_and_its_end(chat, tmp_path):
    """{"prompt", "completion"}: the prompt's ids (with the tokenizer's special tokens), then the
    completion's and end-of-text; only the latter are trained."""
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"prompt": "def f():", "completion": " return 1"}) + "\n")
    tok = transformers.AutoTokenizer.from_pretrained(chat / "marked")
    ex = read_examples(str(path), HFTokenizer(chat / "marked"), SEQ)
    head = tok("def f():")["input_ids"]
    tail = tok(" return 1", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ex.ids == [head + tail] and ex.trained == [[False] * len(head) + [True] * len(tail)]
    x, y, _ = ExampleBatches(ex, SEQ, 1, 0).batch(0)
    assert x[0, :len(head + tail) - 1].tolist() == (head + tail)[:-1]
    assert y[0].tolist() == [-100] * (len(head) - 1) + tail + [-100] * (SEQ - len(head + tail)
                                                                       + 1)


def test_packed_loss_is_the_examples_loss_unpacked(ranks, chat, tmp_path):
    """--pack at TP=2: the first step's loss over rows that each hold several examples (positions
    restarting, attention confined to each) equals the dense model's over the same examples one
    by one (1e-5 relative; measured 1.3e-8); the rows hold more than one example each."""
    data = str(chat / "chat.jsonl")
    seq = 2 * SEQ  # room for two or three examples a row
    flags = {"steps": 1, "batch_size": 2, "seq_len": seq, "seed": 3, "lr": 1e-3,
             "warmup_steps": 1, "data": data}
    first = train(ranks, chat / "marked", tmp_path / "p", 2, pack=True, **flags)[0]["loss"]
    examples = read_examples(data, HFTokenizer(chat / "marked"), seq)
    packed = ExampleBatches(examples, seq, 2, 3, pack=True)
    rows = [packed._row(0), packed._row(1)]
    assert all(len(r) > 1 for r in rows), rows
    model = transformers.AutoModelForCausalLM.from_pretrained(chat / "marked").eval()
    total, count = 0.0, 0
    for e in [e for r in rows for e in r]:
        ids = torch.tensor([examples.ids[e]])
        labels = torch.where(torch.tensor(examples.trained[e]), ids[0], -100)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        total += torch.nn.functional.cross_entropy(logits, labels[1:], reduction="sum").item()
        count += int((labels[1:] != -100).sum())
    want = total / count
    assert abs(first - want) <= 1e-5 * want, (first, want)
