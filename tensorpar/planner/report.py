"""What ``tensorpar plan`` shows: its tables (rich) and its chart (matplotlib), drawn from the
plain data of ``cli.build`` (what ``--json`` prints): the TP rows (``print_tables``), a pipeline
layout's ranks (``print_pipeline``) and the layouts a search found (``print_search``)."""

from __future__ import annotations

from pathlib import Path

from tensorpar.runtime.output import GIB, MIB, write_atomically

_AT = {"loss backward": "loss bwd", "block backward": "block bwd", "optimizer step": "opt step",
       "embedding backward": "embed bwd", "root reduce-scatter": "root RS"}


def _at(where: str) -> str:
    """A moment's short name: "block 3 backward" -> "block 3 bwd"."""
    return _AT.get(where) or where.replace("backward", "bwd").replace("reduce-scatter", "RS")


def unit_for(rows: list[dict]) -> tuple[float, str]:
    """GiB for models that need them, MiB for small ones (binary units, as ``tensorpar train``'s
    summary prints: ``runtime.output``)."""
    return (GIB, "GiB") if max(r["total"] for r in rows) >= GIB else (MIB, "MiB")


def fmt(b: float, unit: tuple[float, str]) -> str:
    return f"{b / unit[0]:,.2f}"


def params_text(data: dict) -> str:
    """"46.70B params" for a dense model, "46.70B params, 12.88B active, EP=8" for an MoE one."""
    def size(n):
        return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

    text = f"{size(data['params'])} params"
    if "params_active" in data:
        text += f", {size(data['params_active'])} active, EP={data['ep']}"
    return text


def _console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=120)  # piped: no 80 columns


def _layout_name(d: dict) -> str:
    """"TP=8 x PP=4 (interleaved 1F1B, V=2) x DP=2 (fsdp)" ("TP=8 x CP=2 x ..." under CP)."""
    v = f", V={d['virtual']}" if d["virtual"] > 1 else ""
    dp = f" x DP={d['dp']} ({d['dp_mode']})" if d.get("dp_mode") else f" x DP={d['dp']}"
    cp = f" x CP={d['cp']}" if d.get("cp", 1) > 1 else ""
    return f"TP={d['tp']}{cp} x PP={d['pp']} ({d['schedule']}{v}){dp}"


