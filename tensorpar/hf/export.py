"""A checkpoint as a Hugging Face model folder: ``tensorpar export --ckpt RUN --hf-out DIR``.

::

    tensorpar export --ckpt runs/gpt --hf-out runs/gpt-hf     # --max-shard-size 5GB (default)
    AutoModelForCausalLM.from_pretrained("runs/gpt-hf"), AutoTokenizer.from_pretrained(...)

The folder holds ``config.json``, ``generation_config.json``, the weights as written by
transformers' own ``save_pretrained`` (``model.safetensors``, or above ``--max-shard-size``
``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``) and the tokenizer
(``tokenizer.json``, ``tokenizer_config.json``).

tensorpar's GPT is a ``LlamaForCausalLM`` whose weights carry over unchanged::

    tensorpar GPT (gpt/model.py)     Llama (transformers)
    embed                            model.embed_tokens
    blocks.i.attn_norm               model.layers.i.input_layernorm
    blocks.i.attn.{q,k,v,o}_proj     model.layers.i.self_attn.{q,k,v,o}_proj
    blocks.i.mlp_norm                model.layers.i.post_attention_layernorm
    blocks.i.mlp.{gate,up,down}      model.layers.i.mlp.{gate,up,down}_proj
    norm                             model.norm
    lm_head, or tied to embed        lm_head, or tie_word_embeddings

because the conventions agree (``transformer/rotary.py``, ``attention.py``, ``mlp.py``,
``parallel/norm.py``): rotary pairs channel i with i + head_dim/2 ("rotate half") at angle
pos * rope_theta^(-2i/head_dim), Llama's layout in transformers, so no q/k row is permuted
(Meta's original interleaved checkpoints need that, tensorpar's do not); query head h reads KV
head h // (n_head / n_kv_head), as ``repeat_kv``; RMSNorm has a weight and no bias, eps
``norm_eps``; the MLP is down(silu(gate x) * up x); no linear has a bias; scores are scaled by
1/sqrt(head_dim); the embedding is not scaled. Llama cannot hold the GPT's dropout on each
residual branch (it has attention dropout only): the export has none, as inference has none.
Rotary positions have no limit: ``max_position_embeddings`` is Llama's 2048 (or the training
``--seq-len`` if longer), though the model has seen only ``--seq-len`` positions in training.
The tokenizer maps text to its UTF-8 bytes, ids 0..255, like ``data/tokenizer.py``'s
``ByteTokenizer``, and decodes invalid UTF-8 to U+FFFD as it does. It has no special tokens,
so ``generate`` runs to ``max_new_tokens``, as ``tensorpar generate`` does. A GPT trained with
``--tokenizer DIR`` is exported with the run's copy of that tokenizer instead, its end-of-text
and start ids in the config.

A GPT with MoE blocks (``--moe-experts``) is a ``MixtralForCausalLM``, with shared experts a
``Qwen2MoeForCausalLM`` (``moe_kind``); attention, norms, embedding and head as above, and::

    blocks.i.mlp.router              model.layers.i.mlp.gate
    blocks.i.mlp.experts.*           model.layers.i.mlp.experts.{gate_up_proj,down_proj}
    blocks.i.mlp.shared.{gate,up,down}   model.layers.i.mlp.shared_expert.{gate,up,down}_proj

The manifest says what model a checkpoint holds (``model_kind``) and ``EXPORTERS`` picks the
writer: ``"gpt"`` above; ``"hf"``, a run fine-tuned from a Hugging Face model (``train --hf``),
is written back as that model (``export_finetuned.py``). Nothing half-written: the target is
checked first (a new or empty folder in an existing directory), then the checkpoint (every
file's sha256), its config and tensors; everything is written to a hidden folder next to the
target, renamed into place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from tensorpar.checkpoint.export import WRITE_ERRORS, cannot_write
from tensorpar.checkpoint.format import make_readable, model_kind
from tensorpar.checkpoint.load import CheckpointReader
from tensorpar.hf.export_finetuned import Note, Writer, check_tensors, original_model, save_model

DEFAULT_SHARD_SIZE = "5GB"  # the Hub's usual shard (transformers' default was 5GB before v5)
BYTE_VOCAB = 256  # the byte tokenizer's vocabulary (data/tokenizer.py)
MAX_POSITIONS = 2048  # LlamaConfig's default max_position_embeddings

# each GPTConfig field and the LlamaConfig keyword that holds it (None: no Llama field)
LLAMA_FIELDS = {"vocab_size": "vocab_size", "n_layer": "num_hidden_layers", "dim": "hidden_size",
                "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads",
                "hidden_dim": "intermediate_size", "tie_embeddings": "tie_word_embeddings",
                "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "dropout": None}
# a GPT block's parameters and their names in a Llama decoder layer
LLAMA_BLOCK = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
               **{f"attn.{p}_proj": f"self_attn.{p}_proj" for p in "qkvo"},
               **{f"mlp.{p}": f"mlp.{p}_proj" for p in ("gate", "up", "down")}}
# the GPT's Mixture-of-Experts fields (gpt/moe_blocks.py); moe_experts 0 is a dense GPT
MOE_FIELDS = ("moe_experts", "moe_top_k", "moe_shared_experts", "moe_router", "moe_balance",
              "moe_aux_coef", "moe_z_coef", "moe_bias_rate")
# the transformers class of each kind of GPT: dense, routed experts, and shared experts too
CLASSES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM",
           "qwen2_moe": "Qwen2MoeForCausalLM"}


def parse_shard_size(text: str) -> int:
    """'5GB' -> 5e9 bytes, '2GiB' -> 2·2^30, '500MB', '100KB'; the unit is required."""
    units = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
             "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", str(text).lower())
    if not m or m.group(2) not in units or float(m.group(1)) * units[m.group(2)] < 1:
        raise ValueError(f"--max-shard-size {text!r}: expected a size with its unit, like 5GB, "
                         "500MB or 2GiB")
    return int(float(m.group(1)) * units[m.group(2)])


def check_hf_target(out_dir: str | Path, flag: str = "--hf-out") -> Path:
    """``out_dir`` as a Path, or ValueError (one line naming ``flag``): it must be a new or
    empty folder in an existing, writable directory."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out} is a file; name a new or empty folder")
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{flag} {out} is not empty; name a new or empty folder (an export "
                         "never writes over files)")
    parent = out.resolve().parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {out}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {out}: directory {parent} is not writable")
    return out


