"""``tensorpar plan``: per-rank memory and communication of a training step, before running it.

::

    tensorpar plan --model llama-2-7b --tp 1,2,4,8 --dtype bf16 --device-memory 80GB --seq 4096
    tensorpar plan --config path/to/config.json --tp 2 --dtype fp32,bf16 --json
    tensorpar plan --model gpt2 --tp 4 --split       # which split of gelu(X W1) W2 moves least

Formulas and their checks: ``memory.py`` (memory), ``comm.py`` (communication).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tensorpar.gpt.spec import load_spec
from tensorpar.plan.comm import mlp_split_comparison, predicted_comm
from tensorpar.plan.memory import ADAMW, DTYPES, RECOMPUTE, plan_memory, smallest_fitting
from tensorpar.plan.zoo import PRESETS, preset
from tensorpar.runtime.output import write_atomically

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """'80GB' -> 8e10, '24GiB' -> 24·2^30, '1.5e9' -> 1.5e9."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"--device-memory {text!r}: expected a size like 80GB, 24GiB or 8e10")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: expected integers like 1,2,4,8") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{flag} {text!r}: every value must be >= 1")
    return values


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="per-rank memory and communication of a training step",
                              description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="llama-2-7b", help=f"a preset: {', '.join(PRESETS)}")
    src.add_argument("--config", help="a JSON file: GPTConfig, checkpoint manifest or HF config")
    p.add_argument("--tp", default="1,2,4,8", help="TP size or a list (1,2,4,8): one row each")
    p.add_argument("--dtype", default="bf16",
                   help=f"{', '.join(DTYPES)}, a list, or 'all' (bf16: Megatron-style mixed "
                   "precision at 16 B/param, 18 with its fp32 gradient buffer; bf16-autocast: "
                   "tensorpar's --dtype bf16)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--recompute", default="none", choices=RECOMPUTE)
    p.add_argument("--batch", type=int, default=None,
                   help="micro-batch, sequences per step (default: a manifest's, else 1)")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length (default: a manifest's, else 2048)")
    p.add_argument("--optimizer", choices=ADAMW, default="fused",
                   help="AdamW's implementation: fused (tensorpar's trainer) steps in place; "
                   "foreach (torch's default on cuda) keeps an fp32 temporary per parameter, "
                   "for-loop (torch's default on cpu) two of the largest")
    p.add_argument("--device-memory", default="80GB", help="memory per device (80GB, 24GiB)")
    p.add_argument("--reserve", type=float, default=0.10,
                   help="fraction of device memory kept free (fragmentation, context, buffers)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--png", help="write a chart: per-rank memory by component against TP size")
    p.add_argument("--split", action="store_true",
                   help="also compare the ways of splitting gelu(X W1) W2 (bytes moved)")
    p.set_defaults(func=main)


_AT = {"loss backward": "loss bwd", "block backward": "block bwd", "optimizer step": "opt step"}


def _unit(rows: list[dict]) -> tuple[float, str]:
    """GB for models that need them, MB for small ones."""
    return (1e9, "GB") if max(r["total"] for r in rows) >= 1e9 else (1e6, "MB")


def _fmt(b: float, unit: tuple[float, str]) -> str:
    return f"{b / unit[0]:,.2f}"


def _run_shape(args) -> tuple[int, int]:
    """--batch and --seq, defaulting to a checkpoint manifest's training run."""
    train = {}
    if args.config and (args.batch is None or args.seq is None):
        try:
            path = Path(args.config)
            path = path / "manifest.json" if path.is_dir() else path
            train = json.loads(path.read_text()).get("train") or {}
        except (OSError, ValueError, AttributeError):
            train = {}
    batch = args.batch if args.batch is not None else train.get("batch_size", 1)
    seq = args.seq if args.seq is not None else train.get("seq_len", 2048)
    return batch, seq


def build(args) -> dict:
    """Everything the command shows, as plain data (what --json prints)."""
    spec = load_spec(args.config) if args.config else preset(args.model)
    args.batch, args.seq = _run_shape(args)
    tps = _ints(str(args.tp), "--tp")
    dtypes = list(DTYPES) if args.dtype == "all" else args.dtype.split(",")
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"--dtype {d!r}: expected one of {', '.join(DTYPES)} or all")
    if args.batch < 1 or args.seq < 1:
        raise ValueError(f"--batch {args.batch} and --seq {args.seq} must be >= 1")
    device = parse_bytes(args.device_memory)
    rows = []
    for dtype in dtypes:
        for tp in tps:
            try:
                rows.append(plan_memory(spec, tp, args.batch, args.seq, dtype,
                                        args.sequence_parallel, args.recompute, device,
                                        args.reserve, args.optimizer))
            except ValueError as e:
                raise ValueError(f"--tp {tp} for {spec.name}: {e}") from None
    verdicts = {}
    unit = _unit(rows)
    for dtype in dtypes:
        best = smallest_fitting([r for r in rows if r["dtype"] == dtype])
        verdicts[dtype] = (f"{dtype}: TP={best['tp']} is the smallest that fits "
                           f"({_fmt(best['total'], unit)} of {_fmt(best['usable'], unit)} "
                           f"{unit[1]} usable per device)"
                           if best else f"{dtype}: no TP size in {tps} fits {args.device_memory}")
    comm_dtype = "fp32" if dtypes == ["fp32"] else "bf16"
    rec = "full" if args.recompute == "full" else "none"
    comm = {tp: predicted_comm(spec, args.batch, args.seq, tp, args.sequence_parallel,
                               comm_dtype, rec) for tp in tps}
    out = {"model": spec.name, "params": spec.params(), "rows": rows, "verdict": verdicts,
           "comm": {str(tp): c for tp, c in comm.items()}, "comm_dtype": comm_dtype,
           "adamw": args.optimizer}
    tp0 = tps[0]  # the comparison at the first TP size asked for
    fp32 = plan_memory(spec, tp0, args.batch, args.seq, "fp32", args.sequence_parallel,
                       args.recompute, optimizer=args.optimizer)
    bf16 = plan_memory(spec, tp0, args.batch, args.seq, "bf16", args.sequence_parallel,
                       args.recompute, optimizer=args.optimizer)
    out["savings_16bit"] = {
        "tp": tp0, "weights_fp32": 4 * spec.params(), "weights_16bit": 2 * spec.params(),
        "activations_fp32": fp32["activations"], "activations_bf16": bf16["activations"],
        "peak_fp32": fp32["total"], "peak_bf16": bf16["total"],
        "note": "16-bit halves the weights (what inference needs) and roughly the activations; "
                "mixed-precision training keeps fp32 master weights and AdamW moments (16 B per "
                "parameter either way), so the training peak falls only where activations "
                "dominate it"}
    if args.split:
        out["split"] = mlp_split_comparison(args.batch, args.seq, spec.dim, spec.hidden_dim,
                                            max(tps), 2 if comm_dtype == "bf16" else 4)
    return out


