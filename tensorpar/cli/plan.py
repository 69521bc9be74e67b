"""``tensorpar plan``: per-rank memory and communication of a training step, before running it.

::

    tensorpar plan --model llama-2-7b --tp 1,2,4,8 --dtype bf16 --device-memory 80GB --seq 4096
    tensorpar plan --config path/to/config.json --tp 2 --dtype fp32,bf16 --json
    tensorpar plan --model gpt2 --tp 4 --split       # which split of gelu(X W1) W2 moves least
    tensorpar plan --model llama-2-70b --tp 8 --dp 8 --dp-mode fsdp --batch 8 --seq 4096
    tensorpar plan --model llama-2-70b --tp 8 --pp 4 --micro-batches 8 --pp-virtual 2
    tensorpar plan --model llama-2-7b --tp 2 --pp 2 --batch-size 16 --seq-len 512 \
        --micro-batch-size 2
    tensorpar plan --model llama-2-70b --devices 64 --device-memory 80GB   # which layouts fit
    tensorpar plan --model llama-3-8b --tp 8 --cp 8 --seq-len 131072 --dtype bf16  # long sequences

The shape flags are ``tensorpar train``'s (``--batch-size``, ``--seq-len``,
``--micro-batch-size``), so a train line's plan is typed as it is; the older ``--batch``,
``--seq`` and ``--micro-batches`` (a count of micro-batches) still work.

Formulas and their checks: ``memory.py`` (memory), ``comm.py`` (communication),
``data_parallel.py`` (FSDP2 and DDP over ``--dp`` copies; under ``--cp`` over the dp x cp
ranks), ``activations.py`` and ``comm.cp_comm`` (``--cp``), ``pipeline.py`` and ``schedule.py``
(``--pp`` stages, the bubble, point to point), ``search.py`` (the ``--devices`` search); the
step they plan is one ``step.Step``, built from the flags by ``step_from_flags``. What the command
says besides its tables (the default model it fell back on, the files it wrote) goes to stderr
with ``--json``, so that stdout stays one JSON document.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from tensorpar.cli.plan_flags import add_layout_flags
from tensorpar.cli.plan_run import apply_run_settings, config_file
from tensorpar.planner.comm import cp_comm, mlp_split_comparison, predicted_comm
from tensorpar.planner.data_parallel import check_dp, dp_comm
from tensorpar.planner.moe_comm import moe_summary
from tensorpar.planner.pipeline import plan_pipeline
from tensorpar.planner.report import (
    fmt,
    print_pipeline,
    print_search,
    print_tables,
    unit_for,
    write_png,
)
from tensorpar.planner.search import search_layouts
from tensorpar.planner.shapes import PRESETS, preset
from tensorpar.planner.step import DTYPES, RECOMPUTE, Step
from tensorpar.planner.tp_plan import plan_memory
from tensorpar.runtime.output import GIB
from tensorpar.train.shape import load_shape

DEFAULT_MODEL = "llama-2-7b"
DEFAULT_TP = "1,2,4,8"
_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

DESCRIPTION = """\
Per-rank memory (weights, AdamW states, gradients, activations, the peak) and communication
of one training step at each TP size and precision, with or without data parallelism (FSDP2 or
DDP over --dp copies), computed from the model's shape before anything runs; and whether it fits
the device memory.

examples:
  tensorpar plan --model llama-2-7b --tp 1,2,4,8 --dtype fp32,bf16 --device-memory 80GB
  tensorpar plan --config runs/gpt/step-00000400 --tp 1,2,4 --dtype fp32
  tensorpar plan --model gpt2 --tp 4 --split --png plan.png
  tensorpar plan --model llama-2-7b --tp 1,2 --dp 8 --dp-mode ddp --batch 8 --device cuda
  tensorpar plan --model llama-2-70b --tp 8 --pp 4 --micro-batches 8 --pp-virtual 2
  tensorpar plan --model llama-2-7b --tp 2 --pp 2 --batch-size 16 --seq-len 512 \
      --micro-batch-size 2          # a tensorpar train line's shape flags, as typed
  tensorpar plan --model llama-2-70b --devices 64 --device-memory 80GB
  tensorpar plan --model llama-3-8b --tp 8 --cp 8 --seq-len 131072 --dtype bf16
