"""What the ``train --hf`` tests share: the tiny models they fine-tune (saved once per session by
the ``models`` fixture of ``conftest.py``), their training flags, and running and reading runs.

Tiny random Llama (GQA: 4 heads, 2 KV heads, so TP=4 shares KV heads), Qwen2 (q/k/v biases)
and GPT-2 (Conv1D, packed q|k|v, head tied to the embedding), GPT-2 with dropout 0.1, and an OPT
(a family without a tensor-parallel plan), saved with ``save_pretrained`` together with a
byte-level BPE tokenizer (vocabulary 320) trained here with ``tokenizers``.
"""

import dataclasses
import json

import torch
import transformers

from tensorpar.checkpoint.format import find_checkpoint
from tensorpar.checkpoint.load import load_checkpoint
from tensorpar.data.text import default_corpus
from tensorpar.gpt.model import GPTConfig
from tensorpar.hf.pretrained import from_pretrained
from tensorpar.train.config import TrainConfig
from tensorpar.train.hf_recipe import resolve_hf
from tensorpar.train.loop import train_model_rank
from tensorpar.train.resume import RunFlags

from tests_common import tensorpar_here

VOCAB, STEPS = 320, 10
SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
TRAIN = {"batch_size": 4, "seq_len": 16, "warmup_steps": 2, "lr": 3e-3, "seed": 1,
         "save_every": 5, "steps": STEPS}


def configs(dropout: float = 0.0) -> dict:
    """The three families' tiny configs (``dropout``: GPT-2's residual, embedding and attention
    dropout)."""
    drops = dict.fromkeys(("resid_pdrop", "embd_pdrop", "attn_pdrop"), dropout)
    return {"llama": transformers.LlamaConfig(**SIZES),
            "qwen2": transformers.Qwen2Config(**SIZES),
            "gpt2": transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                            n_positions=64, n_inner=64, bos_token_id=0,
                                            eos_token_id=0, **drops)}


def bpe(text: str):
    """A byte-level BPE of ``VOCAB`` tokens trained on ``text`` (a second), as transformers'
    fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def save_models(root):
    """Save each tiny model (with its tokenizer) and the training text under ``root``; return
    their paths: one per model name, and ``data``: the text."""
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    text = default_corpus()[:24_000]
    (root / "data.txt").write_text(text)
    tokenizer = bpe(text)
    dirs = {"data": root / "data.txt"}
    made = configs() | {"gpt2-dropout": configs(0.1)["gpt2"],
                        "opt": transformers.OPTConfig(  # no tensor-parallel plan
                            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=1,
                            num_attention_heads=4, word_embed_proj_dim=32)}
    for name, cfg in made.items():
        torch.manual_seed(0)
        dirs[name] = root / name
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(dirs[name])
        tokenizer.save_pretrained(dirs[name])
    return dirs


def resolve(path, **flags):
    """``resolve_hf`` as the CLI calls it (None: a flag not given)."""
    train_args = {f.name: None for f in dataclasses.fields(TrainConfig)} | flags
    return resolve_hf(RunFlags(train_args, {f.name: None for f in dataclasses.fields(GPTConfig)},
                               None if path is None else str(path)))


def train_rank(cfg, recipe, resume_from):
    """``train_model_rank``; after a compiled run dynamo's caches are emptied: they hold the
    model, and the pool's rank runs other tests next (as tests/train/test_compile_train.py)."""
    try:
        return train_model_rank(cfg, recipe, resume_from)
    finally:
        if cfg.compile:
            import torch._dynamo

            torch._dynamo.reset()


def train(ranks, path, out, tp, dp=None, whole=False, **flags):
    """A run on the pool of tp x dp (x cp, a flag) ranks; its metrics rows (whole: rank 0's
    result and the run's recipe)."""
    cfg, recipe, resume_from = resolve(path, out=str(out), tp=tp, dp=dp, **flags)
    result = ranks(tp * (dp or 1) * cfg.cp).run(train_rank, cfg, recipe, resume_from)[0]
    return (result, recipe) if whole else result["rows"]


def checkpoint_logits(run, ids):
    """The logits of the run's newest checkpoint, loaded at TP=1 in this process from the
    run's copy of the model's files."""
    manifest = json.loads((find_checkpoint(run) / "manifest.json").read_text())
    model = from_pretrained(run / "hf", plan=manifest["hf"]["plan"], weights=False)
    load_checkpoint(run, model)
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def exported_logits(run, out, ids):
    """Export the run with ``tensorpar export --hf-out``; the logits transformers computes
    from the folder, which it loads with no missing, unexpected or resized tensor."""
    done = tensorpar_here("export", "--ckpt", run, "--hf-out", out)
    assert done.returncode == 0, done.stderr
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits
