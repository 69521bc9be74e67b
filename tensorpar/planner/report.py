"""What ``tensorpar plan`` shows: its tables (rich) and its chart (matplotlib), drawn from the
plain data of ``cli.build`` (what ``--json`` prints)."""

from __future__ import annotations

from pathlib import Path

from tensorpar.runtime.output import write_atomically

_AT = {"loss backward": "loss bwd", "block backward": "block bwd", "optimizer step": "opt step",
       "embedding backward": "embed bwd", "root reduce-scatter": "root RS"}


def _at(where: str) -> str:
    """A moment's short name: "block 3 backward" -> "block 3 bwd"."""
    return _AT.get(where) or where.replace("backward", "bwd").replace("reduce-scatter", "RS")


def unit_for(rows: list[dict]) -> tuple[float, str]:
    """GB for models that need them, MB for small ones."""
    return (1e9, "GB") if max(r["total"] for r in rows) >= 1e9 else (1e6, "MB")


def fmt(b: float, unit: tuple[float, str]) -> str:
    return f"{b / unit[0]:,.2f}"


def write_png(data: dict, path: Path, device: float) -> None:
    """The chart: per-rank memory by component against TP size, one panel per dtype, written
    atomically as a PNG whatever ``path``'s extension; ValueError naming --png if it cannot."""
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
                            ("peak_bytes", "activations or gradients at the peak (+ DP "
                             "buffers)")):
            # DDP's buckets, kept for the whole run, count with the peak's bytes
            vals = [(r[part] + (r["dp_buffers"] if part == "peak_bytes" and r.get("dp_mode")
                                == "ddp" else 0)) / 1e9 for r in rows]
            ax.bar(x, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.axhline(device / 1e9, color="black", linestyle="--", label="device memory")
        split = f" x DP={data['dp']} ({data['dp_mode']})" if data.get("dp_mode") else ""
        ax.set(title=f"{data['model']} {dtype}{split}", xlabel="TP size", ylabel="GB per rank")
        ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    except OSError as e:
        raise ValueError(f"--png {path}: cannot write it ({e.strerror or e})") from None
    finally:
        plt.close(fig)


def print_tables(data: dict, args) -> None:
    """Memory per rank, the verdicts and the 16-bit comparison, communication per step, and
    with --split the MLP splits. ``args``: the command's flags (batch, seq, SP, ...)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:  # piped: do not squeeze the table into 80 columns
        console = Console(width=120)
    unit = unit_for(data["rows"])
    params = data["params"]
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"
    dp, dp_mode = data.get("dp", 1), data.get("dp_mode")
    split = f" x DP={dp} ({dp_mode}, {args.batch // dp} per copy)" if dp_mode else ""
    t = Table(title=f"{data['model']} ({size} params), batch {args.batch}{split} x seq "
              f"{args.seq}{', SP' if args.sequence_parallel else ''}, recompute "
              f"{args.recompute}, AdamW {args.optimizer}: {unit[1]} per rank")
    extra = ("dp buf",) if dp_mode else ()
    for col in ("dtype", "TP", "weights", "optim", "grads", "activ", "paper", *extra, "peak",
                "at", "fits"):
        t.add_column(col, justify="right")
    for r in data["rows"]:
        t.add_row(r["dtype"], str(r["tp"]), *(fmt(r[k], unit) for k in (
            "weights", "optimizer", "grads", "activations", "activations_paper",
            *(("dp_buffers",) if dp_mode else ()), "total")),
            _at(r["peak_at"]), "yes" if r.get("fits") else "no")
    console.print(t)
    console.print("optim: AdamW states (bf16: + fp32 master weights); activ: what tensorpar's "
                  "GPT keeps for backward; paper: Korthikanti et al. 2022. peak = weights + "
                  "optim + the step's largest moment (at): activations and the loss backward's "
                  "temporaries, a block's backward, or gradients and the optimizer step. "
                  "fits: peak <= device memory less the reserve.")
    if dp_mode == "fsdp":
        console.print("FSDP2: weights, optim and grads are this rank's 1/dp shard; dp buf: the "
                      "gathered weights and gradient buffers at the peak (in it).")
    elif dp_mode == "ddp":
        console.print("DDP: dp buf is its gradient buckets, kept the whole run (in the peak).")
    for line in data["verdict"].values():
        console.print(line)
    s = data["savings_16bit"]
    console.print(f"16-bit vs 32-bit at TP={s['tp']}: weights (whole model) "
                  f"{fmt(s['weights_fp32'], unit)} -> {fmt(s['weights_16bit'], unit)} "
                  f"{unit[1]}; activations per rank {fmt(s['activations_fp32'], unit)} -> "
                  f"{fmt(s['activations_bf16'], unit)} {unit[1]}; training peak per rank "
                  f"{fmt(s['peak_fp32'], unit)} -> {fmt(s['peak_bf16'], unit)} {unit[1]}. "
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
    if "dp_comm" in data:
        d = Table(title=f"data-parallel communication per step and rank (DP={dp}, {dp_mode}; "
                  "with the loss reported over dp)")
        for col in ("dtype", "TP", "kind", "calls", "payload MB", "ring MB sent"):
            d.add_column(col, justify="right")
        for dtype, by_tp in data["dp_comm"].items():
            for tp, comm in by_tp.items():
                for kind, calls in comm["counts"].items():
                    d.add_row(dtype, tp, kind, str(calls), f"{comm['bytes'][kind] / 1e6:,.1f}",
                              f"{comm['ring_bytes'][kind] / 1e6:,.1f}")
        console.print(d)
    if "split" in data:
        sp = Table(title="gelu(X W1) W2: forward + backward communication")
        for col in ("split", "collectives", "ring MB per rank"):
            sp.add_column(col)
        for r in data["split"]:
            sp.add_row(r["split"], r["collectives"], f"{r['ring_bytes'] / 1e6:,.1f}")
        console.print(sp)
        console.print(f"fewest bytes: {data['split'][0]['split']} (no N x hidden tensor moves)")