"""



def smallest_fitting(rows: list[dict]) -> dict | None:
    """The row with the smallest TP size that fits, or None."""
    fitting = [r for r in rows if r.get("fits")]
    return min(fitting, key=lambda r: r["tp"]) if fitting else None


def parse_bytes(text: str) -> float:
    """'80GB' -> 8e10, '24GiB' -> 24·2^30, '1.5e9B' -> 1.5e9. A size needs its unit: '80'
    alone (80 bytes? 80 GB?) is refused."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in _UNITS | {"": 0}:
        raise ValueError(f"--device-memory {text!r}: expected a size with a unit, like 80GB, "
                         "24GiB or 512MB")
    if not m.group(2):
        n = m.group(1)
        raise ValueError(f"--device-memory {text!r}: give the unit, e.g. " +
                         (f"{n}B (bytes)" if "e" in n else f"{n}GB or {n}GiB"))
    size = float(m.group(1)) * _UNITS[m.group(2)]
    if size <= 0:
        raise ValueError(f"--device-memory {text!r} must be above 0")
    return size


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected integers like 1,2,4,8") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{flag} {text!r}: every value must be >= 1")
    return values


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``plan`` to ``subparsers``; returns its parser."""
    p = subparsers.add_parser("plan", help="per-rank memory and communication of a training step",
                              description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None,
                     help=f"a preset: {', '.join(PRESETS)} (default {DEFAULT_MODEL}, with a note "
                     "on stderr)")
    src.add_argument("--config", metavar="FILE",
                     help="instead of --model: a JSON file (a GPTConfig, a checkpoint's "
                     "manifest.json or its directory, a Hugging Face config.json) or a run's "
                     "folder (its newest checkpoint); a checkpoint's run gives the flags not "
                     "given (precision, layout, batch, passes, recompute, SP, LoRA); no "
                     "default")
    p.add_argument("--tp", default=None,
                   help="TP size, or a list like 1,2,4,8: one row each (default 1,2,4,8; 1 with "
                   "--pp; with --devices every size up to 8 the search allows)")
    p.add_argument("--dtype", default=None,
                   help=f"{', '.join(DTYPES)}, a list, or all. bf16: Megatron-style mixed "
                   "precision at 16 B/param (18 with its fp32 gradient buffer); bf16-autocast: "
                   "what tensorpar train --dtype bf16 does (default: a run's, else bf16)")
    p.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="plan with sequence parallelism (default: a run's, else off)")
    p.add_argument("--recompute", default=None, choices=RECOMPUTE,
                   help="activation recomputation: none, selective (the attention core) or "
                   "full (each block) (default: a run's, else none)")
    p.add_argument("--batch-size", "--batch", dest="batch", type=int, default=None,
                   help="sequences per step, split over the --dp copies, as tensorpar train's "
                   "--batch-size (default: a manifest's, else 1 per copy; with --pp 1 per "
                   "micro-batch, with --devices 1 per device)")
    p.add_argument("--seq-len", "--seq", dest="seq", type=int, default=None,
                   help="tokens per sequence, as tensorpar train's --seq-len (default: a "
                   "manifest's, else 2048)")
    p.add_argument("--micro-batch-size", type=int, default=None,
                   help="sequences each data-parallel copy runs per forward and backward pass, "
                   "as tensorpar train's: the step's --batch-size / (--dp x this) passes (or "
                   "pipeline micro-batches); instead of --micro-batches (default: one pass, "
                   "or with --pp one sequence each)")
    add_layout_flags(p)
    p.set_defaults(func=main)
    return p


def _preset(name: str):
    try:
        return preset(name)
    except ValueError:
        raise ValueError(f"--model {name!r}: not a preset; choose from {', '.join(PRESETS)}, "
                         "or give --config FILE") from None


CONFIG_KINDS = ("a GPTConfig, a checkpoint's manifest.json or its directory, or a Hugging Face "
                "config.json")


def _config_shape(config: str):
    """The shape of ``--config FILE``, or ValueError (one line) for a file that is not a JSON
    text: a binary file, or text that does not parse."""
    path = config_file(config)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--config {path} is not a text file (binary data); expected a JSON "
                         f"file: {CONFIG_KINDS}") from None
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {path} is not JSON ({e.msg} at line {e.lineno}, column "
                         f"{e.colno}); expected {CONFIG_KINDS}") from None
    return load_shape(path)


def _shape(args):
    """The model: --config's, or the --model preset (default ``DEFAULT_MODEL``)."""
    return _config_shape(args.config) if args.config else _preset(args.model or DEFAULT_MODEL)