def print_pipeline(data: dict) -> None:
    """A pipeline layout: memory per pipeline rank (the worst TP rank of each, TP rank 0), the
    bubble, and the bytes each rank sends per step on its tp, pp and dp groups."""
    from rich.table import Table

    console = _console()
    unit = unit_for(data["stages"])
    sp = ", SP" if data["sequence_parallel"] else ""
    t = Table(title=f"{data['model']} ({params_text(data)}), {_layout_name(data)}: batch "
              f"{data['batch']} = {data['dp']} x {data['micro_batches']} micro-batches of "
              f"{data['micro_batch']} x seq {data['seq']}{sp}, {data['dtype']}, recompute "
              f"{data['recompute']}: {unit[1]} per rank")
    for col in ("pp rank", "blocks", "weights", "optim", "grads", "in flight", "activ",
                "pp buf", "dp buf", "peak", "at", "fits"):
        t.add_column(col, justify="right")
    for r in data["stages"]:
        t.add_row(str(r["stage"]), " ".join(r["blocks"]),
                  *(fmt(r[k], unit) for k in ("weights", "optimizer", "grads")),
                  "+".join(map(str, r["in_flight"])), fmt(r["activations"], unit),
                  *(fmt(r[k], unit) for k in ("pp_buffers", "dp_buffers", "total")),
                  _at(r["peak_at"]), "yes" if r.get("fits") else "no")
    console.print(t)
    console.print("blocks: each stage's on the rank (stage s on pp rank s % pp); in flight: "
                  "micro-batches each of them holds at the rank's peak; activ: "
                  "their activations; pp buf: the receive buffers of every micro-batch's input "
                  "and output gradient; dp buf: FSDP2's gathered weights and reduce-scatter "
                  "buffer, or DDP's buckets. peak = weights + optim + the step's largest moment "
                  "(activations in flight + accumulated gradients + buffers, or the optimizer "
                  "step).")
    p, v, m = data["pp"], data["virtual"], data["micro_batches"]
    formula = f"(P-1)/m = {p - 1}/{m}" if v == 1 else f"(P-1)/(V·m) = {p - 1}/({v}·{m})"
    console.print(f"bubble: {formula} = {data['bubble']:.1%} of the ideal step's time "
                  "(Narayanan et al. 2021)")
    each = data["p2p"]["per_rank"][0]["bytes_each"]
    console.print(f"point to point: 2·m·(S-1) = {data['p2p']['sends']} sends per step over "
                  f"S = {p * v} stages, {each / MIB:,.1f} MiB each ((micro, seq, dim) fp32"
                  f"{', / tp under SP' if data['sequence_parallel'] else ''}), "
                  f"{data['p2p']['bytes'] / GIB:,.2f} GiB in all")
    c = Table(title="bytes each rank sends per step (MiB; tp and dp: ring bytes of their "
              "collectives)")
    for col in ("pp rank", "activations", "gradients", "pp MiB", "tp MiB", "dp MiB"):
        c.add_column(col, justify="right")
    for r, sent, comm in zip(data["stages"], data["p2p"]["per_rank"], data["comm"], strict=True):
        c.add_row(str(r["stage"]), str(sent["activations"]), str(sent["gradients"]),
                  *(f"{comm[g] / MIB:,.1f}" for g in ("pp", "tp", "dp")))
    console.print(c)
    worst = data["stages"][data["worst"]]
    if data.get("usable") is not None:
        verdict = "fits" if data["fits"] else "does not fit"
        console.print(f"{verdict}: the largest rank (pp rank {worst['stage']}) peaks at "
                      f"{fmt(worst['total'], unit)} of {fmt(data['usable'], unit)} {unit[1]} "
                      "usable per device")


