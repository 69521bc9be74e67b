"""``generate --hf``: several prompts of different lengths in one left-padded batch, each equal to
itself alone; greedy and seeded sampling with top-k and top-p the same at TP=1 and 2; each
sequence stops at the generation config's end-of-text ids; clear errors. The models:
``conftest.py`` (a tiny Llama with a character tokenizer, end-of-text ids 2 and 7: "!" and "&")."""

import shutil

import accelerate  # noqa: F401  (a dev dependency: missing, this file fails, not skips)
import pytest
import torch
import transformers

from tensorpar.cli.generate import generate_hf_rank  # noqa: E402
from tensorpar.cli.main import main  # noqa: E402
from tensorpar.gpt.generate import format_completions  # noqa: E402

from tests_common import tensorpar_here  # noqa: E402

PROMPTS = ["Hi ", "Once upon a", "x", "The cat sat"]
EOS = "!&"  # ids 2 and 7 of the character tokenizer
# name: (temperature, top_k, top_p)
SETTINGS = {"greedy": (0.0, 0, 1.0), "sampled": (0.8, 5, 0.9), "top_k_1": (0.8, 1, 1.0),
            "tiny_top_p": (0.8, 0, 1e-6)}


@pytest.fixture(scope="module")
def llama(hf_dirs, tmp_path_factory):
    """The tiny Llama without the directory's repetition penalty: transformers counts the left
    padding as tokens already seen, so with a penalty a padded prompt is no longer itself."""
    path = tmp_path_factory.mktemp("hf-gen") / "llama"
    shutil.copytree(hf_dirs / "llama", path)
    transformers.GenerationConfig(eos_token_id=[2, 7]).save_pretrained(path)
    return path


def _body(path):
    out = {name: generate_hf_rank(path, PROMPTS, None, 12, t, 1, k, p)
           for name, (t, k, p) in SETTINGS.items()}
    out["alone"] = [generate_hf_rank(path, [p], None, 12, 0.0, 1)[0] for p in PROMPTS]
    out["ids"] = generate_hf_rank(path, None, [5, 6, 7], 6, 0.8, 1, 5, 0.9)
    return out


def test_batch_equals_alone_and_tp_sizes_agree(ranks, llama):
    """Greedy: each prompt's text in the batch is its text alone. Greedy and sampled (top-k,
    top-p) texts are identical at TP=1 and 2; top-k 1 and a tiny top-p are greedy. A text stops
    right after its first end-of-text character, or runs 12 new characters without one."""
    outs = {n: ranks(n).run(_body, str(llama)) for n in (1, 2)}
    ref = outs[1][0]
    assert all(r == ref for results in outs.values() for r in results)
    assert ref["greedy"] == ref["alone"] == ref["top_k_1"] == ref["tiny_top_p"]
    assert ref["sampled"] != ref["greedy"]
    ended = 0
    for name in SETTINGS:
        for text, prompt in zip(ref[name], PROMPTS, strict=True):
            new = text[len(prompt):]
            assert text.startswith(prompt)
            stops = [i for i, c in enumerate(new) if c in EOS]
            assert (stops and len(new) == stops[0] + 1) or (not stops and len(new) == 12), text
            ended += bool(stops)
    assert ended  # this model says "!" early for one of the prompts
    assert ref["ids"][0].startswith("5 6 7 ") and len(ref["ids"][0].split()) <= 9


def test_cli_several_prompts(ranks, llama, tmp_path):
    """``--prompt`` and ``--prompt-file`` with top-k and top-p reach the ranks: the CLI prints
    the texts of the same batch, separated by ``--- i`` lines. The command runs in this process
    (its rank forked from the session's server); ``generate --hf`` as a process of its own:
    ``test_hf.py::test_cli_generate_under_torchrun``."""
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS[1:]) + "\n")
    out = tensorpar_here("generate", "--hf", llama, "--tp", 1, "--prompt", PROMPTS[0],
                     "--prompt-file", tmp_path / "p.txt", "--max-new-tokens", 12,
                     "--temperature", 0.8, "--top-k", 5, "--top-p", 0.9, "--seed", 1)
    assert out.returncode == 0, out.stderr
    texts = ranks(1).run(generate_hf_rank, str(llama), PROMPTS, None, 12, 0.8, 1, 5, 0.9)[0]
    assert out.stdout == format_completions(texts)
    assert out.stdout.count("\n--- ") == 3


@pytest.mark.parametrize("flags,message", [
    (["--prompt", "x", "--top-k", "-2"], "--top-k -2 must be a whole number >= 0"),
    (["--prompt", "x", "--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
    (["--prompt", "x", "--temperature", "inf"], "need --temperature inf >= 0"),
    (["--prompt-ids", "1,x"], "--prompt-ids '1,x': expected token ids like 1,2,3"),
    (["--prompt", "x", "--prompt-ids", "1"], "give --prompt or --prompt-file"),
])
def test_cli_bad_values(llama, capsys, flags, message):
    """One clear line and exit 2, before any rank starts."""
    assert main(["generate", "--hf", str(llama), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tensorpar generate: ") and message in err and err.count("\n") == 1


CHAT_TEMPLATE = ("{%- for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}"
                 "{%- endfor %}{%- if add_generation_prompt %}{{ 'assistant: ' }}{%- endif %}")


def test_chat_reply_is_transformers_greedy_on_the_template(models, tmp_path):
    """``generate --chat``: each prompt rendered as a user message by the chat template with the
    generation prompt; the reply printed alone, without special tokens, equal at TP=1 and 2 to
    transformers' greedy decoding of the templated prompt (its end-of-text, a special token,
    left out)."""
    path = tmp_path / "llama"
    shutil.copytree(models["llama"], path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = ["What is a class?", "Say hi"]

    def rendered(prompt):
        return tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                       add_generation_prompt=True, return_dict=True,
                                       return_tensors="pt")["input_ids"]

    with torch.no_grad():  # the end-of-text the model's third reply token: a reply that ends
        ids = rendered(prompts[0])
        third = model.generate(ids, max_new_tokens=3, do_sample=False,
                               pad_token_id=tok.eos_token_id)[0, -1]
        model.lm_head.weight[tok.eos_token_id] = 2 * model.lm_head.weight[third]
    model.generation_config.eos_token_id = tok.eos_token_id  # where both stop
    model.save_pretrained(path)
    want, ended = [], 0
    for prompt in prompts:
        ids = rendered(prompt)
        out = model.generate(ids, max_new_tokens=10, do_sample=False,
                             pad_token_id=tok.eos_token_id)
        want.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
        ended += tok.eos_token_id in out[0, ids.shape[1]:].tolist()
    assert ended  # a reply that ends with the end-of-text, left out of the text
    for tp in (1, 2):
        said = tensorpar_here("generate", "--hf", path, "--tp", tp, "--chat", "--prompt",
                              prompts[0], "--prompt", prompts[1], "--max-new-tokens", 10)
        assert said.returncode == 0, said.stderr
        assert said.stdout == format_completions(want), (said.stdout, want)
        assert "<|endoftext|>" not in said.stdout and "assistant: " not in said.stdout


def test_chat_without_a_template_is_one_line(llama, capsys):
    """The character tokenizer has no chat template: one line, before any rank."""
    assert main(["generate", "--hf", str(llama), "--chat", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert f"--chat: the tokenizer of {llama} has no chat template" in err
    assert err.count("\n") == 1
