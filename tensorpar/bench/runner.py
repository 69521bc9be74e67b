"""Run the contenders side by side: same model, same weights, same batches, interleaved.

::

    setup      every contender is built in its pool and runs ``warmup`` untimed steps; the last
               one is measured (collectives, memory)
    round r    each contender runs ``steps_per_repeat`` timed steps, one after the other, in an
               order shuffled every round (seeded by the work's seed): no contender always goes
               first or always follows the same one; r = 0 .. repeats-1
    profile    (optional) a few more steps of the contenders in ``PROFILED`` under
               torch.profiler (the compiled ones with --compile)

A pool is a set of spawned ranks: the TP pool (``tp`` ranks, one thread each) holds tensorpar and
DTensor contenders, one-rank pools the unsharded ones (1 thread, or one per core), and a
contender that needs processes of its own (megatron-core) gets a pool of its own. Only one pool
computes at a time; the others block on their task queues (no CPU time), so one rank per core
holds while a contender runs.

Step time: each rank times each step; a step's time is the slowest rank's. The report gives the
median over all timed steps, the interquartile range and min-max. Losses: every contender's
per-step losses against the dense fp32 run's (``dense-1t``, or an untimed reference run of the
same model when dense-1t is not among the contenders); a contender of another model names its own
reference (``Contender.reference``: the Qwen3-MoE rows, ``hf-qwen3moe-1``).

On GPUs (``device="cuda"``, ``--device cuda``) every pool runs on NCCL, a GPU per rank; a
contender with more ranks than visible GPUs, or one this bench runs on the CPU only, is skipped.
The bench then measures the GPU's bf16 matmul peak (``ranks.matmul_peak``) and reports each
contender's model TFLOP/s and MFU against it (``work.model_flops_per_step``).

Failures (``Contender.ours``): another library's contender that cannot run the configuration
becomes a row "skipped: <why>", told by ``Contender.cannot_run`` before its ranks start or by a
ValueError raised on every rank; one that fails otherwise, a row "failed: <last line>" (the
tracebacks go into bench.json). The others' rows stand. A failure of tensorpar's contenders or
of the reference is a bug: its tracebacks are printed and listed in ``errors`` (exit 1).
"""

from __future__ import annotations

import random
import re
import statistics
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

from tensorpar.bench import ranks
from tensorpar.bench.contenders import CONTENDERS, Contender
from tensorpar.bench.workload import Workload, model_flops_per_step
from tensorpar.ranks.local import RankError, RankPool

REFERENCE = "dense-1t"
PROFILED = ("tensorpar", "tensorpar-unfused", "hf-llama", "tensorpar-c", "dense-Nt", "dense-c")

PoolKey = tuple[str, int, int]  # (own pool's name or "", ranks, threads per rank)


@dataclass
class RunPlan:
    """How long to measure. Every field is a ``tensorpar bench`` flag."""

    repeats: int = 5
    steps_per_repeat: int = 3
    warmup: int = 2
    tp: int = 2
    profile: bool = False
    profile_steps: int = 3
    compile: bool = False
    compile_backend: str = "inductor"
    device: str = "cpu"

    def check(self) -> None:
        for name in ("repeats", "steps_per_repeat", "tp", "profile_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be >= 1")
        if self.warmup < 2:
            raise ValueError(f"--warmup {self.warmup} must be >= 2: the first step allocates "
                             "AdamW's state (and compiles), the last warmup step is the "
                             "measured one")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device {self.device}: expected cpu or cuda")
        if self.device == "cuda" and not _gpus():
            raise ValueError("--device cuda: no CUDA GPU is visible to torch here")
        from tensorpar.train.compute import check_compile_backend

        check_compile_backend(self.compile_backend)

    def cannot_run(self, c: Contender) -> str | None:
        """Why contender ``c`` cannot run on this plan's device, or None."""
        if self.device != "cuda":
            return None
        if c.cpu_only:
            return "this bench runs it on the CPU only"
        if c.ranks(self.tp) > _gpus():
            return (f"needs {c.ranks(self.tp)} GPUs (one per rank, NCCL), {_gpus()} visible; "
                    "the one-GPU contenders stand")
        return None


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class Pools:
    """Spawns (or takes from ``pool_for``) one RankPool per key and closes the ones it made."""

    def __init__(self, pool_for: Callable[[int, int], RankPool] | None = None,
                 timeout_s: float = 1800.0, backend: str = "gloo"):
        self._pool_for, self._timeout_s, self._backend = pool_for, timeout_s, backend
        self._pools: dict[PoolKey, RankPool] = {}
        self._mine: set[PoolKey] = set()

    def get(self, key: PoolKey) -> RankPool:
        pool = self._pools.get(key)
        if pool is None or pool._closed:
            own, n, threads = key
            if self._pool_for is not None and not own and threads == 1:
                pool = self._pool_for(n, threads)
            else:
                pool = RankPool(n, backend=self._backend, threads=threads,
                                timeout_s=self._timeout_s)
                self._mine.add(key)
            self._pools[key] = pool
        return pool

    def each(self):
        return list(self._pools.items())

    def close(self) -> None:
        for key in self._mine:
            self._pools[key].close()


