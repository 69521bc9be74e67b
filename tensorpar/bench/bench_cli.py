"""``tensorpar bench``: time a training step of the same model under every contender.

::

    tensorpar bench                                   # default model, every contender
    tensorpar bench --contenders tensorpar,dtensor --repeats 7 --out runs/bench
    tensorpar bench --dim 256 --n-layer 2 --profile   # smaller model, plus a profile

Writes ``bench.md`` (the table), ``bench.json`` (every number) and ``bench.png`` into ``--out``
(and ``profile.md`` with ``--profile``). Columns: see ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from pathlib import Path

from tensorpar.bench.contenders import CONTENDERS, DEFAULT, parse_contenders
from tensorpar.bench.runner import RunPlan, run_bench
from tensorpar.bench.spec import BenchSpec

_TYPES = {"int": int, "float": float}
_PLAN_HELP = {
    "repeats": "rounds over all contenders (in an order shuffled each round)",
    "steps_per_repeat": "timed steps of each contender per round",
    "warmup": "untimed steps first (>= 2; the last one measures memory and collectives)",
    "tp": "tensor-parallel size of the TP contenders (ranks spawned)",
    "profile": "also profile a few tensorpar steps per rank (profile.md)",
    "profile_steps": "steps under the profiler with --profile",
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``bench`` to ``subparsers``; every BenchSpec and RunPlan field is a flag."""
    p = subparsers.add_parser("bench", help="time a training step: tensorpar vs DTensor TP vs "
                              "megatron-core vs plain PyTorch", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and step")
    for f in dataclasses.fields(BenchSpec):
        g.add_argument(f"--{f.name.replace('_', '-')}", type=_TYPES[f.type], default=f.default,
                       dest=f.name, help=f"{f.metadata['help']} (default {f.default})")
    g = p.add_argument_group("measurement")
    g.add_argument("--contenders", default=",".join(DEFAULT),
                   help=f"comma-separated, from: {', '.join(CONTENDERS)} (default: all)")
    for f in dataclasses.fields(RunPlan):
        flag = f"--{f.name.replace('_', '-')}"
        if f.type == "bool":
            g.add_argument(flag, action="store_true", dest=f.name, help=_PLAN_HELP[f.name])
        else:
            g.add_argument(flag, type=int, default=f.default, dest=f.name,
                           help=f"{_PLAN_HELP[f.name]} (default {f.default})")
    g.add_argument("--out", default="runs/bench", help="output directory (default runs/bench)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from tensorpar.bench.outputs import table, write_results

    spec = BenchSpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BenchSpec)})
    plan = RunPlan(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RunPlan)})
    try:
        names = parse_contenders(args.contenders)
        plan.check()
        spec.check(plan.tp)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)  # before the run: a bad --out loses nothing
        if not os.access(out, os.W_OK):
            raise ValueError(f"--out {out} is not writable")
    except (ValueError, OSError) as e:
        print(f"tensorpar bench: {e}", file=sys.stderr)
        return 2
    results = run_bench(spec, names, plan, log=lambda s: print(s, file=sys.stderr, flush=True))
    command = getattr(args, "command_line", None) or "tensorpar " + shlex.join(sys.argv[1:])
    paths = write_results(results, args.out, command)
    print(table(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    failed = [r["name"] for r in results["contenders"] if r["status"].startswith("failed")]
    return 1 if failed else 0
