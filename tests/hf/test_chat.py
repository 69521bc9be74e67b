"""Chat and instruction data for ``train --hf`` (``data/chat.py``): the loss is on the
assistant's (the completion's) tokens alone, as transformers computes it on the dense model with
the tokenizer's own assistant mask, packed or not; the prefix rule finds the same tokens where a
template has no ``{% generation %}`` marks; too-long examples are cut or dropped and counted."""

import json
import shutil

import pytest
import torch
import transformers
from hf_runs import train  # noqa: E402

from tensorpar.data.chat import describe_examples, read_examples  # noqa: E402
from tensorpar.data.packing import ExampleBatches  # noqa: E402
from tensorpar.data.tokenizer import HFTokenizer  # noqa: E402

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


def _packed_logits(path, x, pos, group=None):
    """The logits at this TP size (whole) of rows of packed examples, positions restarting."""
    from tensorpar.hf.pretrained import from_pretrained
    from tensorpar.parallel.mappings import gather_from_tp

    model = from_pretrained(path, group).eval()
    with torch.no_grad():
        logits = model(input_ids=x, position_ids=pos, use_cache=False).logits
    vocab = model.config.vocab_size
    return logits if logits.shape[-1] == vocab else gather_from_tp(logits, group, vocab)


def test_logits_of_packed_rows_are_each_examples_alone(ranks, chat):
    """At TP=2 the logits of every position of a packed row (two or three examples) equal
    transformers' of its example alone, to 2e-6 of their largest (measured 3.3e-7): no example
    sees another (with positions that do not restart, a leak, they differ by 0.75)."""
    data, seq = str(chat / "chat.jsonl"), 2 * SEQ
    examples = read_examples(data, HFTokenizer(chat / "marked"), seq)
    packed = ExampleBatches(examples, seq, 2, 3, pack=True)
    x, _, pos = packed.batch(0)
    logits = ranks(2).run(_packed_logits, chat / "marked", x, pos)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(chat / "marked").eval()
    worst = 0.0
    for r in range(2):
        at, row = 0, packed._row(r)
        assert len(row) > 1, row
        for e in row:
            ids = torch.tensor([examples.ids[e][:-1]])
            with torch.no_grad():
                want = model(input_ids=ids).logits[0]
            got = logits[r, at:at + len(want)]
            worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
            at += len(want)
    assert worst <= 2e-6, worst


def _gpt_run(ranks, chat, out, tp, **flags):
    """``train`` of a tiny GPT with the chat fixture's tokenizer (``--tokenizer``): rank 0's
    result, and the run's config and recipe."""
    import dataclasses

    from hf_runs import train_rank

    from tensorpar.gpt.model import GPTConfig
    from tensorpar.train.config import TrainConfig
    from tensorpar.train.run import resolve as resolve_any

    model = {f.name: None for f in dataclasses.fields(GPTConfig)} | {
        "dim": 32, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "vocab_size": 320}
    train_args = {f.name: None for f in dataclasses.fields(TrainConfig)} | flags | {
        "out": str(out), "tp": tp}
    cfg, recipe, resume_from = resolve_any(train_args, model, tokenizer=str(chat / "marked"))
    return ranks(tp * (flags.get("cp") or 1)).run(train_rank, cfg, recipe, resume_from)[0], \
        cfg, recipe


def _gpt_loss_one_by_one(cfg, recipe, examples, chosen, checkpoint=None):
    """The GPT's (TP=1, in this process; its weights at the start, or the run ``checkpoint``'s)
    mean cross-entropy over the answer tokens of the ``chosen`` examples, each run alone."""
    from tensorpar.checkpoint.load import load_checkpoint
    from tensorpar.gpt.model import GPT

    model = GPT(recipe.model_cfg, None, seed=cfg.seed).eval()
    if checkpoint is not None:
        load_checkpoint(checkpoint, model)
    total, count = 0.0, 0
    for e in chosen:
        ids = torch.tensor([examples.ids[e]])
        labels = torch.where(torch.tensor(examples.trained[e]), ids[0], -100)[1:]
        with torch.no_grad():
            n = int((labels != -100).sum())
            total += model(ids[:, :-1], labels[None]).item() * n
        count += n
    return total / count


