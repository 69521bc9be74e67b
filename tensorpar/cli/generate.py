"""``tensorpar generate``: text from a run's checkpoint (``--ckpt``, at any TP size: the GPT, a
fine-tuned Hugging Face model, a LoRA run's adapters on their base) or from a local Hugging Face
model (``--hf``), both on ``--tp`` ranks started here (the models' side: ``gpt/generate.py``,
``hf/``)::

    tensorpar generate --ckpt runs/gpt --tp 2 --prompt "The with statement" --temperature 0.7
    tensorpar generate --hf ./my-llama --tp 2 --prompt "Once upon a time" --max-new-tokens 40
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tensorpar.cli.hf_dir import check_hf_dir, quiet_transformers, run_hf_ranks
from tensorpar.ranks.local import run_ranks
from tensorpar.runtime.torchrun import speaks


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint or a HF model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", help="a run directory (its newest checkpoint) or a step-* "
                     "checkpoint directory, of any run tensorpar train writes: the GPT, a "
                     "fine-tune, a LoRA run (this or --hf is required)")
    src.add_argument("--hf", metavar="PATH", help="a local Hugging Face model directory (this or "
                     "--ckpt is required)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size, any (resharded) "
                   "(default 1)")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="text to continue; repeat for a batch of prompts of any lengths "
                   "(default: none, use --prompt-file)")
    p.add_argument("--prompt-file", metavar="FILE",
                   help="a UTF-8 file of prompts, one per line, empty lines skipped (default: "
                   "none, use --prompt)")
    p.add_argument("--prompt-ids", help="--hf without a tokenizer: token ids, e.g. 1,2,3 "
                   "(default: none, use --prompt)")
    p.add_argument("--max-new-tokens", type=int, default=200,
                   help="tokens to add per prompt, at most: fewer where a sequence ends with the "
                   "tokenizer's end-of-text (default 200)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; above 0: sampling (default 0)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k most likely tokens only; 0: all (default 0)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens whose probabilities sum to p; "
                   "1: all (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--chat", action="store_true",
                   help="each prompt is a user message, rendered by the model's chat template "
                   "with the generation prompt; prints the reply alone, without special tokens "
                   "(a Hugging Face model: --hf, or a run of train --hf, LoRA too) (default off)")
    p.set_defaults(func=run)


def prompts_of(args) -> list[str] | None:
    """--prompt (repeated) then the lines of --prompt-file; None when neither was given."""
    if args.prompt is None and args.prompt_file is None:
        return None
    prompts = list(args.prompt or [])
    if args.prompt_file is not None:
        text = _read_prompts(args.prompt_file)
        prompts += [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"--prompt-file {args.prompt_file} holds no prompt")
    return prompts


def _read_prompts(path: str) -> str:
    """The text of --prompt-file, or one line on why it cannot be read."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"--prompt-file {path} is a folder: expected a UTF-8 file of prompts, "
                         "one a line")
    if not p.is_file():
        raise ValueError(f"--prompt-file {path}: no such file")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompt-file {path}: not UTF-8 text (byte {e.object[e.start]:#04x} "
                         f"at offset {e.start:,})") from None
    except OSError as e:
        raise ValueError(f"--prompt-file {path}: {e.strerror or e}") from None


def run(args) -> int:
    if args.hf:
        return run_generate_hf(args.hf, args.tp, prompts_of(args), args.prompt_ids,
                               args.max_new_tokens, args.temperature, args.seed,
                               top_k=args.top_k, top_p=args.top_p, chat=args.chat)
    from tensorpar.checkpoint.format import model_kind
    from tensorpar.checkpoint.load import CheckpointReader

    prompts = prompts_of(args)
    if model_kind(CheckpointReader(args.ckpt).manifest) == "hf":  # a run of train --hf
        return run_generate_hf(None, args.tp, prompts, args.prompt_ids, args.max_new_tokens,
                               args.temperature, args.seed, top_k=args.top_k, top_p=args.top_p,
                               ckpt=args.ckpt, chat=args.chat)
    if args.chat:
        raise ValueError(f"--chat renders prompts with a Hugging Face model's chat template: "
                         f"{args.ckpt} is tensorpar's GPT (generate --ckpt of a run of train "
                         "--hf, or --hf PATH)")
    if prompts is None:
        raise ValueError("--prompt or --prompt-file is required with --ckpt")
    return run_generate(args.ckpt, args.tp, prompts, args.max_new_tokens,
                        args.temperature, args.seed, top_k=args.top_k, top_p=args.top_p)


def run_generate(ckpt: str, tp: int, prompts: list[str], max_new_tokens: int,
                 temperature: float, seed: int, top_k: int = 0, top_p: float = 1.0) -> int:
    """``tensorpar generate --ckpt``: continue each prompt on ``tp`` ranks and print the texts
    (one prompt: its text; several: separated by ``--- i`` lines, see ``gpt/generate.py``)."""
    from tensorpar.gpt.generate import check_request, format_completions, generate_rank

    check_request(ckpt, prompts, max_new_tokens, temperature, tp, top_k, top_p)
    texts = run_ranks(generate_rank, tp, ckpt, prompts, max_new_tokens, temperature, seed,
                      top_k, top_p)
    if speaks() and texts[0] is not None:  # rank 0's texts, said once (under torchrun: rank 0)
        sys.stdout.write(format_completions(texts[0]))
        sys.stdout.flush()
    return 0


def _eos_and_pad(model, tok) -> tuple[list[int], int]:
    """The end-of-text ids (generation config, model config, then tokenizer) and the id that
    pads: the generation config's, else the first end-of-text id, else 0."""
    gen_cfg = model.generation_config
    eos = next((e for e in (gen_cfg.eos_token_id, model.config.eos_token_id,
                            tok.eos_token_id if tok is not None else None) if e is not None), [])
    eos = [eos] if isinstance(eos, int) else list(eos)
    pad = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else (eos[0] if eos else 0)
    return eos, pad


def _model(path: str, ckpt: str | None, group):
    """The model to generate with: the folder ``path``, or the checkpoint ``ckpt`` of a run of
    ``train --hf`` (``path`` then its copy of the model's files): a fine-tune's weights, or a
    LoRA run's adapters on the base model it names."""
    from tensorpar.hf.pretrained import from_pretrained

    if ckpt is None:
        return from_pretrained(path, group)
    from tensorpar.checkpoint.load import CheckpointReader, load_checkpoint
    from tensorpar.hf.lora import add_lora, lora_settings

    manifest = CheckpointReader(ckpt).manifest
    lora = lora_settings(manifest)
    if lora is None:
        model = from_pretrained(path, group, weights=False)
    else:
        model = from_pretrained(lora["base"], group)
        adapted = {n.rsplit(".", 3)[-3] for n in manifest["tensors"]
                   if n.endswith(".lora_A.weight") and not n.startswith("optimizer.")}
        add_lora(model, lora["rank"], lora["alpha"], sorted(adapted))
    load_checkpoint(ckpt, model, check_hashes=False)  # hashed before the ranks started
    return model.eval()


def generate_hf_rank(path: str, prompts: list[str] | None, prompt_ids: list[int] | None,
                     max_new_tokens: int, temperature: float, seed: int, top_k: int = 0,
                     top_p: float = 1.0, ckpt: str | None = None, chat: bool = False,
                     group=None) -> list[str]:
    """Load ``path`` (or the run's checkpoint ``ckpt``, see ``_model``) tensor-parallel and
    continue the prompts (one left-padded batch) or the single sequence ``prompt_ids`` with
    transformers' ``generate``; each sequence stops at its end-of-text token. Returns the
    texts (or the ids, space-separated) on every rank. chat: each prompt is a user message
    rendered by the tokenizer's chat template with the generation prompt, and the text is the
    reply alone, without special tokens."""
    from tensorpar.gpt.generate import left_pad

    transformers = quiet_transformers()
    model = _model(path, ckpt, group)
    tok = transformers.AutoTokenizer.from_pretrained(path) if prompts is not None else None
    if chat:
        seqs = [chat_ids(tok, p) for p in prompts]
    else:
        seqs = [tok(p)["input_ids"] for p in prompts] if tok is not None else [prompt_ids]
    for i, seq in enumerate(seqs):
        if not seq:
            raise ValueError(f"prompt {i + 1} of {len(seqs)} gives no token")
    eos, pad = _eos_and_pad(model, tok)
    ids, mask = left_pad(seqs, pad)
    torch.manual_seed(seed)  # the same on every rank: the gathered logits are, too
    kw = {"do_sample": True, "temperature": temperature, "top_k": top_k, "top_p": top_p} \
        if temperature > 0 else {"do_sample": False}
    if eos:
        kw["eos_token_id"] = eos
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         pad_token_id=pad, **kw).tolist()
    texts = []
    for row, seq in zip(out, seqs, strict=True):
        new = row[ids.shape[1]:]
        ends = [i for i, t in enumerate(new) if t in eos]
        new = new[:ends[0] + 1 if ends else len(new)]  # none after eos
        if chat:
            texts.append(tok.decode(new, skip_special_tokens=True))
            continue
        row = seq + new  # no left padding
        texts.append(tok.decode(row) if tok is not None else " ".join(map(str, row)))
    return texts


