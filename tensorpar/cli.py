"""The ``tensorpar`` command line (also ``python -m tensorpar``).

    tensorpar verify --tp 2 [--sequence-parallel]   parallel layers vs the dense model
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from tensorpar.reference import BlockConfig


def _add_verify(sub) -> None:
    p = sub.add_parser("verify", help="compare the TP layers with the dense model, print errors "
                       "and collective counts; exit 1 on any mismatch")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (ranks spawned)")
    p.add_argument("--sequence-parallel", action="store_true", help="also shard the sequence")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data")
    for f in dataclasses.fields(BlockConfig):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=f.default, dest=f.name,
                       help=f"{f.metadata['help']} (default {f.default})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tensorpar", description="Megatron-style tensor parallelism for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_verify(sub)
    args = parser.parse_args(argv)
    if args.command == "verify":
        from tensorpar.verify import run_verify

        sizes = {f.name: getattr(args, f.name) for f in dataclasses.fields(BlockConfig)}
        cfg = BlockConfig(**sizes)
        try:
            ok = run_verify(args.tp, args.sequence_parallel, args.seed, cfg)
        except ValueError as e:  # bad sizes: say so plainly, no traceback
            print(f"tensorpar verify: {e}", file=sys.stderr)
            return 2
        return 0 if ok else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
