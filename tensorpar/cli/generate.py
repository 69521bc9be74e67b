"""``tensorpar generate``: text from a run's checkpoint (``--ckpt``, at any TP size: the GPT, a
fine-tuned Hugging Face model, a LoRA run's adapters on their base) or from a local Hugging Face
model (``--hf``, ``cli/hf.py``)::

    tensorpar generate --ckpt runs/gpt --tp 2 --prompt "The with statement" --temperature 0.7
    tensorpar generate --hf ./my-llama --tp 2 --prompt "Once upon a time" --max-new-tokens 40
"""

from __future__ import annotations

from pathlib import Path


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
        from tensorpar.cli.hf import run_generate_hf

        return run_generate_hf(args.hf, args.tp, prompts_of(args), args.prompt_ids,
                               args.max_new_tokens, args.temperature, args.seed,
                               top_k=args.top_k, top_p=args.top_p, chat=args.chat)
    from tensorpar.checkpoint.format import model_kind
    from tensorpar.checkpoint.load import CheckpointReader
    from tensorpar.gpt.generate import run_generate

    prompts = prompts_of(args)
    if model_kind(CheckpointReader(args.ckpt).manifest) == "hf":  # a run of train --hf
        from tensorpar.cli.hf import run_generate_hf

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