def _llama_config(reader: CheckpointReader, note: Note) -> dict:
    """LlamaConfig's keywords for the GPT of the manifest, or ValueError naming the field that
    Llama (or the byte tokenizer) cannot express."""
    m, where = reader.manifest, f"checkpoint {reader.dir}"
    cfg = dict(m["config"])
    unknown = sorted(cfg.keys() - LLAMA_FIELDS.keys() - set(MOE_FIELDS))
    if unknown:
        raise ValueError(f"{where}: model field {unknown[0]}={cfg[unknown[0]]!r} has no Llama "
                         f"equivalent (export --hf-out knows {', '.join(LLAMA_FIELDS)} and "
                         f"{', '.join(MOE_FIELDS)})")
    cfg.setdefault("dropout", 0.0)
    if missing := [f for f in LLAMA_FIELDS if f not in cfg]:
        raise ValueError(f"{where}: the manifest's model config has no {missing[0]}")
    for field in ("vocab_size", "n_layer", "dim", "n_head", "n_kv_head", "hidden_dim"):
        if type(cfg[field]) is not int or cfg[field] < 1:
            raise ValueError(f"{where}: model field {field}={cfg[field]!r} must be an int >= 1")
    for field in ("rope_theta", "norm_eps", "dropout"):
        if type(cfg[field]) not in (int, float) or cfg[field] < 0 or \
                field == "rope_theta" and cfg[field] == 0:
            raise ValueError(f"{where}: model field {field}={cfg[field]!r} must be a number "
                             f"{'> 0' if field == 'rope_theta' else '>= 0'}")
    if type(cfg["tie_embeddings"]) is not bool:
        raise ValueError(f"{where}: model field tie_embeddings={cfg['tie_embeddings']!r} must "
                         "be true or false")
    if cfg["n_head"] % cfg["n_kv_head"]:
        raise ValueError(f"{where}: model field n_kv_head={cfg['n_kv_head']} does not divide "
                         f"n_head={cfg['n_head']} (Llama's GQA repeats each KV head alike)")
    if cfg["dim"] % cfg["n_head"] or cfg["dim"] // cfg["n_head"] % 2:
        raise ValueError(f"{where}: model field n_head={cfg['n_head']} does not split "
                         f"dim={cfg['dim']} into even heads (rotary rotates channel pairs)")
    if run_tokenizer_folder(reader) is None and cfg["vocab_size"] != BYTE_VOCAB:
        raise ValueError(f"{where}: model field vocab_size={cfg['vocab_size']} (tokenizer "
                         f"'bytes'): export --hf-out writes the byte tokenizer, "
                         f"{BYTE_VOCAB} tokens")
    if cfg["dropout"]:
        note(f"the GPT's residual dropout {cfg['dropout']} has no Llama field; the export has "
             "no dropout (inference is unchanged)")
    seq_len = (m.get("train") or {}).get("seq_len")
    max_len = max(MAX_POSITIONS, seq_len if isinstance(seq_len, int) else 0)
    kwargs = {llama: cfg[field] for field, llama in LLAMA_FIELDS.items() if llama}
    return kwargs | {"head_dim": cfg["dim"] // cfg["n_head"], "hidden_act": "silu",
                     "max_position_embeddings": max_len, "attention_bias": False,
                     "mlp_bias": False, "attention_dropout": 0.0, "bos_token_id": None,
                     "eos_token_id": None, "pad_token_id": None}


