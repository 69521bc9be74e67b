"""The benchmark's report: a markdown table, the JSON of every number, a PNG chart.

Every file is written to a temporary name in the output directory and renamed into place, so a
reader never sees half a file. Of the files a run can write (``OUTPUTS``), the ones this run did
not write are an earlier run's and are removed (``remove_stale``); other files are left alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from tensorpar.runtime.output import write_atomically

MiB = 2**20
OUTPUTS = ("bench.md", "bench.json", "bench.png", "profile.md")  # every file a run can write


def _text(path: Path, text: str) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _ms(x: float) -> str:
    return f"{1e3 * x:,.1f}"


def _mib(per_rank: list) -> str:
    """The largest rank's bytes in MiB; "n/a" where not measured (None: a compiled contender's
    memory on the CPU in runs before 2026-11-27, whose meter could not see compiled code)."""
    return "n/a" if None in per_rank else f"{max(per_rank) / MiB:,.1f}"


def _calls(calls: dict) -> str:
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS"}
    return " ".join(f"{n} {short.get(k, k)}" for k, n in sorted(calls.items())) or "none"


def _sent(comm: dict) -> str:
    """Bytes each rank sends; "n/a" where the counter saw a collective whose group it could not
    size (it then reports 0 sent for a nonzero payload: DTensor's functional collectives)."""
    if any(comm["payload_bytes"].get(k) and not comm["ring_bytes"].get(k)
           for k in comm["payload_bytes"]):
        return "n/a"
    return f"{sum(comm['ring_bytes'].values()) / MiB:,.2f}"


def table(results: dict) -> str:
    """The markdown table: one row per contender, then the target ratios. On GPUs two more
    columns: model TFLOP/s (over all of a contender's ranks) and MFU against the measured peak."""
    rows = results["contenders"]
    by_name = {r["name"]: r for r in rows if r["status"] == "ok"}
    base = by_name.get("dtensor")
    gpu = results.get("peak_flops") is not None
    head = ("| contender | ranks×threads | step ms (median) | IQR ms | min-max ms | tokens/s "
            + ("| model TFLOP/s | MFU " if gpu else "")
            + "| vs dtensor | peak MiB/rank | state MiB/rank | sent MiB/rank/step | payload "
            "MiB/step | collectives/step | loss max rel diff |")
    width = 15 if gpu else 13
    lines = [head, "|" + "---|" * width]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r.get('ranks_x_threads', '')} | {r['status']} |"
                         + " |" * (width - 3))
            continue
        s = r["step_s"]
        comm = r["comm_per_rank"]
        ratio = f"{s['median'] / base['step_s']['median']:.2f}x" if base else "-"
        diff = r.get("loss_max_rel_diff")
        lines.append(
            f"| {r['name']} | {r['ranks_x_threads']} | {_ms(s['median'])} "
            f"| {_ms(s['q1'])}-{_ms(s['q3'])} | {_ms(s['min'])}-{_ms(s['max'])} "
            f"| {r['tokens_per_s']:,.0f} "
            + (f"| {r['model_tflops']:,.1f} | {100 * r['mfu']:.1f}% " if gpu else "")
            + f"| {ratio} "
            f"| {_mib(r['peak_bytes_per_rank'])} | {_mib(r['state_bytes_per_rank'])} "
            f"| {_sent(comm)} "
            f"| {sum(comm['payload_bytes'].values()) / MiB:,.2f} | {_calls(comm['calls'])} "
            f"| {'-' if diff is None else f'{diff:.1e}'} |")
    notes = []
    if gpu:
        notes.append(f"- bf16 matmul peak measured on this GPU: "
                     f"{results['peak_flops'] / 1e12:,.0f} TFLOP/s (MFU is against it)")
    if any(m.get("meter") == "profiler" for r in by_name.values() for m in r["memory"]):
        notes.append("- compiled contenders' memory on the CPU: read off torch.profiler's "
                     "allocator events, which see the compiled code (the eager rows: a "
                     "TorchDispatchMode, under which torch.compile would run eagerly); at TP > 1 "
                     "it may read high by the overlapped all-reduces' buffers, one activation "
                     "at most each (tensorpar/planner/meter.py)")
    for a, b, what in (("tensorpar", "dtensor", "target <= 0.70"),
                       ("tensorpar", "megatron", "target <= 1.00"),
                       ("hf-llama", "dtensor", "target <= 0.78"),
                       ("hf-llama", "tensorpar", "target <= 1.05"),
                       ("hf-qwen3moe", "hf-qwen3moe-transformers", "target <= 0.85"),
                       ("tensorpar", "dense-Nt", "target <= 1.00: the machine's floor"),
                       ("tensorpar-c", "dense-c", "target <= 1.00"),
                       ("tensorpar-tp1", "dense-1t", "target <= 1.01"),
                       ("tensorpar-tp1-c", "dense-c", "target <= 1.00" if gpu else "")):
        if a in by_name and b in by_name and what:
            q = by_name[a]["step_s"]["median"] / by_name[b]["step_s"]["median"]
            notes.append(f"- {a} / {b} step time: {q:.3f} ({what})")
    return "\n".join(lines) + ("\n\n" + "\n".join(notes) if notes else "") + "\n"