def step_from_flags(args, shape, **layout) -> Step:
    """The step the flags describe (``planner.step.Step``): ``args``' batch, sequence,
    precision (one --dtype; ``layout`` may give another), recomputation, data parallelism,
    AdamW and device; ``layout``: the fields the command sets itself (tp, pp, micro-batches,
    ...)."""
    fields = {"tp": 1, "batch": args.batch, "seq": args.seq, "dtype": args.dtype,
              "sequence_parallel": args.sequence_parallel, "recompute": args.recompute,
              "dp": args.dp, "dp_mode": args.dp_mode, "optimizer": args.optimizer,
              "device": args.device, "lora": getattr(args, "lora", None),
              "packed": getattr(args, "packed", False),
              "converted": getattr(args, "converted", None), "ep": getattr(args, "ep", 1),
              "cp": getattr(args, "cp", None) or 1}
    return Step(shape, **(fields | layout))


def _micro_batches(args, pp: int) -> int | None:
    """--micro-batches, or the count --micro-batch-size gives (the step's --batch-size / (--dp x
    it), as tensorpar train counts its passes); None when neither is given. Without
    --batch-size, the batch is then the count's default (2 x --pp, or 1) of micro-batches of
    that size."""
    size = args.micro_batch_size
    if size is None:
        return args.micro_batches
    if args.micro_batches is not None:
        raise ValueError("--micro-batch-size and --micro-batches both give the micro-batches: "
                         "give one")
    if size < 1:
        raise ValueError(f"--micro-batch-size {size} must be >= 1")
    if args.batch is None:
        args.batch = args.dp * (2 * pp if pp > 1 else 1) * size
    per_copy = args.batch // args.dp
    if args.batch % args.dp == 0 and per_copy % size:
        raise ValueError(f"--micro-batch-size {size} does not divide the {per_copy} sequences "
                         "of each data-parallel copy (--batch-size / --dp)")
    return max(1, per_copy // size)


def _run_shape(args, default_batch: int | None = None) -> tuple[int, int]:
    """--batch and --seq, defaulting to a checkpoint manifest's training run (else
    ``default_batch``, one sequence per data-parallel copy unless given; 2048 tokens)."""
    train = getattr(args, "run_settings", {})
    default_batch = args.dp if default_batch is None else default_batch
    batch = args.batch if args.batch is not None else train.get("batch_size", default_batch)
    seq = args.seq if args.seq is not None else train.get("seq_len", 2048)
    return batch, seq


def build(args) -> dict:
    """Everything the command shows, as plain data (what --json prints): the TP rows, or with
    --pp one pipeline layout (``build_pipeline``), or with --devices the search
    (``build_search``)."""
    apply_run_settings(args)  # the flags not given: --config's run's settings, or defaults
    check_dp(args.dp, args.dp_mode)  # before anything is read
    if args.devices is not None:
        return build_search(args)
    if args.pp is not None or args.micro_batches is not None or args.pp_virtual != 1 or \
            args.micro_batch_size is not None:
        return build_pipeline(args)
    shape = _shape(args)
    args.batch, args.seq = _run_shape(args)
    tps = _ints(str(args.tp or DEFAULT_TP), "--tp")
    dtypes = list(DTYPES) if args.dtype == "all" else args.dtype.split(",")
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"--dtype {d!r}: expected one of {', '.join(DTYPES)} or all")
    for flag, value in (("--batch", args.batch), ("--seq", args.seq)):
        if value < 1:
            raise ValueError(f"{flag} {value} must be >= 1")
    dp, dp_mode = args.dp, args.dp_mode
    if args.batch % dp:
        raise ValueError(f"--batch {args.batch} does not split over --dp {dp}: each copy takes "
                         "batch/dp sequences")
    device = parse_bytes(args.device_memory)
    if not 0 <= args.reserve < 1:
        raise ValueError(f"--reserve {args.reserve}: expected a fraction from 0 up to 1 "
                         "(0.1 keeps 10% of the device free)")
    rows, step = [], step_from_flags(args, shape)
    for dtype in dtypes:
        for tp in tps:
            try:
                rows.append(plan_memory(step.replace(tp=tp, dtype=dtype), device, args.reserve))
            except ValueError as e:
                raise ValueError(f"--tp {tp} for {shape.name}: {e}") from None
    verdicts = {}
    unit = unit_for(rows)
    cp = step.cp
    split = (f" x CP={cp}" if cp > 1 else "") + (f" x DP={dp} ({dp_mode})" if dp > 1 else "")
    for dtype in dtypes:
        best = smallest_fitting([r for r in rows if r["dtype"] == dtype])
        verdicts[dtype] = (f"{dtype}: TP={best['tp']}{split} is the smallest that fits "
                           f"({fmt(best['total'], unit)} of {fmt(best['usable'], unit)} "
                           f"{unit[1]} usable per device)"
                           if best else f"{dtype}: no TP size in {tps}{split} fits "
                           f"{args.device_memory}")
    comm_dtype = "fp32" if dtypes == ["fp32"] else "bf16"
    rec = "full" if args.recompute == "full" else "none"
    comm = {tp: predicted_comm(shape, args.batch // dp, step.rank_seq, tp,
                               args.sequence_parallel, comm_dtype, rec) for tp in tps}
    out = {"model": shape.name, "params": shape.params(),
           **moe_summary(step.replace(dtype=comm_dtype), tps), "rows": rows, "verdict": verdicts,
           "comm": {str(tp): c for tp, c in comm.items()}, "comm_dtype": comm_dtype,
           "adamw": args.optimizer, "dp": dp, "dp_mode": dp_mode if dp * cp > 1 else None,
           "cp": cp}
    if cp > 1:  # the K/V all-gathers and reduce-scatters over the CP group
        out["cp_comm"] = {str(tp): cp_comm(shape, args.batch // dp, args.seq, tp, cp, comm_dtype,
                                           rec) for tp in tps}
    if dp * cp > 1:  # what travels on the dp group (the dp x cp ranks): fp32 but for
        # Megatron-style bf16 (and FSDP2's bf16 gathers under bf16-autocast)
        out["dp_comm"] = {dtype: {str(tp): dp_comm(
            shape, tp, dp * cp, dp_mode, 2 if dtype == "bf16" else 4,
            bf16_params=dtype == "bf16-autocast" and dp_mode == "fsdp", ep=args.ep)
            for tp in tps}
            for dtype in dtypes}
    tp0 = tps[0]  # the comparison at the first TP size asked for
    fp32, bf16 = (plan_memory(step.replace(tp=tp0, dtype=dtype)) for dtype in ("fp32", "bf16"))
    out["savings_16bit"] = {
        "tp": tp0, "weights_fp32": 4 * shape.params(), "weights_16bit": 2 * shape.params(),
        "activations_fp32": fp32["activations"], "activations_bf16": bf16["activations"],
        "peak_fp32": fp32["total"], "peak_bf16": bf16["total"],
        "note": "16-bit halves the weights (what inference needs) and roughly the activations; "
                "mixed-precision training keeps fp32 master weights and AdamW moments (16 B per "
                "parameter either way), so the training peak falls only where activations "
                "dominate it"}
    if args.split:
        out["split"] = mlp_split_comparison(args.batch, args.seq, shape.dim, shape.hidden_dim,
                                            max(tps), 2 if comm_dtype == "bf16" else 4)
    return out