def pool_key(c: Contender, tp: int) -> PoolKey:
    return (c.name if c.own_pool else "", c.ranks(tp), c.n_threads())


def _quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "q1": q1, "q3": q3, "min": xs[0], "max": xs[-1]}


def run_bench(work: Workload, names: list[str], plan: RunPlan,
              pool_for: Callable[[int, int], RankPool] | None = None,
              log: Callable[[str], None] = print) -> dict:
    """Measure the contenders ``names``; return the results (see ``outputs.write_results``).

    pool_for(ranks, threads): where to get shared pools (the tests pass their session pools);
    by default each pool is spawned here and closed at the end.
    """
    plan.check()
    work.check(plan.tp)
    run_id = uuid.uuid4().hex
    rows: dict[str, dict] = {}
    for name in names:
        c = CONTENDERS[name]
        why = plan.cannot_run(c) or (c.cannot_run(work, plan.tp) if c.cannot_run else None)
        rows[name] = {"name": name, "about": c.about, "ranks_x_threads": c.label(plan.tp),
                      "status": f"skipped: {why}" if why else "ok"}
        if why:
            log(f"{name} skipped: {why}")
    timed = [n for n in names if rows[n]["status"] == "ok"]
    refs = list(dict.fromkeys(reference_of(n) for n in timed)) or [REFERENCE]
    measured = timed + [n for n in refs if n not in timed]
    pools = Pools(pool_for, backend="nccl" if plan.device == "cuda" else "gloo")
    peak_flops, n_params = None, None
    errors: list[dict] = []  # failures of our own contenders and the reference: bugs
    fail = partial(_fail, rows, errors, log)
    try:
        for name in measured:
            pool = pools.get(pool_key(CONTENDERS[name], plan.tp))
            log(f"setting up {name} on {pool.nprocs} rank(s)")
            try:
                if plan.device == "cuda" and peak_flops is None:
                    # first: cuBLAS allocates its workspaces (tens of MiB) at the first matmul,
                    # which would otherwise count in the first contender's state memory
                    peak_flops = pool.run(ranks.matmul_peak)[0]
                    log(f"bf16 matmul peak: {peak_flops / 1e12:,.0f} TFLOP/s")
                res = pool.run(ranks.setup, run_id, name, work, plan.warmup, plan.compile_backend)
            except RankError as e:
                fail(name, e)
                continue
            n_params = res[0]["n_params"]
            row = rows.setdefault(name, {"name": name, "status": "ok"})
            row.update(losses=res[0]["losses"], seconds=[], comm=[r["comm"] for r in res],
                       memory=[r["memory"] for r in res], per_rank_seconds=[])
        timed = [n for n in timed if rows[n]["status"] == "ok"]
        order = [n for n in measured if rows.get(n, {}).get("status") == "ok"]
        shuffler, orders = random.Random(work.seed), []
        for r in range(plan.repeats):
            first = plan.warmup + r * plan.steps_per_repeat
            this_round = shuffler.sample(order, len(order))
            orders.append(this_round)
            for name in this_round:
                if rows[name]["status"] != "ok":
                    continue
                pool = pools.get(pool_key(CONTENDERS[name], plan.tp))
                try:
                    res = pool.run(ranks.steps, run_id, name, work, first, plan.steps_per_repeat)
                except RankError as e:
                    fail(name, e)
                    continue
                row = rows[name]
                row["losses"] += res[0]["losses"]
                row["per_rank_seconds"].append([x["seconds"] for x in res])
                row["seconds"] += [max(ts) for ts in zip(*[x["seconds"] for x in res],
                                                         strict=True)]
            log(f"round {r + 1}/{plan.repeats} done")
        profile = []
        if plan.profile:  # tensorpar, its plain layers (what the overlap hides), the HF Llama,
            # compiled tensorpar and the plain model on both cores (where each one's time goes)
            targets = [n for n in PROFILED if n in timed
                       and rows[n]["status"] == "ok"] or \
                [n for n in ("tensorpar-sp", "tensorpar-tp1") if n in timed
                 and rows[n]["status"] == "ok"][:1]
            for target in targets:
                first = plan.warmup + plan.repeats * plan.steps_per_repeat
                pool = pools.get(pool_key(CONTENDERS[target], plan.tp))
                log(f"profiling {target}")
                profile.append({"contender": target,
                                "ranks": pool.run(ranks.profile, run_id, target, work, first,
                                                  plan.profile_steps)})
        for _, pool in pools.each():
            if not pool._closed:
                pool.run(ranks.teardown, run_id)
    finally:
        pools.close()
    flops = model_flops_per_step(work, n_params) if n_params else None
    return _summarize(work, plan, names, rows, profile, flops, peak_flops) | {
        "round_orders": orders, "errors": errors}