def profile_tables(profiles: list[dict]) -> str:
    """One section per profiled contender; with both tensorpar and tensorpar-unfused, the
    difference of their collective time is what the overlap hides."""
    out = [profile_table(p) for p in profiles]
    by_name = {p["contender"]: p for p in profiles}
    if {"tensorpar", "tensorpar-unfused"} <= set(by_name):
        def waiting(name: str) -> list[float]:
            return [r["categories_ms_per_step"]["collectives and waiting"]
                    for r in by_name[name]["ranks"]]
        fused, plain = waiting("tensorpar"), waiting("tensorpar-unfused")
        out.append("What the overlap (and the in-place row all-reduce) hides: collectives and "
                   "waiting per step, ms, per rank: tensorpar-unfused "
                   f"{', '.join(f'{x:.1f}' for x in plain)}; tensorpar "
                   f"{', '.join(f'{x:.1f}' for x in fused)}.\n")
    return "\n".join(out)


def profile_table(profile: dict) -> str:
    """Per rank: time by category, then the top ops."""
    out = [f"Profile of `{profile['contender']}` (self CPU time per step, torch.profiler)\n"]
    cats = list(profile["ranks"][0]["categories_ms_per_step"])
    out.append("| category | " + " | ".join(f"rank {i} ms" for i in
                                              range(len(profile["ranks"]))) + " |")
    out.append("|---|" + "---|" * len(profile["ranks"]))
    for c in cats:
        out.append(f"| {c} | " + " | ".join(f"{p['categories_ms_per_step'][c]:.1f}"
                                           for p in profile["ranks"]) + " |")
    out.append("| wall time per step | " + " | ".join(f"{p['wall_ms_per_step']:.1f}"
                                                      for p in profile["ranks"]) + " |")
    out += ["\nTop ops on rank 0:\n", "| op | category | ms/step | calls/step |",
            "|---|---|---|---|"]
    for op in profile["ranks"][0]["top_ops"]:
        out.append(f"| `{op['name']}` | {op['category']} | {op['ms_per_step']:.2f} "
                   f"| {op['calls_per_step']:g} |")
    return "\n".join(out) + "\n"


def chart(results: dict, path: Path) -> None:
    """Median step time per contender, the bar's whisker spanning the interquartile range."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["contenders"] if r["status"] == "ok"]
    names = [f"{r['name']}\n({r['ranks_x_threads']})" for r in rows]
    med = [1e3 * r["step_s"]["median"] for r in rows]
    low = [m - 1e3 * r["step_s"]["q1"] for m, r in zip(med, rows, strict=True)]
    high = [1e3 * r["step_s"]["q3"] - m for m, r in zip(med, rows, strict=True)]
    colors = ["tab:blue" if r["name"].startswith("tensorpar") else
              "tab:purple" if r["name"].startswith("hf-") else
              "tab:orange" if r["name"].startswith("dtensor") else
              "tab:green" if r["name"].startswith("megatron") else "tab:gray" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 4.2))
    ax.bar(range(len(rows)), med, yerr=[low, high], capsize=4, color=colors)
    ax.set_xticks(range(len(rows)), names, fontsize=8)
    ax.set_ylabel("training step, ms (median, IQR)")
    s = results["work"]
    ax.set_title(f"d={s['dim']} L={s['n_layer']} heads={s['n_head']}/{s['n_kv_head']} "
                 f"V={s['vocab_size']} B×T={s['batch_size']}×{s['seq_len']}, fp32", fontsize=9)
    for i, m in enumerate(med):  # above the whisker
        ax.text(i, m + high[i], f"{m:,.0f}", ha="center", va="bottom", fontsize=8)
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)


def write_results(results: dict, out_dir: str | Path, command: str = "") -> dict[str, Path]:
    """bench.md, bench.json, bench.png (and profile.md with a profile) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "bench.md", "json": out / "bench.json", "png": out / "bench.png"}
    md = table(results)
    if command:
        md = f"`{command}`\n\n{md}"
    if results.get("profile"):
        paths["profile"] = out / "profile.md"
        _text(paths["profile"], profile_tables(results["profile"]))
    _text(paths["md"], md)
    _text(paths["json"], json.dumps(results | {"command": command}, indent=1) + "\n")
    chart(results, paths["png"])
    return paths


def remove_stale(out_dir: str | Path, written) -> list[Path]:
    """Remove the files of ``OUTPUTS`` in ``out_dir`` that are not among ``written`` (an earlier
    run's, e.g. its profile.md when this run has no profile); return them."""
    keep = {Path(p).name for p in written}
    stale = [Path(out_dir) / name for name in OUTPUTS if name not in keep]
    stale = [p for p in stale if p.is_file()]
    for p in stale:
        p.unlink()
    return stale