def _one_layout_flags(args, what: str) -> str:
    """The one --dtype a pipeline plan or search takes, after refusing the flags that go with
    the TP rows only (--png, --split)."""
    for flag, given in (("--png", args.png), ("--split", args.split)):
        if given:
            raise ValueError(f"{flag} goes with the TP rows, not with {what}")
    if args.dtype == "all" or "," in args.dtype:
        raise ValueError(f"--dtype {args.dtype!r}: {what} plans one precision; give one of "
                         f"{', '.join(DTYPES)}")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype {args.dtype!r}: expected one of {', '.join(DTYPES)}")
    if not 0 <= args.reserve < 1:
        raise ValueError(f"--reserve {args.reserve}: expected a fraction from 0 up to 1 "
                         "(0.1 keeps 10% of the device free)")
    return args.dtype


def _size_flags(args) -> None:
    for flag, value in (("--batch", args.batch), ("--seq", args.seq)):
        if value < 1:
            raise ValueError(f"{flag} {value} must be >= 1")


def build_pipeline(args) -> dict:
    """One (tp, pp, dp) layout (``pipeline.plan_pipeline``): a row per pipeline rank, the
    bubble, the bytes each rank sends. --tp is one size (default 1), --pp 1 without it;
    --micro-batches defaults to one sequence each, and without --batch to 2 x --pp (one, with
    --pp 1) of them."""
    _one_layout_flags(args, "--pp")
    shape = _shape(args)
    tps = _ints(str(args.tp or 1), "--tp")
    if len(tps) > 1:
        raise ValueError(f"--tp {args.tp}: --pp plans one layout; give one TP size (or "
                         "--devices N to search them)")
    pp = 1 if args.pp is None else args.pp
    m = _micro_batches(args, pp)
    args.batch, args.seq = _run_shape(args, args.dp * (m or (2 * pp if pp > 1 else 1)))
    _size_flags(args)
    if m is None:
        m = args.batch // args.dp if args.batch % args.dp == 0 else 1
    device = parse_bytes(args.device_memory)
    step = step_from_flags(args, shape, tp=tps[0], pp=pp, virtual=args.pp_virtual,
                           micro_batches=m)
    try:
        out = plan_pipeline(step, device, args.reserve)
    except ValueError as e:
        raise ValueError(f"--tp {tps[0]} --pp {pp} for {shape.name}: {e}") from None
    return {"plan": "pipeline", "params": shape.params(), "device_memory": device,
            "adamw": args.optimizer} | out