def reference_of(name: str) -> str:
    """The contender whose losses ``name``'s are compared with."""
    return CONTENDERS[name].reference or REFERENCE


def failure_reason(err: RankError) -> tuple[str, bool]:
    """(one line, refused) for a contender that failed on its ranks: refused when every rank
    raised ValueError (the line is then its message), else the last line of the last failing
    rank's traceback, after the pool's own reason (a rank that died or hung) if any."""
    head, *tracebacks = re.split(r"^--- rank \d+ failed:$", str(err), flags=re.M)
    last = [tb.strip().splitlines()[-1] for tb in tracebacks if tb.strip()]
    if not head.strip() and last and all(ln.startswith("ValueError: ") for ln in last):
        return last[0].removeprefix("ValueError: "), True
    return "; ".join([*head.strip().splitlines()[:1], *last[-1:]]) or "unknown error", False


def _fail(rows: dict, errors: list[dict], log, name: str, err: RankError) -> None:
    """Record contender ``name``'s failure (see the module docstring)."""
    reason, refused = failure_reason(err)
    row = rows.setdefault(name, {"name": name})
    if CONTENDERS[name].ours:  # the reference (dense-1t) too
        row["status"] = f"failed: {reason}"
        errors.append({"name": name, "error": str(err)})
        log(f"{name} failed (a bug in tensorpar):\n{err}")
    elif refused:
        row["status"] = f"skipped: {reason}"
        log(f"{name} skipped: {reason}")
    else:
        row.update(status=f"failed: {reason}", error=str(err))
        log(f"{name} failed on its ranks, the other contenders stand: {reason} (its "
            "tracebacks are in bench.json)")


def _summarize(work: Workload, plan: RunPlan, names: list[str], rows: dict,
               profile: list[dict], flops: int | None, peak_flops: float | None) -> dict:
    """Each contender's statistics; model TFLOP/s over all its ranks, and MFU against
    ``peak_flops`` per rank where the bench measured it (on GPUs)."""
    def losses_of(name: str) -> list[float] | None:
        ref = rows.get(name, {})
        return ref.get("losses") if ref.get("status") == "ok" else None

    out = []
    for name in names:
        row = dict(rows[name])
        ref_losses = losses_of(reference_of(name))
        if row["status"] == "ok":
            row["step_s"] = _quantiles(row["seconds"])
            row["tokens_per_s"] = work.tokens_per_step / row["step_s"]["median"]
            if flops:
                row["model_tflops"] = flops / row["step_s"]["median"] / 1e12
            if flops and peak_flops:
                n = len(row["memory"])
                row["mfu"] = flops / row["step_s"]["median"] / (peak_flops * n)
            row["comm_per_rank"] = row["comm"][0]
            row["peak_bytes_per_rank"] = [m["peak_bytes"] for m in row["memory"]]
            row["state_bytes_per_rank"] = [m["state_bytes"] for m in row["memory"]]
            if ref_losses is not None:
                n = min(len(ref_losses), len(row["losses"]))
                row["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in
                                               zip(row["losses"][:n], ref_losses[:n],
                                                   strict=True))
        out.append(row)
    return {"work": asdict(work), "plan": asdict(plan), "tokens_per_step": work.tokens_per_step,
            "reference": REFERENCE, "reference_losses": losses_of(REFERENCE), "contenders": out,
            "profile": profile, "device": plan.device, "model_flops_per_step": flops,
            "peak_flops": peak_flops}