def print_search(data: dict, device_memory: str) -> None:
    """The layouts of a search that fit, best first, or why none does."""
    from rich.table import Table

    console = _console()
    t = Table(title=f"{data['model']} on {data['devices']} x {device_memory} "
              f"({data['usable'] / GIB:.1f} GiB usable each): batch {data['batch']} x seq "
              f"{data['seq']}, {data['dtype']}, recompute {data['recompute']}; the layouts that "
              "fit, by estimated step time")
    moe = any("ep" in r for r in data["layouts"])
    cp = any(r["cp"] > 1 for r in data["layouts"])
    ep_cols = ("EP",) if moe else ()
    for col in ("TP", *(("CP",) if cp else ()), "PP", "DP", *ep_cols, "schedule",
                "micro-batches", "peak GiB", "worst", "bubble", "tp GiB",
                *(("cp GiB",) if cp else ()), "pp GiB", "dp GiB", *(("ep GiB",) if moe else ()),
                "est. step s"):
        t.add_column(col, justify="right")
    for r in data["layouts"]:
        groups = ("tp", *(("cp",) if cp else ()), "pp", "dp", *(("ep",) if moe else ()))
        t.add_row(str(r["tp"]), *((str(r["cp"]),) if cp else ()), str(r["pp"]), str(r["dp"]),
                  *((str(r["ep"]),) if moe else ()),
                  r["schedule"] + (f", V={r['virtual']}" if r["virtual"] > 1 else ""),
                  f"{r['micro_batches']} x {r['micro_batch']}", f"{r['total'] / GIB:,.1f}",
                  f"pp {r['worst']}", f"{r['bubble']:.1%}",
                  *(f"{r['sends'].get(g, 0) / GIB:,.1f}" for g in groups),
                  f"{r['step_seconds']:,.2f}")
    if data["layouts"]:
        console.print(t)
        console.print("peak: the largest pipeline rank's (worst); tp, pp, dp GiB: what the "
                      "busiest rank sends per step on each group (ring bytes of the "
                      "collectives, point to point). est. step s ranks them: the step's FLOPs "
                      "per device at 400 TFLOP/s stretched by the bubble, plus the bytes at "
                      "450 GB/s inside a node of 8 and 50 GB/s between nodes, no overlap "
                      "(a proxy, not a prediction).")
    console.print(data["verdict"])


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
                                == "ddp" else 0)) / GIB for r in rows]
            ax.bar(x, vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.axhline(device / GIB, color="black", linestyle="--", label="device memory")
        split = f" x DP={data['dp']} ({data['dp_mode']})" if data.get("dp_mode") else ""
        ax.set(title=f"{data['model']} {dtype}{split}", xlabel="TP size", ylabel="GiB per rank")
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
    dp, dp_mode = data.get("dp", 1), data.get("dp_mode")
    split = f" x DP={dp} ({dp_mode}, {args.batch // dp} per copy)" if dp > 1 else ""
    cp = data.get("cp", 1)
    split += f" x CP={cp} (each sequence over {cp} ranks)" if cp > 1 else ""
    t = Table(title=f"{data['model']} ({params_text(data)}), batch {args.batch}{split} x seq "
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
        console.print("FSDP2: weights, optim and grads are this rank's 1/dp shard (1/(dp x cp) "
                      "under CP); dp buf: the gathered weights and gradient buffers at the peak "
                      "(in it).")
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
    for col in ("TP", "kind", "calls", "payload MiB", "ring MiB sent"):
        c.add_column(col, justify="right")
    _kind_rows(c, data["comm"], "ring_bytes")
    console.print(c)
    if "ep_comm" in data:
        print_ep_comm(console, data)
    if "cp_comm" in data:
        c = Table(title=f"context-parallel communication per step and rank (CP={cp}: K and V "
                  "all-gathered forward, their gradients reduce-scattered backward)")
        for col in ("TP", "kind", "calls", "payload MiB", "ring MiB sent"):
            c.add_column(col, justify="right")
        _kind_rows(c, data["cp_comm"], "ring_bytes")
        console.print(c)
    if "dp_comm" in data:
        over = f"DP={dp} x CP={cp} ranks" if cp > 1 else f"DP={dp}"
        d = Table(title=f"data-parallel communication per step and rank ({over}, {dp_mode}; "
                  "with the loss reported over dp)")
        for col in ("dtype", "TP", "kind", "calls", "payload MiB", "ring MiB sent"):
            d.add_column(col, justify="right")
        for dtype, by_tp in data["dp_comm"].items():
            _kind_rows(d, by_tp, "ring_bytes", dtype)
        console.print(d)
    if "split" in data:
        sp = Table(title="gelu(X W1) W2: forward + backward communication")
        for col in ("split", "collectives", "ring MiB per rank"):
            sp.add_column(col)
        for r in data["split"]:
            sp.add_row(r["split"], r["collectives"], f"{r['ring_bytes'] / MIB:,.1f}")
        console.print(sp)
        console.print(f"fewest bytes: {data['split'][0]['split']} (no N x hidden tensor moves)")


def print_ep_comm(console, data: dict) -> None:
    """An MoE model's active parameters and its EP collectives per step (``moe_comm``)."""
    from rich.table import Table

    console.print(f"MoE: {data['params_active']:,} active parameters per token "
                  f"({data['params_active_no_embedding']:,} without the input embedding); "
                  f"routed experts {data['params_experts']:,}, split over EP={data['ep']} "
                  "ranks; the rest over TP")
    c = Table(title=f"expert-parallel communication per step and rank (EP={data['ep']}; "
              "sent: the even-routing expectation, (ep-1)/ep of the rows)")
    for col in ("TP", "kind", "calls", "payload MiB", "MiB sent"):
        c.add_column(col, justify="right")
    _kind_rows(c, data["ep_comm"], "sent")
    console.print(c)


def _kind_rows(table, by_tp: dict, sent: str, *first: str) -> None:
    """A row per TP size and collective kind: calls, payload and ``sent`` bytes in MiB (the
    columns after ``first``)."""
    for tp, comm in by_tp.items():
        for kind, calls in comm["counts"].items():
            table.add_row(*first, tp, kind, str(calls), f"{comm['bytes'][kind] / MIB:,.1f}",
                          f"{comm[sent][kind] / MIB:,.1f}")