def build_search(args) -> dict:
    """The layouts of --devices devices that fit (``pipeline.search_layouts``), best first; a
    --tp list or a --pp restricts the search. --batch defaults to one sequence per device."""
    what = "--devices"
    dtype = _one_layout_flags(args, what)
    if args.dp != 1:
        raise ValueError(f"--dp {args.dp}: --devices searches the data-parallel size itself; "
                         "drop --dp")
    shape = _shape(args)
    if args.micro_batch_size is not None and args.micro_batches is not None:
        raise ValueError("--micro-batch-size and --micro-batches both give the micro-batches: "
                         "give one")
    args.batch, args.seq = _run_shape(args, args.devices)
    _size_flags(args)
    device = parse_bytes(args.device_memory)
    tps = _ints(str(args.tp), "--tp") if args.tp else None
    out = search_layouts(step_from_flags(args, shape, virtual=args.pp_virtual), args.devices,
                         device, args.reserve, args.micro_batches, tps,
                         None if args.pp is None else [args.pp], args.micro_batch_size,
                         None if args.cp is None else [args.cp])
    if out["layouts"]:
        best = out["layouts"][0]
        ep = f" (EP={best['ep']})" if "ep" in best else ""
        cp = f" x CP={best['cp']}" if best["cp"] > 1 else ""
        verdict = (f"{len(out['layouts'])} of {out['planned']} layouts fit; best: TP={best['tp']}"
                   f"{cp} x PP={best['pp']} x DP={best['dp']}{ep}")
    elif out["smallest"]:
        low = out["smallest"]
        cp = f" x CP={low['cp']}" if low["cp"] > 1 else ""
        verdict = (f"no layout of {args.devices} devices fits {args.device_memory} "
                   f"({out['usable'] / GIB:.1f} GiB usable): the smallest peak is "
                   f"{low['total'] / GIB:.1f} GiB per rank (TP={low['tp']}{cp} x "
                   f"PP={low['pp']} x DP={low['dp']}), which needs devices of "
                   f"{low['total'] / (1 - args.reserve) / GIB:.1f} GiB")
    else:
        verdict = (f"no layout of {args.devices} devices can run {shape.name}: all "
                   f"{len(out['skipped'])} are refused, e.g. {out['skipped'][0]['why']}")
    return {"plan": "search", "params": shape.params(), "dtype": dtype,
            "recompute": args.recompute, "sequence_parallel": args.sequence_parallel,
            "dp_mode": args.dp_mode, "device": args.device, "adamw": args.optimizer,
            "verdict": verdict} | out


def _check_png(path: str) -> Path:
    """``--png``'s file, or ValueError (one line) if it cannot be written: checked before the
    plan is built, so a mistake costs nothing and leaves nothing behind."""
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"--png {out} is a directory; name the file, e.g. {out / 'plan.png'}")
    if out.suffix.lower() != ".png":
        raise ValueError(f"--png {out}: expected a file name ending in .png")
    if not out.parent.is_dir():
        raise ValueError(f"--png {out}: directory {out.parent} does not exist")
    return out


def main(args) -> int:
    """Build the plan and write the chart first: any mistake is one line on stderr (exit 2),
    with nothing printed before it. Then the notes, the tables or JSON, and ``wrote PATH``."""
    try:
        png = _check_png(args.png) if args.png else None
        data = build(args)
        if png:
            write_png(data, png, parse_bytes(args.device_memory))
    except ValueError as e:
        print(f"tensorpar plan: {e}", file=sys.stderr)
        return 2
    if args.model is None and args.config is None:
        print(f"tensorpar plan: planning {DEFAULT_MODEL} (the default; --model NAME or "
              "--config FILE for another)", file=sys.stderr)
    notes = sys.stderr if args.json else sys.stdout  # stdout: only the JSON with --json
    if args.json:
        print(json.dumps(data, indent=1))
    elif data.get("plan") == "pipeline":
        print_pipeline(data)
    elif data.get("plan") == "search":
        print_search(data, args.device_memory)
    else:
        print_tables(data, args)
    if png:
        print(f"wrote {png}", file=notes)
    return 0