def _write_png(data: dict, path: str, device: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(data["verdict"]), figsize=(5 * len(data["verdict"]), 4),
                             squeeze=False)
    for ax, dtype in zip(axes[0], data["verdict"], strict=True):
        rows = [r for r in data["rows"] if r["dtype"] == dtype]
        x = [str(r["tp"]) for r in rows]
        bottom = [0.0] * len(rows)
        for part, label in (("weights", "weights"), ("optimizer", "optimizer states"),
                            ("peak_bytes", "activations or gradients at the peak")):
            vals = [r[part] / 1e9 for r in rows]
            ax.bar(x, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.axhline(device / 1e9, color="black", linestyle="--", label="device memory")
        ax.set(title=f"{data['model']} {dtype}", xlabel="TP size", ylabel="GB per rank")
        ax.legend(fontsize=7)
    fig.tight_layout()
    write_atomically(Path(path), lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)


def _print_tables(data: dict, args) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
        console = Console(width=120)
    unit = _unit(data["rows"])
    params = data["params"]
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"
    t = Table(title=f"{data['model']} ({size} params), batch {args.batch} x seq {args.seq}"
              f"{', SP' if args.sequence_parallel else ''}, recompute {args.recompute}, "
              f"AdamW {args.optimizer}: {unit[1]} per rank")
    for col in ("dtype", "TP", "weights", "optim", "grads", "activ", "paper", "peak", "at",
                "fits"):
        t.add_column(col, justify="right")
    for r in data["rows"]:
        t.add_row(r["dtype"], str(r["tp"]), *(_fmt(r[k], unit) for k in (
            "weights", "optimizer", "grads", "activations", "activations_paper", "total")),
            _AT[r["peak_at"]], "yes" if r.get("fits") else "no")
    console.print(t)
    console.print("optim: AdamW states (bf16: + fp32 master weights); activ: what tensorpar's "
                  "GPT keeps for backward; paper: Korthikanti et al. 2022. peak = weights + "
                  "optim + the step's largest moment (at): activations and the loss backward's "
                  "temporaries, a block's backward, or gradients and the optimizer step. "
                  "fits: peak <= device memory less the reserve.")
    for line in data["verdict"].values():
        console.print(line)
    s = data["savings_16bit"]
    console.print(f"16-bit vs 32-bit at TP={s['tp']}: weights (whole model) "
                  f"{_fmt(s['weights_fp32'], unit)} -> {_fmt(s['weights_16bit'], unit)} "
                  f"{unit[1]}; activations per rank {_fmt(s['activations_fp32'], unit)} -> "
                  f"{_fmt(s['activations_bf16'], unit)} {unit[1]}; training peak per rank "
                  f"{_fmt(s['peak_fp32'], unit)} -> {_fmt(s['peak_bf16'], unit)} {unit[1]}. "
                  f"{s['note']}")
    c = Table(title=f"communication per step and rank (tensorpar's GPT, "
              f"{data['comm_dtype']} activations)")
    for col in ("TP", "kind", "calls", "payload MB", "ring MB sent"):
        c.add_column(col, justify="right")
    for tp, comm in data["comm"].items():
        for kind, calls in comm["counts"].items():
            c.add_row(tp, kind, str(calls), f"{comm['bytes'][kind] / 1e6:,.1f}",
                      f"{comm['ring_bytes'][kind] / 1e6:,.1f}")
    console.print(c)
    if "split" in data:
        sp = Table(title="gelu(X W1) W2: forward + backward communication")
        for col in ("split", "collectives", "ring MB per rank"):
            sp.add_column(col)
        for r in data["split"]:
            sp.add_row(r["split"], r["collectives"], f"{r['ring_bytes'] / 1e6:,.1f}")
        console.print(sp)
        console.print(f"fewest bytes: {data['split'][0]['split']} (no N x hidden tensor moves)")


def main(args) -> int:
    try:
        data = build(args)
        if args.png:
            _write_png(data, args.png, parse_bytes(args.device_memory))
    except (ValueError, OSError) as e:
        print(f"tensorpar plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        _print_tables(data, args)
    return 0
