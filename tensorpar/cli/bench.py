"""``tensorpar bench``: time a training step of the same model under every contender.

::

    tensorpar bench                                   # default model, every contender
    tensorpar bench --contenders tensorpar,dtensor --repeats 7 --out runs/bench
    tensorpar bench --dim 256 --n-layer 2 --profile   # smaller model, plus a profile
    tensorpar bench --compile                         # plus the torch.compile'd contenders
    tensorpar bench --device cuda --dim 2048 --n-layer 16 --n-head 16 --n-kv-head 4 \
        --vocab-size 32000 --seq-len 2048 --batch-size 8   # GPUs: TFLOP/s and MFU too

Writes ``bench.md`` (the table), ``bench.json`` (every number) and ``bench.png`` into ``--out``
(and ``profile.md`` with ``--profile``), each named in a ``wrote`` line; an earlier run's file
that this run does not rewrite is removed. Columns: see ``benchmarks/README.md``. Exit status:
0 when tensorpar's contenders and the reference ran (another library's contender that cannot
run the configuration is a "skipped" row), 1 when one of them failed, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from pathlib import Path

from tensorpar.bench.contenders import (
    COMPILED,
    CONTENDERS,
    DEFAULT,
    DEFAULT_CUDA,
    parse_contenders,
)
from tensorpar.bench.runner import RunPlan, run_bench
from tensorpar.bench.workload import Workload

DESCRIPTION = """\
Time a training step of the same Llama-like model, from the same weights on the same batches,
under each contender: tensorpar, PyTorch's DTensor tensor parallel, megatron-core and plain
PyTorch. Prints a table (step time, tokens/s, memory and bytes sent per rank, loss against the
dense fp32 model) and writes bench.md, bench.json and bench.png (and profile.md with --profile)
into --out. A contender that cannot run the configuration (megatron-core splits heads only
evenly) is listed as skipped, with its reason.

examples:
  tensorpar bench                                   # default model, every contender
  tensorpar bench --contenders tensorpar,dtensor --repeats 7 --out runs/bench
  tensorpar bench --dim 256 --n-layer 2 --profile   # smaller model, plus a profile
  tensorpar bench --compile                         # plus the torch.compile'd contenders
  tensorpar bench --device cuda                     # GPUs: bf16, TFLOP/s and MFU too
"""

_TYPES = {"int": int, "float": float}
_PLAN_HELP = {
    "repeats": "rounds over all contenders (in an order shuffled each round)",
    "steps_per_repeat": "timed steps of each contender per round",
    "warmup": "untimed steps first (>= 2; the last one measures memory and collectives)",
    "tp": "tensor-parallel size of the TP contenders (ranks spawned)",
    "profile": "also profile a few steps of tensorpar and the plain model per rank and write "
               "profile.md (default off)",
    "profile_steps": "steps under the profiler with --profile",
    "compile": f"also run the torch.compile'd contenders ({', '.join(COMPILED)}; default off)",
    "compile_backend": "torch.compile's backend for the -c contenders",
    "device": "cpu (gloo), or cuda: every rank on its own GPU over NCCL, the forward in bf16 "
              "autocast, plus the GPU's measured bf16 matmul peak, model TFLOP/s and MFU; "
              "contenders with more ranks than GPUs are skipped",
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``bench`` to ``subparsers``; every Workload and RunPlan field is a flag."""
    p = subparsers.add_parser("bench", help="time a training step: tensorpar vs DTensor TP vs "
                              "megatron-core vs plain PyTorch", description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and step")
    for f in dataclasses.fields(Workload):
        g.add_argument(f"--{f.name.replace('_', '-')}", type=_TYPES[f.type], default=f.default,
                       dest=f.name, help=f"{f.metadata['help']} (default {f.default})")
    g = p.add_argument_group("measurement")
    g.add_argument("--contenders", default=None,
                   help=f"comma-separated, from: {', '.join(CONTENDERS)} (default: "
                   f"{', '.join(DEFAULT)}; with --device cuda: {', '.join(DEFAULT_CUDA)})")
    for f in dataclasses.fields(RunPlan):
        flag = f"--{f.name.replace('_', '-')}"
        if f.type == "bool":
            g.add_argument(flag, action="store_true", dest=f.name, help=_PLAN_HELP[f.name])
        else:
            g.add_argument(flag, type=int if f.type == "int" else str, default=f.default,
                           dest=f.name, help=f"{_PLAN_HELP[f.name]} (default {f.default})")
    g.add_argument("--out", default="runs/bench",
                   help="output directory, created if missing; the files of an earlier run "
                   "there are replaced, other files are left alone (default runs/bench)")
    p.set_defaults(func=main)
    return p


def _check_out(out: Path) -> None:
    """Create ``--out`` now, before any rank starts: a bad --out loses no measurement."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; name a directory for the results")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out}: cannot create it ({e.strerror or e})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out} is not writable")


def main(args: argparse.Namespace) -> int:
    from tensorpar.bench.outputs import remove_stale, table, write_results

    work = Workload(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Workload)})
    plan = RunPlan(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RunPlan)})
    try:
        default = DEFAULT_CUDA if plan.device == "cuda" else DEFAULT
        names = parse_contenders(args.contenders or ",".join(default))
        if plan.compile:
            names = list(dict.fromkeys([*names, *COMPILED]))
        plan.check()
        work.check(plan.tp)
        _check_out(Path(args.out))
    except ValueError as e:
        print(f"tensorpar bench: {e}", file=sys.stderr)
        return 2
    results = run_bench(work, names, plan, log=lambda s: print(s, file=sys.stderr, flush=True))
    command = getattr(args, "command_line", None) or "tensorpar " + shlex.join(sys.argv[1:])
    paths = write_results(results, args.out, command)
    stale = remove_stale(args.out, paths.values())
    print(table(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    if stale:
        print("removed an earlier run's " + ", ".join(str(p) for p in stale))
    if results["errors"]:
        print("tensorpar bench: failed: " + ", ".join(e["name"] for e in results["errors"])
              + " (tracebacks above)", file=sys.stderr)
        return 1
    return 0
