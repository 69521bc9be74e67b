"""What the trainer shows and writes on rank 0: a progress line, ``metrics.jsonl`` (and, with
``--tensorboard``, the same scalars in ``RUN/tensorboard/``), ``loss.png`` and the summary table
at the end."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import secrets
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from tensorpar.gpt.stages import describe_split
from tensorpar.parallel.context import cp_sizes
from tensorpar.parallel.stages import stage_blocks
from tensorpar.planner.comm import cp_comm
from tensorpar.planner.expected import RankPlace, RunPlan, plan_run
from tensorpar.planner.shapes import ModelShape
from tensorpar.planner.step import Step
from tensorpar.runtime.output import human_bytes, write_atomically
from tensorpar.train.moe import moe_rows

BYTES_PER_PARAM = {"weights": 4, "grads": 4, "adam": 8}  # fp32 master weights, AdamW moments


class Metrics:
    """``metrics.jsonl``: one JSON object per optimizer step, flushed as it is written, and the
    same numbers to each of ``sinks`` (TensorBoard, W&B).

    On resume from step S the entries after S (from the interrupted run) are dropped first, so the
    file reads like one uninterrupted run.
    """

    def __init__(self, path: Path, resume_step: int, sinks: list | None = None):
        self.path = path
        kept = [r for r in self.read(path) if r.get("step", 0) <= resume_step] \
            if resume_step else []
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, path)
        self.rows = kept
        self._sinks = list(sinks or [])
        self._f = open(path, "a")

    @staticmethod
    def read(path: Path) -> list[dict]:
        """The rows of a ``metrics.jsonl`` (none if it is missing); a line cut short by a kill
        is skipped."""
        rows = []
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return rows

    def write(self, row: dict) -> None:
        self.rows.append(row)
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        scalars = scalars_of(row)  # a skipped step's None (and its reason) has no scalar
        for sink in self._sinks:
            sink.write(row["step"], scalars)

    def close(self) -> None:
        """Idempotent: the trainer closes it on every way out."""
        self._f.close()
        for sink in self._sinks:
            sink.close()
        self._sinks = []


def scalars_of(row: dict) -> dict[str, float]:
    """A metrics row's numbers by the name a dashboard shows them under: ``train/loss``,
    ``train/lr``, ..., and ``val/loss``."""
    return {"val/loss" if key == "val_loss" else f"train/{key}": value
            for key, value in row.items()
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)}


class TensorBoardSink:
    """``--tensorboard``: each row's numbers as TensorBoard scalars in ``RUN/tensorboard``
    (float32, at ``global_step`` = the row's step), flushed with the row. A resumed run appends
    a new event file that starts with a purge at S + 1: TensorBoard hides the interrupted run's
    steps after S, so the curve reads like one run."""

    def __init__(self, directory: Path, resume_step: int):
        self._board = summary_writer()(str(directory), purge_step=resume_step + 1)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self._board.add_scalar(tag, value, global_step=step)
        self._board.flush()  # a run killed later still has this step's scalars

    def close(self) -> None:
        self._board.close()


class WandbSink:
    """``--wandb``: each row's numbers logged to a W&B run at the row's step.

    The run: project ``--wandb-project``, name ``--wandb-run-name`` (default the run
    directory's name), its files under ``RUN/wandb``, the training config as its config. Its id
    is kept in ``RUN/wandb-id``, so a resumed run continues the same W&B run (W&B keeps what the
    interrupted run logged past the checkpoint; its steps must grow, so the resumed run's
    repeated steps are logged again only past them). ``WANDB_MODE=offline`` writes an offline
    run that ``wandb sync RUN/wandb/offline-run-*`` uploads later."""

    def __init__(self, out: Path, cfg):
        wandb = wandb_module()
        id_file = out / "wandb-id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        write_atomically(id_file, lambda tmp: tmp.write_text(run_id + "\n"))
        (out / "wandb").mkdir(exist_ok=True)
        self._run = wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name or out.name,
                               id=run_id, resume="allow", dir=str(out),
                               config=dataclasses.asdict(cfg),
                               settings=wandb.Settings(silent=True, console="off",
                                                       disable_git=True, save_code=False))
        if getattr(self._run, "offline", False):
            where = self._run.settings.sync_dir
            self.line = (f"wandb: an offline run in {where}; upload it with: wandb sync "
                         f"{where}")
        else:
            self.line = f"wandb: the run is at {self._run.url}"

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


def wandb_module():
    """The ``wandb`` package, imported only for ``--wandb``."""
    return _optional("--wandb", "wandb", "wandb")


def summary_writer():
    """``torch.utils.tensorboard.SummaryWriter``, imported only for ``--tensorboard``."""
    return _optional("--tensorboard", "tensorboard", "torch.utils.tensorboard").SummaryWriter


def _optional(flag: str, package: str, module: str):
    """``module`` imported, or, when the package a flag needs is not installed, a ValueError:
    one line naming the pip command (the launcher's, before any rank starts)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{flag} needs the {package} package ({reason}): pip install {package} "
                         f"(or pip install 'tensorpar[{package}]'), or leave out {flag} "
                         f"(--no-{flag[2:]} on a run resumed with it)") from None


def log_interval(start: int, total: int) -> int:
    """Steps between two plain progress lines: about a tenth of the steps to run."""
    return max(1, (total - start) // 10)


def start_line(cfg, model: str, source: str, start: int) -> str:
    """The run's first line: the model, the data, the layout, the steps, where the outputs go
    and how often a line comes."""
    dp, pp, cp = cfg.dp or 1, getattr(cfg, "pp", 1), getattr(cfg, "cp", 1)
    ranks = cfg.tp * dp * pp * cp
    layout = f"--tp {cfg.tp} x --dp {dp}" + (f" x --pp {pp}" if pp > 1 else "") + \
        (f" x --cp {cp}" if cp > 1 else "")
    every = log_interval(start, cfg.steps)
    lines = "a line every step" if every == 1 else \
        f"a line at step {start + 1}, every {every} steps and the last"
    return (f"train {model} on {source}: {layout} ({ranks} rank{'s' * (ranks != 1)}), steps "
            f"{start + 1}-{cfg.steps}; outputs in {cfg.out} (metrics.jsonl, a checkpoint every "
            f"{cfg.save_every} steps and at the end); {lines}")


class ProgressLine:
    """A rich progress bar on a terminal; plain lines otherwise: the first step's, then about
    every 10% of the run (``log_interval``)."""

    def __init__(self, start: int, total: int):
        self.console = Console(file=sys.stdout)
        self.start, self.total, self.every = start, total, log_interval(start, total)
        self.bar = None
        if self.console.is_terminal:
            self.bar = Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[loss]}"),
                                TextColumn("{task.fields[tps]}"),
                                TimeRemainingColumn(), console=self.console)
            # no loss nor speed before the first step's: "loss -", not "loss 0.0000"
            self.task = self.bar.add_task("train", total=total, completed=start, loss="loss -",
                                          tps="- tok/s")
            self.bar.start()

    def say(self, line: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if self.bar is not None:
            self.console.print(line, highlight=False, markup=False)
        else:
            print(line, flush=True)

    def update(self, step: int, loss: float, tps: float, val_loss: float | None = None) -> None:
        val = "" if val_loss is None else f"  val {val_loss:.4f}"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, loss=f"loss {loss:.4f}",
                            tps=f"{tps:,.0f} tok/s")
            if val:  # the bar shows the training loss; a validation loss gets a line of its own
                self.console.print(f"step {step}/{self.total}  loss {loss:.4f}{val}")
        elif step % self.every == 0 or step in (self.start + 1, self.total) or val:
            print(f"step {step}/{self.total}  loss {loss:.4f}{val}  {tps:,.0f} tok/s",
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def plot_loss(rows: list[dict], path: Path, title: str) -> None:
    """Loss against step, written atomically to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows],  # a skipped step's loss (None) is a gap
            [float("nan") if r["loss"] is None else r["loss"] for r in rows], lw=1.2,
            label="training")
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val, strict=True), "o-", lw=1.2, ms=4, label="validation")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=120))
    plt.close(fig)


class RunReport:
    """What the lead rank shows and writes as a run trains: a ``metrics.jsonl`` row (and
    TensorBoard scalars) and the progress line per step; at the end ``loss.png``, the summary
    table and where the files are. The other ranks write nothing (``lead`` False)."""

    def __init__(self, out: Path, start: int, cfg, lead: bool, intro: str | None = None):
        self.out, self.cfg, self.lead = out, cfg, lead
        self.metrics = self.progress = None
        if lead:
            sinks = [TensorBoardSink(out / "tensorboard", start)] if cfg.tensorboard else []
            if getattr(cfg, "wandb", False):
                sinks.append(WandbSink(out, cfg))
            self.metrics = Metrics(out / "metrics.jsonl", start, sinks)
            self.progress = ProgressLine(start, cfg.steps)
            for line in [intro] + [getattr(s, "line", None) for s in sinks]:
                if line:
                    self.progress.say(line)

    def skipped(self) -> int:
        """Steps a resumed run skipped before (non-finite), as its metrics.jsonl says."""
        return sum(1 for r in self.metrics.rows if r.get("skipped")) if self.lead else 0

    def step(self, step: int, loss: float, norm: float, finite: bool, lr: float,
             seconds: float, val_loss: float | None = None, data_seconds: float = 0.0,
             extra: dict | None = None) -> None:
        """The row of ``step``; ``val_loss``: the validation loss after it, when computed;
        data_seconds: how long the step waited for its batch; extra: more of the row (a MoE
        model's ``aux_loss`` and ``expert_load``, ``train/moe.py``)."""
        if not self.lead:
            return
        tokens = self.cfg.batch_size * self.cfg.seq_len
        row = {"step": step, "loss": loss if finite else None, "lr": lr,
               "grad_norm": norm if finite else None, "tokens_per_s": tokens / seconds,
               "step_time_s": seconds, "data_s": data_seconds}
        if val_loss is not None:
            row["val_loss"] = val_loss
        row.update(extra or {})
        if not finite:  # JSON has no NaN: the values are named instead
            row["skipped"] = f"non-finite: loss {loss}, gradient norm {norm}"
        self.metrics.write(row)
        self.progress.update(step, loss, tokens / seconds, val_loss)

    def close(self) -> None:
        """Idempotent, on every way out: the terminal gets its cursor back, the TensorBoard
        writer's thread ends."""
        if self.progress is not None:
            self.progress.close()
        if self.metrics is not None:
            self.metrics.close()

    def finish(self, start: int, sizes: list[dict], comm: dict, shape: ModelShape | None,
               optimizer: str, dropout: bool, source: str, stopped: bool,
               data_note: str | None = None, converted: bool = False) -> list[dict]:
        """``loss.png``, and for a run that was not stopped the summary and the files' line;
        the rows of ``metrics.jsonl``. converted: the model is a Hugging Face one (the plan
        counts its attention's tensors: ``planner.step.Step.converted``)."""
        cfg, out, rows = self.cfg, self.out, self.metrics.rows
        if rows:
            dp = cfg.dp or 1
            plot_loss(rows, out / "loss.png",
                      f"TP={cfg.tp}{' + SP' if cfg.sequence_parallel else ''}"
                      f"{f' x DP={dp} ({cfg.dp_mode})' if dp > 1 else ''}, {source}")
        if not stopped:  # a stopped run's line is said by the launcher (train/run.py)
            from tensorpar.checkpoint.format import find_checkpoint

            ran = [r for r in rows if r["step"] > start]
            console = self.progress.console
            console.print(summary(ran, sizes, comm, cfg, shape, optimizer, dropout, data_note,
                                  converted))
            console.print(f"checkpoint: {find_checkpoint(out)}   metrics: "
                          f"{out / 'metrics.jsonl'}   plot: {out / 'loss.png'}"
                          + (f"   tensorboard: {out / 'tensorboard'}" if cfg.tensorboard
                             else ""))
        return rows


def _memory_rows(table: Table, sizes: list[dict], plan, unplanned: bool, dp: int, pp: int,
                 cp: int) -> None:
    """The unsharded model's size, then each rank's parameters and peak memory against the
    plan (``plan``: ``plan_run``'s numbers; ``unplanned``: the planner cannot describe it)."""
    dense = sizes[0]["dense"] if pp == 1 else \
        sum(s["dense"] for s in sizes if s.get("tp_rank", 0) == 0 and s.get("dp_rank", 0) == 0)
    per_param = sum(BYTES_PER_PARAM.values())
    table.add_row("unsharded model", f"{dense:,} params; {human_bytes(dense * per_param)} "
                  "weights + grads + AdamW (fp32)")
    for r, s in enumerate(sizes):
        line = (f"{s['local']:,} params ({s['local'] / dense:.1%}); "
                f"{human_bytes(s['local'] * per_param)}")
        if s.get("peak_memory") and unplanned:
            line += f"; peak tensor memory of a step {human_bytes(s['peak_memory'])} (no plan)"
        elif s.get("peak_memory"):
            data = s.get("data_bytes", 0)
            planned = plan.peaks[r] + data
            line += (f"; peak tensor memory of a step {human_bytes(s['peak_memory'])} "
                     f"(planned {human_bytes(planned)}"
                     + (f" with {human_bytes(data)} of token data" if data else "")
                     + f", {planned / s['peak_memory'] - 1:+.1%})")
        if s.get("resident_peak"):
            line += f"; resident peak {human_bytes(s['resident_peak'])}"
        where = f" (tp {s['tp_rank']}, dp {s['dp_rank']})" if dp > 1 else ""
        where += f" (pp {s['pp_rank']})" if pp > 1 else ""
        where += f" (cp {s['cp_rank']})" if cp > 1 else ""
        table.add_row(f"rank {r}{where}", line)


def summary(rows: list[dict], sizes: list[dict], comm: dict, cfg, shape: ModelShape,
            optimizer: str = "fused", dropout: bool = False,
            data_note: str | None = None, converted: bool = False) -> Table:
    """The end-of-run table: loss, speed, memory per rank (measured against ``tensorpar plan``'s
    prediction) and the collectives of one step (measured against the analytic minimum).
    shape: the model as the planner sees it (``recipe.shape()``; None: the planner cannot describe
    it, the measured numbers alone); optimizer: the trainer's AdamW implementation
    (``optim.implementation``); dropout: whether the model drops, and converted: whether it is
    a Hugging Face model, for the plan."""
    tp, sp = cfg.tp, cfg.sequence_parallel
    how = (f", compiled ({cfg.compile_backend})" if cfg.compile else "") \
        + (", TF32" if cfg.tf32 else "")
    # the step as the planner sees it (each pass's activations; a step makes each pass's
    # collectives), and its numbers for the ranks measured, asked once
    cp = getattr(cfg, "cp", 1)
    device = sizes[0].get("device", "cpu") if sizes else "cpu"
    places = [RankPlace(s.get("tp_rank", r), s.get("dp_rank", 0) * cp + s.get("cp_rank", 0),
                        s.get("pp_rank", 0)) for r, s in enumerate(sizes)]
    step = None if shape is None else Step.from_train_config(
        without_cp(cfg), shape, optimizer, dropout, device, converted or None)
    plan = None if step is None else plan_run(step, places)
    if plan is not None and cp > 1:  # a CP rank's memory: its tokens and the gathered K/V
        plan = dataclasses.replace(plan, peaks=plan_run(Step.from_train_config(
            cfg, shape, optimizer, dropout, device, converted or None), places).peaks)
    dp, pp, virtual = cfg.dp or 1, cfg.pp, cfg.pp_virtual
    micro = cfg.micro_batch_size or cfg.batch_size // dp
    n = cfg.batch_size // dp // micro
    split = f" x DP={dp} ({cfg.dp_mode})" if dp > 1 else ""
    split += f" x PP={pp}" if pp > 1 else ""
    split += f" x CP={cp}" if cp > 1 else ""
    split += f", {n} {'micro-batches' if pp > 1 else 'passes'} of {micro}" if n > 1 else ""
    table = Table(title=f"tensorpar train: TP={tp}{' + SP' if sp else ''}{split}{how}",
                  show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    if data_note:
        table.add_row("data", data_note)
    if pp > 1 and shape is not None:  # the split, and the share of a step a rank idles
        schedule = "1F1B" if virtual == 1 else f"interleaved 1F1B, {virtual} stages a rank"
        table.add_row("pipeline", f"{describe_split(shape.n_layer, pp, virtual)}; {schedule}; "
                      f"bubble (p - 1) / (v m) = {(pp - 1) / (virtual * n):.1%}")
    done = [r for r in rows if not r.get("skipped")]
    if done:
        table.add_row("loss (first -> final step)",
                      f"{done[0]['loss']:.4f} -> {done[-1]['loss']:.4f} "
                      f"(steps {done[0]['step']}-{done[-1]['step']})")
    val = [r for r in rows if r.get("val_loss") is not None]
    if val:
        table.add_row("validation loss (first -> last)",
                      f"{val[0]['val_loss']:.4f} -> {val[-1]['val_loss']:.4f} "
                      f"(after steps {val[0]['step']}-{val[-1]['step']})")
    if len(done) < len(rows):
        table.add_row("skipped steps (non-finite)",
                      ", ".join(str(r["step"]) for r in rows if r.get("skipped")))
    if rows:
        steady = [r["tokens_per_s"] for r in rows[1:]] or [rows[0]["tokens_per_s"]]
        table.add_row("tokens/s (median of steps)", f"{statistics.median(steady):,.0f}")
        waits = [r["data_s"] for r in rows if "data_s" in r]
        if waits:
            share = sum(waits) / sum(r["step_time_s"] for r in rows if "data_s" in r)
            table.add_row("data wait (share of step time)",
                          f"{share:.2%} (reading each step's batch)")
    _memory_rows(table, sizes, plan, shape is None, dp, pp, cp)
    _comm_rows(table, comm, plan, tp, sp, bool(rows))
    if step is not None:
        moe_rows(table, rows, comm, step)
    if "cp" in comm:  # rank 0's K/V gathers, against the count for its layers
        layers = None if pp == 1 or shape is None else \
            sum(len(b) for b in stage_blocks(shape.n_layer, pp * virtual)[::pp])
        _collective_rows(table, "cp ", comm["cp"], None if step is None else cp_comm(
            shape, micro, cfg.seq_len, tp, cp, cfg.dtype, step.recompute, n, layers))
    return table


def without_cp(cfg):
    """The run as a planner without context parallelism sees CP rank 0's part of it (what the
    summary plans its TP and dp collectives from): each of the dp x cp ranks runs the step's
    rows of a dp rank, at that rank's token count, and the gradients are averaged over all of
    them. ``cfg`` itself without --cp. (Its memory plan is ``cfg``'s own, with --cp: the
    gathered K/V and, for packed rows, the mask, as ``tensorpar plan --cp`` counts them.)"""
    if cfg.cp == 1:
        return cfg
    return dataclasses.replace(cfg, cp=1, seq_len=cp_sizes(cfg.seq_len, cfg.cp)[0],
                               batch_size=cfg.batch_size * cfg.cp,
                               dp=(cfg.dp or 1) * cfg.cp)


def _comm_rows(table: Table, comm: dict, plan: RunPlan | None, tp: int, sp: bool,
               ran: bool) -> None:
    """The collectives of one measured step (``comm``: rank 0's TP ones, and its "dp" and "pp"
    ones), each against the planner's count (``plan``; None: the planner cannot describe the
    model)."""
    if comm["counts"]:  # with pipeline stages, rank 0's: its blocks and the embedding
        minimum = None if plan is None else plan.tp_comm
        _collective_rows(table, "", comm, minimum)
        if minimum is not None:
            table.add_row("analytic count (payload)", _by_source(minimum, sp))
    else:
        table.add_row("TP communication per step", "none (TP=1)" if tp == 1 or ran else
                      "not measured (no step ran)")
    if "dp" in comm:  # measured on rank 0 (tp rank 0), against the planner's count for it
        expected = None if plan is None else plan.dp_comm
        _collective_rows(table, "dp ", comm["dp"], expected)
        if expected is not None:
            table.add_row("dp analytic count (payload)", " + ".join(
                f"{r['source']} {human_bytes(r['bytes'])}" for r in expected["breakdown"]))
    if "pp" in comm:  # rank 0's (the first stage's) sends and receives, against the count
        _collective_rows(table, "pp ", comm["pp"], None if plan is None else plan.pp)


def _collective_rows(table: Table, prefix: str, measured: dict, expected: dict | None) -> None:
    """A row per kind of collective: the calls, payload and ring bytes of one measured step
    (``CollectiveCounter``'s), and whether they are the analytic count (``expected``; None:
    there is none)."""
    for kind in sorted(set(measured.get("counts", {})) | set((expected or {}).get("counts", {}))):
        got = (measured["counts"].get(kind, 0), measured["bytes"].get(kind, 0))
        want = (0, 0) if expected is None else \
            (expected["counts"].get(kind, 0), expected["bytes"].get(kind, 0))
        verdict = "no analytic count" if expected is None else "= the analytic count" \
            if got == want else f"analytic count: {want[0]} calls, {human_bytes(want[1])}"
        table.add_row(f"{prefix}{kind} per step",
                      f"{got[0]} calls, {human_bytes(got[1])} payload, "
                      f"{human_bytes(measured['ring_bytes'].get(kind, 0))} sent per rank "
                      f"(ring); {verdict}")


def _by_source(predicted: dict, sp: bool) -> str:
    """'blocks 36.00 MiB (Megatron's minimum: ...) + embedding 1.50 MiB + ...' from a
    prediction (``planner.comm.predicted_comm``)."""
    parts: dict[str, int] = {}
    for row in predicted["breakdown"]:
        source = row["source"]
        if source.startswith(("attention", "mlp")):
            source = "blocks"
        parts[source] = parts.get(source, 0) + row["bytes"]
    minimum = ("Megatron's minimum: per layer 2 all-reduces of B·T·D each way"
               if not sp else "Megatron's minimum under SP: per layer 2 all-gathers + 2 "
               "reduce-scatters of B·T·D each way (the ring bytes of the 4 all-reduces), and in "
               "backward each column op's input shard gathered again, as Megatron does")
    text = [f"{name} {human_bytes(b)}" + (f" ({minimum})" if name == "blocks" else "")
            for name, b in parts.items()]
    return " + ".join(text)
