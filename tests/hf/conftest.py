"""Tiny random Hugging Face models, one per family tensorpar supports, saved once per session with
``save_pretrained`` (nothing is downloaded). Tests take the directory as ``hf_dirs / family``."""

import pytest
import torch

from tests_common import char_tokenizer

SIZES = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 80, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def tiny_configs():
    """4 heads and 2 KV heads (where the family has GQA), width 64, MLP 80, vocabulary 96."""
    import transformers as T
    return {
        "gpt2": T.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                             n_inner=80, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                             bos_token_id=0, eos_token_id=0),
        "llama": T.LlamaConfig(**SIZES),
        "llama-mqa": T.LlamaConfig(**(SIZES | {"num_key_value_heads": 1})),
        "mistral": T.MistralConfig(**SIZES),
        "qwen2-tied": T.Qwen2Config(**SIZES, tie_word_embeddings=True),
        "qwen3": T.Qwen3Config(**SIZES, head_dim=16),
        # no built-in plan: translated from base_model_tp_plan, or given by the user
        "gemma": T.GemmaConfig(**SIZES, head_dim=16),  # scaled embedding subclass, tied head
        "gemma2": T.Gemma2Config(**SIZES, head_dim=16),  # soft-capping, sliding window
        "granite": T.GraniteConfig(**SIZES),  # multipliers on embedding, residual, logits
        "starcoder2": T.Starcoder2Config(**SIZES),  # biases, LayerNorm, c_fc/c_proj MLP
        "cohere": T.CohereConfig(**SIZES),  # parallel attention and MLP, tied head
        "smollm3": T.SmolLM3Config(**SIZES, pad_token_id=0),  # layers without rotary
        "gpt_neox": T.GPTNeoXConfig(vocab_size=96, hidden_size=64, intermediate_size=80,
                                    num_hidden_layers=2, num_attention_heads=4),
        "opt": T.OPTConfig(vocab_size=96, hidden_size=64, ffn_dim=80, num_hidden_layers=2,
                           num_attention_heads=4, word_embed_proj_dim=64, dropout=0.0),
    }


@pytest.fixture
def hf_configs():
    return tiny_configs()


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """Small random models of each family, saved with save_pretrained."""
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("hf")
    for name, cfg in tiny_configs().items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        model.save_pretrained(root / name)
    char_tokenizer().save_pretrained(root / "llama")
    # generation settings of the directory (eos list as in Llama 3, a penalty) apply too
    transformers.GenerationConfig(eos_token_id=[2, 7], repetition_penalty=1.3).save_pretrained(
        root / "llama")
    return root


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """The ``train --hf`` tests' tiny models (``hf_runs.py``): a directory per model, with its
    tokenizer, and ``data``: the training text. Saved once for both of their files."""
    from hf_runs import save_models

    return save_models(tmp_path_factory.mktemp("hf-train"))