def test_gpt_trains_on_chat_examples_packed_or_not(ranks, chat, tmp_path):
    """The GPT with ``--tokenizer``: its first step's loss on chat examples at TP=2, one example
    a row and ``--pack``ed (positions restarting, the block-diagonal mask), equals the mean over
    the same examples' answer tokens, each run alone at TP=1 (1e-6 relative; measured 1.6e-8), and
    a packed row's logits are its examples' alone; chat examples as --val-data give the mean
    over their answer tokens after the step; without
    ``--tokenizer`` chat data is refused in one line."""
    data = str(chat / "chat.jsonl")
    flags = {"steps": 1, "batch_size": 2, "seed": 3, "lr": 1e-3, "warmup_steps": 1,
             "data": data}
    plain, cfg, recipe = _gpt_run(ranks, chat, tmp_path / "g", 2, seq_len=SEQ, val_data=data,
                                  **flags)
    examples = read_examples(data, HFTokenizer(chat / "marked"), SEQ)
    first = ExampleBatches(examples, SEQ, 2, 3)._order(0)[:2].tolist()
    want = _gpt_loss_one_by_one(cfg, recipe, examples, first)
    assert abs(plain["rows"][0]["loss"] - want) <= 1e-6 * want, (plain["rows"][0], want)
    # the validation loss (chat examples as --val-data): the mean over every example's answer
    # tokens with the weights after the step (its checkpoint)
    trained = _gpt_loss_one_by_one(cfg, recipe, examples, range(len(examples.ids)),
                                   checkpoint=tmp_path / "g")
    assert abs(plain["rows"][0]["val_loss"] - trained) <= 1e-6 * trained, \
        (plain["rows"][0], trained)

    packed, cfg, recipe = _gpt_run(ranks, chat, tmp_path / "p", 2, seq_len=2 * SEQ, pack=True,
                                   **flags)
    examples = read_examples(data, HFTokenizer(chat / "marked"), 2 * SEQ)
    batches = ExampleBatches(examples, 2 * SEQ, 2, 3, pack=True)
    rows = [batches._row(0), batches._row(1)]
    assert all(len(r) > 1 for r in rows), rows
    want = _gpt_loss_one_by_one(cfg, recipe, examples, [e for r in rows for e in r])
    # (a random GPT's loss is near log V: attention across examples moves it by 7e-6 only)
    assert abs(packed["rows"][0]["loss"] - want) <= 1e-6 * want, (packed["rows"][0], want)
    # the logits say more: a packed row's are each example's alone (an example that saw the
    # one before it would be 0.1 off)
    from tensorpar.gpt.model import GPT

    model = GPT(recipe.model_cfg, None, seed=cfg.seed).eval()
    x, _, pos = batches.batch(0)
    starts = (pos[0] == 0).nonzero().flatten().tolist() + [x.shape[1]]
    assert len(starts) > 2
    with torch.no_grad():
        logits = model(x[:1], position_ids=pos[:1])[0]
        alone = torch.cat([model(x[:1, a:b])[0]
                           for a, b in zip(starts[:-1], starts[1:], strict=True)])
    assert (logits - alone).abs().max() <= 1e-6, (logits - alone).abs().max()

    from tensorpar.train.run import resolve as resolve_any

    with pytest.raises(ValueError, match="chat or instruction examples need a tokenizer"):
        resolve_any({"data": data, "out": str(tmp_path / "b")}, {})


@pytest.mark.slow
def test_gpt_packed_under_context_parallelism(ranks, chat, tmp_path):
    """``--pack`` with ``--cp 2`` and with ``--tp 2 --cp 2``: rows of several chat examples split
    over the CP ranks (each rank's load-balanced chunks cut through examples) train as one rank
    at the full rows: 3 steps' losses and gradient norms within 1e-5. Positions restart at each
    example on every CP rank and no query sees another example's keys: a CP mask that joins the
    examples moves the first step's gradient norm by 9e-4 (checked by hand)."""
    flags = {"steps": 3, "batch_size": 2, "seed": 3, "lr": 1e-3, "warmup_steps": 1,
             "data": str(chat / "chat.jsonl"), "seq_len": 2 * SEQ, "pack": True}
    ref = _gpt_run(ranks, chat, tmp_path / "one", 1, **flags)[0]["rows"]
    for tp, cp in ((1, 2), (2, 2)):
        rows = _gpt_run(ranks, chat, tmp_path / f"tp{tp}-cp{cp}", tp, cp=cp, **flags)[0]["rows"]
        for got, want in zip(rows, ref, strict=True):
            for key in ("loss", "grad_norm"):
                assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), \
                    (tp, cp, got["step"], key, got[key], want[key])
