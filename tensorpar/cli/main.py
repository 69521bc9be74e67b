"""The ``tensorpar`` command line (also ``python -m tensorpar``).

    tensorpar train --tp 2 --steps 300 --out runs/gpt      train the GPT (see train/loop.py)
    tensorpar train --hf PATH --tp 2 --out runs/ft          fine-tune a HF model (hf_recipe)
    tensorpar prepare docs/*.txt --tokenizer DIR --out data   token shards for train --data data
    tensorpar generate --ckpt runs/gpt --tp 2 --prompt "..."
    tensorpar export --ckpt runs/gpt --out gpt.safetensors  one dense file
    tensorpar export --ckpt runs/gpt --hf-out gpt-hf        a Hugging Face (Llama) folder
    tensorpar verify --tp 2 [--sequence-parallel]           parallel layers vs the dense model
    tensorpar verify --hf PATH --tp 2                       a HF model vs its dense self
    tensorpar verify --pp 2 --tp 2                          a pipelined GPT step vs one device
    tensorpar generate --hf PATH --tp 2 --prompt "..."
    tensorpar plan --model llama-2-7b --tp 1,2,4,8 --dtype bf16 --device-memory 80GB
    tensorpar bench                                          tensorpar vs DTensor TP vs dense

The train flags are the fields of ``TrainConfig`` and ``GPTConfig``, one per field.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import signal
import sys
import traceback

from tensorpar.ranks.failures import EXPECTED, RankError, describe
from tensorpar.ranks.signals import (
    Interrupted,
    await_torchrun_stop,
    ignore_stops,
    signal_name,
    unwinding,
)
from tensorpar.runtime.groups import (
    CHECK_ENV,
    DEVICE_ENV,
    TIMEOUT_ENV,
    check_device,
    checks_wanted,
    env_switch,
    wanted_device,
)
from tensorpar.runtime.torchrun import speaks as speaks_for_all

SILENT_RANK_DELAY_S = 5.0  # a torchrun rank that leaves its error to rank 0 waits this long


COMMANDS = ("train", "prepare", "generate", "export", "verify", "plan", "bench")
DEBUG_ENV = "TENSORPAR_DEBUG"  # on: as --debug (runtime.groups.env_switch reads it)


def _add_global_flags(p: argparse.ArgumentParser, default) -> None:
    """The flags that hold for every rank a command starts; before the command (``tensorpar
    --timeout 60 train``) or after it (``tensorpar train --timeout 60``). ``default``: None on
    the main parser, ``argparse.SUPPRESS`` on a command's, so that a flag given before the
    command is not reset by the command's parser. A command's own flag of the same name keeps
    its meaning there (``tensorpar plan --device``: the device planned for)."""
    g = _GlobalGroup(p.add_argument_group("every command"), p)
    g.add_argument("--debug", action="store_true", default=default or False,
                   help=f"print the tracebacks of expected errors too (or set {DEBUG_ENV}=1) "
                   "(default off)")
    g.add_argument("--timeout", type=float, metavar="SECONDS", default=default,
                   help="how long a collective waits for the other ranks before it fails (a "
                   "rank that stopped answering), for every rank this command starts (default "
                   "600, torch's)")
    g.add_argument("--check-collectives", action=argparse.BooleanOptionalAction, default=default,
                   help="before each collective, compare its op, shapes and dtypes across the "
                   "ranks, so that ranks that feed a layer different shapes fail with one line "
                   "naming the layer and each rank's shape instead of gloo aborting every "
                   "process; slower: a barrier and a small all-gather per collective (torch's "
                   "TORCH_DISTRIBUTED_DEBUG=DETAIL); for every rank this command starts "
                   "(default on for verify, off otherwise; or set TENSORPAR_CHECK_COLLECTIVES=1)")
    g.add_argument("--device", choices=["cpu", "cuda"], dest="rank_device", default=default,
                   help="where every rank this command starts computes: cpu, or cuda, a test "
                   "mode that puts every rank on a GPU over gloo (with one GPU, all ranks on it: "
                   "the CUDA code path at TP > 1 on one GPU; NCCL is faster where there is a GPU "
                   "per rank) (default: the GPUs with NCCL when each rank has one, else the CPU; "
                   "or set TENSORPAR_DEVICE)")


class _GlobalGroup:
    """An argument group that skips a flag its parser already has."""

    def __init__(self, group, parser: argparse.ArgumentParser):
        self.group, self.taken = group, parser._option_string_actions

    def add_argument(self, flag: str, **kwargs) -> None:
        if flag not in self.taken:
            self.group.add_argument(flag, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """The ``tensorpar`` parser with every command (one module each, ``tensorpar/cli/``)."""
    parser = argparse.ArgumentParser(
        prog="tensorpar", allow_abbrev=False,
        description="Megatron-style tensor parallelism for PyTorch.",
        epilog="Errors a user can act on (a bad flag or checkpoint, a full disk, a non-finite "
        "training step, ranks that fed a collective different shapes under "
        "--check-collectives), on any rank, end with one line naming the rank and the cause; exit "
        "status 2 for a request refused before any rank started, 1 otherwise. Anything else "
        "is a bug and prints each failing rank's traceback.")
    _add_global_flags(parser, None)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"tensorpar.cli.{name}").add_parser(sub)
    for command in sub.choices.values():
        command.allow_abbrev = False  # --micro-batch is no --micro-batch-size: flags in full
        _add_global_flags(command, argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``tensorpar`` command's exit status. It sets this process's signal handlers (SIGTERM
    unwinds, ``ignore_stops`` after a signal's end): a caller that goes on restores them."""
    args = build_parser().parse_args(argv)
    if args.timeout is not None:  # every rank started from here reads it (runtime/groups.py)
        if not args.timeout > 0:
            print(f"tensorpar: --timeout {args.timeout} must be > 0 (seconds)", file=sys.stderr)
            return 2
        os.environ[TIMEOUT_ENV] = str(args.timeout)
    # as --timeout: every rank reads it when it creates its process group (runtime/groups.py)
    if args.check_collectives is not None:
        os.environ[CHECK_ENV] = "1" if args.check_collectives else "0"
    elif getattr(args, "check_collectives_by_default", False):  # verify: a check of the layers
        os.environ.setdefault(CHECK_ENV, "1")
    if args.rank_device is not None:  # as --timeout (runtime/groups.py)
        os.environ[DEVICE_ENV] = args.rank_device
    try:  # the switches set in the environment: one line for a value that is neither on nor off
        debug = args.debug or env_switch(DEBUG_ENV)
        checks_wanted()
    except ValueError as e:
        print(f"tensorpar {args.command}: {e}", file=sys.stderr)
        return 2
    # under torchrun every rank runs this: checks made before the ranks meet fail alike on all of
    # them, and rank 0 speaks for them; an error raised on one rank alone is said by that rank
    speaks = speaks_for_all()
    unwinding()  # SIGTERM unwinds as Ctrl-C does: the ranks are stopped cleanly
    late = None  # a Ctrl-C or SIGTERM that came while the command ended
    try:
        check_device(wanted_device())  # --device cuda without a GPU: one line, no rank started
        code = args.func(args)
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
        else:  # a silent rank that exits first makes torchrun stop rank 0 before it speaks
            await_torchrun_stop(SILENT_RANK_DELAY_S)
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