def moe_kind(cfg: dict, where: str) -> tuple[str, dict]:
    """The transformers model a GPT of config ``cfg`` is written as (a key of ``CLASSES``), and
    its config keywords beyond Llama's; ValueError (one line) for MoE blocks no class holds.

    Routed experts alone are Mixtral's layout: the softmax's top k renormalised, SwiGLU experts
    in the fused (E, 2H, D) and (E, D, H) tensors. Shared experts are Qwen2-MoE's: its shared
    expert is one SwiGLU, scaled by sigmoid(x · g) for a gate g of its own; the export writes g
    as zeros and the shared down projection doubled, so the scale is exactly 1/2 of 2."""
    experts = cfg.get("moe_experts", 0)
    if not experts:
        return "llama", {}
    router = cfg.get("moe_router", "softmax")
    if router != "softmax":
        raise ValueError(f"{where}: --moe-router {router} has no transformers class export "
                         "--hf-out writes (Mixtral and Qwen2-MoE route by the softmax's top k); "
                         "--out writes the dense weights")
    common = {"num_experts_per_tok": cfg["moe_top_k"], "output_router_logits": False,
              "router_aux_loss_coef": cfg.get("moe_aux_coef", 0.0)}
    shared = cfg.get("moe_shared_experts", 0)
    if not shared:
        return "mixtral", common | {"num_local_experts": experts, "router_jitter_noise": 0.0,
                                    "sliding_window": None}
    return "qwen2_moe", common | {
        "num_experts": experts, "moe_intermediate_size": cfg["hidden_dim"],
        "shared_expert_intermediate_size": shared * cfg["hidden_dim"], "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": False,
        "use_sliding_window": False}