def chat_ids(tok, prompt: str) -> list[int]:
    """``prompt`` as a user message, rendered by the chat template with the generation prompt:
    the ids the model continues with its reply."""
    return list(tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                        add_generation_prompt=True,
                                        return_dict=True)["input_ids"])


def _check_chat(path: str, prompts: list[str] | None) -> None:
    """--chat needs prompts and a tokenizer with a chat template."""
    if prompts is None:
        raise ValueError("--chat renders --prompt as a user message: give --prompt or "
                         "--prompt-file, not --prompt-ids")
    tok = quiet_transformers().AutoTokenizer.from_pretrained(path)
    if not tok.chat_template:
        raise ValueError(f"--chat: the tokenizer of {path} has no chat template (its "
                         "tokenizer_config.json's chat_template, or chat_template.jinja)")


def run_generate_hf(path: str | None, n: int, prompts: list[str] | None,
                    prompt_ids: str | None, max_new_tokens: int, temperature: float, seed: int,
                    top_k: int = 0, top_p: float = 1.0, ckpt: str | None = None,
                    chat: bool = False) -> int:
    """``tensorpar generate --hf PATH`` (or ``--ckpt RUN`` of a run of ``train --hf``, full or
    LoRA; ``path`` None): continue each prompt (or the ``--prompt-ids`` sequence) on ``n``
    ranks and print the texts: one prompt, its text; several, separated by ``--- i`` lines
    (see ``tensorpar.gpt.generate``)."""
    from tensorpar.gpt.generate import format_completions
    from tensorpar.gpt.sampling import check_sampling

    if ckpt is not None:
        from tensorpar.checkpoint.load import CheckpointReader
        from tensorpar.hf.export_finetuned import run_files

        reader = CheckpointReader(ckpt)
        reader.verify()
        path, ckpt = str(run_files(reader)), str(reader.dir)
    check_hf_dir(path)
    if n < 1:
        raise ValueError(f"--tp {n} must be >= 1")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens} must be >= 1")
    check_sampling(temperature, top_k, top_p)
    if (prompts is None) == (prompt_ids is None):
        raise ValueError("give --prompt or --prompt-file (with a tokenizer in the model "
                         "directory), or --prompt-ids 1,2,3")
    if prompts is not None and not any((Path(path) / f).is_file()
                                       for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"{path} has no tokenizer: pass --prompt-ids instead of --prompt")
    if chat:
        _check_chat(path, prompts)
    ids = None
    if prompt_ids is not None:
        try:
            ids = [int(t) for t in prompt_ids.split(",")]
        except ValueError:
            raise ValueError(f"--prompt-ids {prompt_ids!r}: expected token ids like 1,2,3") \
                from None
    results = run_hf_ranks(generate_hf_rank, n, path, prompts, ids, max_new_tokens, temperature,
                           seed, top_k, top_p, ckpt, chat)
    if speaks():  # rank 0's completions, once (under torchrun too)
        sys.stdout.write(format_completions(results[0]))
    return 0
