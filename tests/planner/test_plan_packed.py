"""The planner against a measured step on chat examples: a Hugging Face Llama, ``--pack``ed rows
(positions restarting at every example, so transformers builds a block-diagonal mask) or one
example a row, a full fine-tune and LoRA, at TP=2 on gloo ranks, as ``tensorpar train --hf
--data chat.jsonl`` runs and measures it."""

import dataclasses
import json

import pytest

transformers = pytest.importorskip("transformers")

from tensorpar.gpt.model import GPTConfig  # noqa: E402
from tensorpar.planner.expected import RankPlace, plan_run  # noqa: E402
from tensorpar.planner.step import Step  # noqa: E402
from tensorpar.train.config import TrainConfig  # noqa: E402
from tensorpar.train.hf_recipe import resolve_hf  # noqa: E402
from tensorpar.train.loop import train_model_rank  # noqa: E402
from tensorpar.train.resume import RunFlags  # noqa: E402

from tests_common import char_tokenizer  # noqa: E402

# a small random Llama with grouped KV heads, its head untied; rows of 128 tokens hold a few
# examples each when packed
CONFIG = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
TEMPLATE = ("{%- for m in messages %}{{ '<|' + m['role'] + '|>' }}"
            "{%- if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
            "{% endgeneration %}{%- else %}{{ m['content'] }}{%- endif %}{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{%- endif %}")
B, T = 8, 128


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return save_chat_model(tmp_path_factory.mktemp("packed"))


def save_chat_model(root):
    """The model's folder (config, weights, a character tokenizer with a chat template) and a
    file of 40 one-turn conversations of a few dozen characters each, under ``root``."""
    import torch

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).save_pretrained(
        root / "llama")
    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(root / "llama")
    words = "the with statement class import def return yield lambda".split()
    with open(root / "chat.jsonl", "w") as f:
        for i in range(40):
            q = " ".join(words[i % 9:] + words[:i % 5])
            a = " ".join(words[:(i % 7) + 1])
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")
    return root


def _resolve(path, **flags):
    train_args = {f.name: None for f in dataclasses.fields(TrainConfig)} | flags
    return resolve_hf(RunFlags(train_args, {f.name: None for f in dataclasses.fields(GPTConfig)},
                               str(path)))


def _sizes(cfg, recipe):
    return train_model_rank(cfg, recipe, None)["sizes"]


def _planned_against_measured(ranks, root, out, **flags) -> list[float]:
    """Each rank's planned peak (``plan_run``, as the run's summary asks it) against the
    measured one, as a relative error."""
    cfg, recipe, _ = _resolve(root / "llama", out=str(out), tp=2, steps=2, batch_size=B,
                              seq_len=T, warmup_steps=1, seed=3, save_every=2,
                              data=str(root / "chat.jsonl"), **flags)
    sizes = ranks(2).run(_sizes, cfg, recipe)[0]
    step = Step.from_train_config(cfg, recipe.shape(), converted=True)
    plan = plan_run(step, [RankPlace(s["tp_rank"]) for s in sizes])
    return [(p + s.get("data_bytes", 0)) / s["peak_memory"] - 1
            for p, s in zip(plan.peaks, sizes, strict=True)]


# measured (torch 2.13 CPU, transformers 5.24): planned against measured peak per rank, before
# the packed rows' masks, K and V repeated and per-row rotary tables were counted and a full
# fine-tune was planned as the converted model it is -> now
CASES = {
    "lora-packed": ({"lora_rank": 8, "pack": True}, "-15.3% -> +2.0%"),
    "full-packed": ({"pack": True}, "-2.3% -> +3.9%"),
    "lora-packed-bf16": ({"lora_rank": 8, "pack": True, "dtype": "bf16"}, "+4.1%"),
    "full-packed-bf16": ({"pack": True, "dtype": "bf16"}, "-1.9% -> -0.1%"),
    "lora-accumulated": ({"lora_rank": 8, "micro_batch_size": 2}, "-3.5%"),
    "lora-packed-accumulated": ({"lora_rank": 8, "pack": True, "micro_batch_size": 2},
                                "-13.8% -> -0.6%"),
    "full": ({}, "+12.3% -> +1.2%"),
}
FAST = {"lora-packed"}


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CASES])
def test_chat_step_planned_within_5_percent(ranks, chat_model, tmp_path, case):
    """A step on chat examples at TP=2 (a full fine-tune and LoRA; packed rows or one example a
    row; fp32 and bf16 autocast; two passes of accumulation): each rank's planned peak within
    5% of the measured one (what each case measured: ``CASES``)."""
    flags, measured = CASES[case]
    errors = _planned_against_measured(ranks, chat_model, tmp_path, **flags)
    assert all(abs(e) <= 0.05 for e in errors), (case, [f"{e:+.1%}" for e in errors], measured)