def moe_names(c: dict, kind: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each MoE block parameter -> (its name in the ``kind`` model, its dense shape)."""
    D, E = c["hidden_size"], c.get("num_local_experts", c.get("num_experts"))
    H = c.get("moe_intermediate_size", c["intermediate_size"])
    names = {}
    for i in range(c["num_hidden_layers"]):
        ours, theirs = f"blocks.{i}.mlp", f"model.layers.{i}.mlp"
        names |= {f"{ours}.router.weight": (f"{theirs}.gate.weight", (E, D)),
                  f"{ours}.experts.gate_up_proj": (f"{theirs}.experts.gate_up_proj",
                                                   (E, 2 * H, D)),
                  f"{ours}.experts.down_proj": (f"{theirs}.experts.down_proj", (E, D, H))}
        if kind == "qwen2_moe":
            S = c["shared_expert_intermediate_size"]
            for p, shape in (("gate", (S, D)), ("up", (S, D)), ("down", (D, S))):
                names[f"{ours}.shared.{p}.weight"] = (f"{theirs}.shared_expert.{p}_proj.weight",
                                                      shape)
    return names


def llama_names(c: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each GPT parameter -> (its Llama name, its dense shape), for LlamaConfig keywords ``c``."""
    D, F, V, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    H, KV = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    block = {"attn_norm": (D,), "mlp_norm": (D,), "attn.q_proj": (H, D), "attn.k_proj": (KV, D),
             "attn.v_proj": (KV, D), "attn.o_proj": (D, H), "mlp.gate": (F, D),
             "mlp.up": (F, D), "mlp.down": (D, F)}
    names = {"embed.weight": ("model.embed_tokens.weight", (V, D)),
             "norm.weight": ("model.norm.weight", (D,))}
    for i in range(c["num_hidden_layers"]):
        for mine, shape in block.items():
            names[f"blocks.{i}.{mine}.weight"] = (f"model.layers.{i}.{LLAMA_BLOCK[mine]}.weight",
                                                  shape)
    if not c["tie_word_embeddings"]:
        names["lm_head.weight"] = ("lm_head.weight", (V, D))
    return names


def byte_tokenizer():
    """A ``tokenizers.Tokenizer`` mapping text to its UTF-8 bytes, byte b -> id b: GPT-2's
    byte-level pre-tokenizer (each byte as one printable character, no regex split, no prefix
    space) and a BPE model without merges whose vocabulary is those 256 characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the others for
    # U+0100 onwards, in byte order
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    vocab, shifted = {}, 0
    for b in range(BYTE_VOCAB):
        vocab[chr(b) if b in printable else chr(0x100 + shifted)] = b
        shifted += b not in printable
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def run_tokenizer_folder(reader: CheckpointReader) -> Path | None:
    """The tokenizer folder a GPT run trained with ``--tokenizer`` keeps beside its checkpoints
    (``RUN/tokenizer``); None for bytes."""
    kind = reader.manifest.get("tokenizer", "bytes")
    if kind == "bytes":
        return None
    folder = reader.dir.parent / reader.manifest.get("tokenizer_files", "tokenizer")
    if kind != "hf" or not folder.is_dir():
        raise ValueError(f"checkpoint {reader.dir}: its tokenizer ({kind!r}, {folder}) is "
                         "missing or not one export --hf-out writes")
    return folder


def _write_tokenizer(folder: Path) -> None:
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    # a class transformers 4 and 5 both load; no cleanup of spaces (" ." stays " .")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _gpt_names(kwargs: dict, kind: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each GPT parameter -> (its name in the ``kind`` model, its dense shape)."""
    names = llama_names(kwargs)
    if kind != "llama":  # the MLP's three linears are the MoE block's
        names = {k: v for k, v in names.items()
                 if not k.endswith(("mlp.gate.weight", "mlp.up.weight", "mlp.down.weight"))}
        names |= moe_names(kwargs, kind)
    return names


def _moe_state(state: dict, kwargs: dict) -> None:
    """Qwen2-MoE's shared-expert gates (``moe_kind``): zeros, and each shared down doubled."""
    for key in [k for k in state if k.endswith("shared_expert.down_proj.weight")]:
        state[key] = state[key] * 2
        gate = key.replace("shared_expert.down_proj", "shared_expert_gate")
        state[gate] = torch.zeros(1, kwargs["hidden_size"], dtype=state[key].dtype)


def _gpt_to_llama(reader: CheckpointReader, max_shard_size: int, note: Note) -> Writer:
    """Check that the GPT of ``reader`` is a Llama (with MoE blocks: a Mixtral or a Qwen2-MoE,
    ``moe_kind``); return what writes its folder."""
    import transformers

    kwargs = _llama_config(reader, note)
    kind, moe = moe_kind(reader.manifest["config"], f"checkpoint {reader.dir}")
    if kind != "llama":  # Llama's MLP and attention biases have no place there
        kwargs = {k: v for k, v in kwargs.items() if k not in ("mlp_bias", "attention_bias")}
        kwargs |= moe
    names = _gpt_names(kwargs, kind)
    check_tensors(reader, names, f"a {CLASSES[kind].removesuffix('ForCausalLM')}")
    source = run_tokenizer_folder(reader)
    tokenizer = None if source is None else \
        transformers.AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    if tokenizer is not None:  # the run's own tokenizer: its end-of-text ends generation
        kwargs |= {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}

    def write(folder: Path) -> None:
        model_class = getattr(transformers, CLASSES[kind])
        config = model_class.config_class(**kwargs)
        with torch.device("meta"):  # no weights drawn: each is assigned below
            model = model_class(config)
        state = {hf: reader.read(name).contiguous() for name, (hf, _) in names.items()}
        _moe_state(state, kwargs)
        if config.tie_word_embeddings:  # one tensor; save_pretrained writes it once
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict(state, strict=True, assign=True)
        save_model(model, folder, max_shard_size)
        if tokenizer is None:
            _write_tokenizer(folder)
        else:
            tokenizer.save_pretrained(str(folder))

    return write


# model_kind -> (reader, max shard bytes, note) -> writer, after every check has passed
EXPORTERS: dict[str, Callable[[CheckpointReader, int, Note], Writer]] = {
    "gpt": _gpt_to_llama, "hf": original_model}


def _write_folder(out: Path, write: Writer) -> None:
    """``write(tmp)`` into a hidden folder next to ``out``, then rename it to ``out`` (a new
    name, or an empty folder it replaces): ``out`` is absent (or empty) or whole, never half
    written, and a failed write leaves no temporary folder."""
    out = out.resolve()
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir()
        write(tmp)
        for f in tmp.rglob("*"):
            if f.is_file():
                make_readable(f)  # safetensors writes 0600
        os.rename(tmp, out)  # fails, rather than merging, if out is no longer empty
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def export_hf(ckpt: str | Path, out_dir: str | Path,
              max_shard_size: str | int = DEFAULT_SHARD_SIZE, note: Note | None = None) -> Path:
    """Write the checkpoint ``ckpt`` (a run directory: its newest checkpoint) as a Hugging Face
    model folder ``out_dir``; see the module docstring. ``max_shard_size``: bytes, or a size
    with its unit ('5GB'). ``note``: called with a line for each thing the export drops.

    Raises ValueError (one line) for a target that is not a new or empty folder, a checkpoint
    that is missing or corrupted, a model the folder cannot express, or a failed write; nothing
    is left behind then."""

    out = check_hf_target(out_dir)
    limit = max_shard_size if isinstance(max_shard_size, int) else \
        parse_shard_size(max_shard_size)
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError("--hf-out needs transformers: pip install tensorpar[hf]") from None
    reader = CheckpointReader(ckpt)
    reader.verify()
    kind = model_kind(reader.manifest)
    if kind not in EXPORTERS:
        raise ValueError(f"checkpoint {reader.dir} holds a model of kind {kind!r}; export "
                         f"--hf-out writes {', '.join(map(repr, EXPORTERS))}")
    write = EXPORTERS[kind](reader, limit, note or (lambda line: None))
    try:
        _write_folder(out, write)
    except WRITE_ERRORS as e:  # the checks passed, the write did not (disk full)
        raise cannot_write("--hf-out", out, e) from None
    return out


def export_peft(ckpt: str | Path, out_dir: str | Path) -> Path:
    """Write a LoRA run's checkpoint (``train --hf PATH --lora-rank R``) as a PEFT adapter folder
    ``out_dir`` (``adapter_config.json``, ``adapter_model.safetensors``) that
    ``peft.PeftModel.from_pretrained(base, out_dir)`` loads; checked, written and renamed into
    place as ``export_hf``."""
    from tensorpar.hf.export_finetuned import run_files
    from tensorpar.hf.lora import peft_writer

    out = check_hf_target(out_dir, "--peft-out")
    reader = CheckpointReader(ckpt)
    if model_kind(reader.manifest) != "hf":
        raise ValueError(f"--peft-out writes a LoRA run's adapters (train --hf PATH --lora-rank "
                         f"R): {reader.dir} is tensorpar's GPT, which trains every weight; "
                         "--hf-out or --out writes it")
    reader.verify()
    write = peft_writer(reader, run_files(reader))
    try:
        _write_folder(out, write)
    except WRITE_ERRORS as e:
        raise cannot_write("--peft-out", out, e) from None
    return out
