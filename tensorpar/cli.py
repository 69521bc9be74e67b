"""The ``tensorpar`` command line (also ``python -m tensorpar``).

    tensorpar train --tp 2 --steps 300 --out runs/gpt      train the GPT (see gpt/train.py)
    tensorpar train --hf PATH --tp 2 --out runs/ft          fine-tune a HF model (hf/train.py)
    tensorpar generate --ckpt runs/gpt --tp 2 --prompt "..."
    tensorpar export --ckpt runs/gpt --out gpt.safetensors  one dense file
    tensorpar export --ckpt runs/gpt --hf-out gpt-hf        a Hugging Face (Llama) folder
    tensorpar verify --tp 2 [--sequence-parallel]           parallel layers vs the dense model
    tensorpar verify --hf PATH --tp 2                       a HF model vs its dense self
    tensorpar generate --hf PATH --tp 2 --prompt "..."
    tensorpar plan --model llama-2-7b --tp 1,2,4,8 --dtype bf16 --device-memory 80GB
    tensorpar bench                                          tensorpar vs DTensor TP vs dense

The train flags are the fields of ``TrainConfig`` and ``GPTConfig``, one per field.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import signal
import sys
import threading
import time
import traceback

from tensorpar.runtime import output
from tensorpar.runtime.checking import CHECK_ENV
from tensorpar.runtime.failures import EXPECTED, RankError, describe
from tensorpar.runtime.groups import DEVICE_ENV, TIMEOUT_ENV, check_device, wanted_device
from tensorpar.runtime.stopping import Interrupted, ignore_stops, raise_interrupted, signal_name
from tensorpar.transformer.reference import BlockConfig


def _add_verify(sub) -> None:
    p = sub.add_parser("verify", help="compare the TP layers with the dense model, print errors "
                       "and collective counts; exit 1 on any mismatch")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size: ranks spawned "
                   "(default 2)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="also shard the sequence (default off)")
    p.add_argument("--hf", metavar="PATH", help="instead: a local Hugging Face model directory, "
                   "loaded tensor-parallel and compared layer by layer with the dense model "
                   "(default: tensorpar's own block)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data (default 0)")
    for f in dataclasses.fields(BlockConfig):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default, dest=f.name,
                       help=f"{f.metadata['help']} (default {f.default})")


_TYPES = {"int": int, "float": float, "str": str, "str | None": str, "int | None": int}


def _add_dataclass_flags(p, cls, group_title: str) -> None:
    """One flag per field, default None (so the trainer can tell what was given explicitly)."""
    g = p.add_argument_group(group_title)
    for f in dataclasses.fields(cls):
        flag = f"--{f.name.replace('_', '-')}"
        default = f.metadata.get("default", f.default)
        if f.type == "bool":
            default = "on" if default else "off"
        helptext = f"{f.metadata['help']} (default {default})"
        if f.type == "bool":
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                           dest=f.name, help=helptext)
        else:
            g.add_argument(flag, type=_TYPES[f.type], default=None, dest=f.name, help=helptext)


def _add_train(sub) -> None:
    from tensorpar.gpt.model import GPTConfig
    from tensorpar.gpt.train import TrainConfig

    p = sub.add_parser("train", help="train the GPT, or fine-tune a Hugging Face model, with "
                       "tensor parallelism")
    p.add_argument("--hf", metavar="PATH", help="fine-tune this local Hugging Face causal LM "
                   "(config.json, safetensors, tokenizer) instead of the GPT, without model "
                   "flags; --resume needs no --hf (the run copies the files to --out's hf/) "
                   "(default: none, the GPT)")
    _add_dataclass_flags(p, TrainConfig, "training")
    _add_dataclass_flags(p, GPTConfig, "model (taken from the checkpoint on --resume)")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint or a HF model")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", help="a run directory (its newest checkpoint) or a step-* "
                     "checkpoint directory (this or --hf is required)")
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


def _prompts(args) -> list[str] | None:
    """--prompt (repeated) then the lines of --prompt-file; None when neither was given."""
    if args.prompt is None and args.prompt_file is None:
        return None
    prompts = list(args.prompt or [])
    if args.prompt_file is not None:
        try:
            text = open(args.prompt_file, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--prompt-file {args.prompt_file}: {e}") from None
        prompts += [line for line in text.splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"--prompt-file {args.prompt_file} holds no prompt")
    return prompts


def _run(args) -> int:
    if hasattr(args, "func"):  # subcommands that bring their own parser (plan, bench)
        return args.func(args)
    if args.command == "verify" and args.hf:
        from tensorpar.hf.cli import run_verify_hf

        return 0 if run_verify_hf(args.hf, args.tp, args.seed) else 1
    if args.command == "verify":
        from tensorpar.transformer.verify import run_verify

        sizes = {f.name: getattr(args, f.name) for f in dataclasses.fields(BlockConfig)}
        ok = run_verify(args.tp, args.sequence_parallel, args.seed, BlockConfig(**sizes))
        return 0 if ok else 1
    if args.command == "train":
        from tensorpar.gpt.model import GPTConfig
        from tensorpar.gpt.recipe import GPTRecipe
        from tensorpar.gpt.start import resolve, resumed_kind, run_train
        from tensorpar.gpt.train import TrainConfig

        pick = lambda cls: {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}  # noqa: E731
        kind = resumed_kind(pick(TrainConfig))
        if kind is None and args.resume and args.hf is None:  # a fine-tune with no checkpoint?
            from tensorpar.hf.train import started_as_hf_run

            kind = "hf" if started_as_hf_run(args.out) else None
        if args.hf is not None or kind == "hf":
            from tensorpar.hf.train import resolve_hf

            cfg, recipe, resume_from = resolve_hf(pick(TrainConfig), pick(GPTConfig), args.hf)
        else:
            cfg, model_cfg, resume_from = resolve(pick(TrainConfig), pick(GPTConfig))
            recipe = GPTRecipe(model_cfg)
        return run_train(cfg, recipe, resume_from)
    if args.command == "generate" and args.hf:
        from tensorpar.hf.cli import run_generate_hf

        return run_generate_hf(args.hf, args.tp, _prompts(args), args.prompt_ids,
                               args.max_new_tokens, args.temperature, args.seed,
                               top_k=args.top_k, top_p=args.top_p)
    if args.command == "generate":
        from tensorpar.gpt.generate import run_generate

        prompts = _prompts(args)
        if prompts is None:
            raise ValueError("--prompt or --prompt-file is required with --ckpt")
        return run_generate(args.ckpt, args.tp, prompts, args.max_new_tokens,
                            args.temperature, args.seed, top_k=args.top_k, top_p=args.top_p)
    if args.command == "export":
        from tensorpar.checkpoint.cli import run_export

        return run_export(args)
    return 2


SILENT_RANK_DELAY_S = 5.0  # a torchrun rank that leaves its error to rank 0 waits this long


def build_parser() -> argparse.ArgumentParser:
    """The ``tensorpar`` parser with every subcommand."""
    from tensorpar.bench import bench_cli
    from tensorpar.checkpoint.cli import add_export
    from tensorpar.plan import cli as plan_cli

    parser = argparse.ArgumentParser(
        prog="tensorpar", description="Megatron-style tensor parallelism for PyTorch.",
        epilog="Errors a user can act on (a bad flag or checkpoint, a full disk, a non-finite "
        "training step, ranks that fed a collective different shapes under "
        "--check-collectives), on any rank, end with one line naming the rank and the cause; exit "
        "status 2 for a request refused before any rank started, 1 otherwise. Anything else "
        "is a bug and prints each failing rank's traceback.")
    parser.add_argument("--debug", action="store_true",
                        help="print the tracebacks of expected errors too (give it before the "
                        "command: tensorpar --debug train ...; or set TENSORPAR_DEBUG=1) "
                        "(default off)")
    parser.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="how long a collective waits for the other ranks before it fails "
                        "(a rank that stopped answering), for every rank this command starts; "
                        "give it before the command: tensorpar --timeout 60 train ... "
                        "(default 600, torch's)")
    parser.add_argument("--check-collectives", action=argparse.BooleanOptionalAction,
                        help="before each collective, compare its op, shapes and dtypes across "
                        "the ranks, so that ranks that feed a layer different shapes fail with "
                        "one line naming the layer and each rank's shape instead of gloo "
                        "aborting every process; slower: a barrier and a small all-gather per "
                        "collective (torch's TORCH_DISTRIBUTED_DEBUG=DETAIL); for every rank this "
                        "command starts; give it before the command: tensorpar "
                        "--check-collectives train ... (default on for verify, off otherwise; or "
                        "set TENSORPAR_CHECK_COLLECTIVES=1)")
    parser.add_argument("--device", choices=["cpu", "cuda"], dest="rank_device",
                        help="where every rank this command starts computes: cpu, or cuda, a "
                        "test mode that puts every rank on a GPU over gloo (with one GPU, all "
                        "ranks on it: the CUDA code path at TP > 1 on one GPU; NCCL is faster "
                        "where there is a GPU per rank); give it before the command: tensorpar "
                        "--device cuda train ... (default: the GPUs with NCCL when each rank has "
                        "one, else the CPU; or set TENSORPAR_DEVICE)")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_generate(sub)
    add_export(sub)
    _add_verify(sub)
    plan_cli.add_parser(sub)
    bench_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``tensorpar`` command's exit status. It sets this process's signal handlers (SIGTERM
    unwinds, ``ignore_stops`` after a signal's end): a caller that goes on restores them."""
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("TENSORPAR_DEBUG", "0") not in ("", "0")
    if args.timeout is not None:  # every rank started from here reads it (runtime/groups.py)
        if not args.timeout > 0:
            print(f"tensorpar: --timeout {args.timeout} must be > 0 (seconds)", file=sys.stderr)
            return 2
        os.environ[TIMEOUT_ENV] = str(args.timeout)
    # as --timeout: every rank reads it when it creates its process group (runtime/checking.py)
    if args.check_collectives is not None:
        os.environ[CHECK_ENV] = "1" if args.check_collectives else "0"
    elif args.command == "verify":  # a check of the layers checks their collectives too
        os.environ.setdefault(CHECK_ENV, "1")
    if args.rank_device is not None:  # as --timeout (runtime/groups.py)
        os.environ[DEVICE_ENV] = args.rank_device
    # under torchrun every rank runs this: checks made before the ranks meet fail alike on all of
    # them, and rank 0 speaks for them; an error raised on one rank alone is said by that rank
    speaks = output.speaks()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_interrupted)  # unwind: the ranks are stopped cleanly
    late = None  # a Ctrl-C or SIGTERM that came while the command ended
    try:
        check_device(wanted_device())  # --device cuda without a GPU: one line, no rank started
        code = _run(args)
    except RankError as e:  # spawned ranks failed: one line when expected, else the tracebacks
        if debug or not e.expected:
            traceback.print_exc()
        print(f"tensorpar {args.command}: {e.one_line()}", file=sys.stderr)
        code = 1
    except EXPECTED as e:  # bad sizes, flags or checkpoints (2), or, raised on a rank under
        rank = getattr(e, "rank", None)  # torchrun (which says so itself), any expected error (1)
        if debug:
            traceback.print_exc()
        if speaks or rank is not None:
            where = "" if rank is None else f"rank {rank}: "
            print(f"tensorpar {args.command}: {where}{describe(e)}", file=sys.stderr)
        else:  # a silent rank that exits first makes torchrun stop rank 0 before it speaks:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # wait; torchrun's SIGTERM ends it
            time.sleep(SILENT_RANK_DELAY_S)
        code = 2 if isinstance(e, ValueError) and rank is None else 1
    except KeyboardInterrupt as e:  # Ctrl-C (130) or SIGTERM (143): every rank is stopped
        code = _interrupted(e, args.command, speaks)
    finally:  # the error's frames are gone now: free the process groups they held, while the
        try:  # interpreter is whole (see launch._shut_down)
            gc.collect()
        except KeyboardInterrupt as e:
            late = e
    return code if late is None else _interrupted(late, args.command, speaks)


def _interrupted(e: KeyboardInterrupt, command: str, speaks: bool) -> int:
    """One line for a Ctrl-C or SIGTERM; the exit status is 128 + the signal's number."""
    signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
    ignore_stops()  # one line: a signal that comes while the process leaves is ignored
    if speaks:
        how = "Ctrl-C" if signum == signal.SIGINT else signal_name(signum)
        print(f"tensorpar {command}: interrupted ({how})", file=sys.stderr)
    return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
