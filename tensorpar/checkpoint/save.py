"""Saving a sharded checkpoint (the format: ``format.py``).

Each rank writes only what it owns (see ``parallel/ownership.py``): replicated tensors once, shared
KV heads once, each rank's slice of every block of a fused q|k|v. Writes are atomic: ranks write
into ``.step-N.tmp/``, rank 0 adds the manifest last and renames the directory into place. A kill
during a save leaves the previous checkpoint as it was; the newest ``step-*`` directory with a
manifest is the one loaded.

The ranks agree three times (each an exchange of every rank's status, which takes the place of
a barrier), so a rank that cannot go on never leaves the others waiting and every rank raises the
same error: before writing (no tensor about to be written holds a NaN or an infinity, else a
``ValueError`` naming it and its rank; rank 0 made the directory), after writing (every file was
written, else the ``OSError`` naming the file: a full disk, ``ulimit -f``), and after rank 0
renamed the directory into place. A failed save removes its ``.step-N.tmp/``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.checkpoint.format import (
    ADAM_STATES,
    FORMAT,
    checkpointed,
    checkpointed_buffers,
    list_checkpoints,
    make_readable,
    sha256_of,
)
from tensorpar.parallel.ownership import ShardOwnership, owned_local
from tensorpar.parallel.sharding import is_expert_split
from tensorpar.parallel.stages import is_stage_copy
from tensorpar.runtime.dtensors import is_dtensor
from tensorpar.runtime.groups import tp_rank, tp_size
from tensorpar.runtime.output import write_atomically


def saved(model) -> list:
    """The (name, parameter) pairs this rank's part of a checkpoint holds: ``checkpointed``'s,
    less a pipeline stage's copy of another stage's parameter (a tied table on the last stage:
    the first stage saves it; both load it)."""
    return [(n, p) for n, p in checkpointed(model) if not is_stage_copy(p)]


def _agree(status, group) -> list:
    """Every rank's ``status`` (None: fine), in rank order, on every rank: the ranks decide alike
    whether to go on, so none is left waiting for a rank that gave up."""
    if tp_size(group) == 1:
        return [status]
    statuses = [None] * tp_size(group)
    dist.all_gather_object(statuses, status, group=group)
    return statuses


class Grid:
    """The ranks that write one checkpoint: the TP ``group`` of each of the ``pp_group``'s
    pipeline stages (None: one stage), and with routed experts held by other data ranks, each
    of the ``dp_group``'s replicas too (None: the first replica writes alone). Rank
    g = (stage · dp + dp rank) · tp + tp rank writes file g; ``agree`` exchanges a status over
    all of them, in that order."""

    def __init__(self, group: ProcessGroup | None, pp_group: ProcessGroup | None = None,
                 dp_group: ProcessGroup | None = None):
        self.group, self.pp_group, self.dp_group = group, pp_group, dp_group
        self.tp = tp_size(group)  # (a group of None is the world's: no pipeline is one stage)
        self.dp = 1 if dp_group is None else tp_size(dp_group)
        self.dp_rank = 0 if dp_group is None else tp_rank(dp_group)
        self.stages = 1 if pp_group is None else tp_size(pp_group)
        self.stage = 0 if pp_group is None else tp_rank(pp_group)
        self.first = self.stage * self.dp * self.tp  # the stage's first file
        self.rank = self.first + self.dp_rank * self.tp + tp_rank(group)
        self.size = self.stages * self.dp * self.tp

    def agree(self, status) -> list:
        return self.agree_in_stage(status) if self.stages == 1 else \
            [s for stage in _agree(self.agree_in_stage(status), self.pp_group) for s in stage]

    def agree_in_stage(self, status) -> list:
        in_tp = _agree(status, self.group)
        return in_tp if self.dp == 1 else [s for row in _agree(in_tp, self.dp_group) for s in row]


def _expert_writers(model, grid: Grid) -> dict[str, list[tuple[int, int, int]]]:
    """Who writes each routed expert's weights: ``{name: [(file, start, stop), ...]}``, the
    experts [start, stop) of ``name`` written by the stage's first rank (in file order) that
    holds them, so that no expert is written twice by its expert-data replicas. One exchange of
    every rank's expert ranges over the stage (the names are the stage's own)."""
    mine = {name: (p.ep_shard.start, p.ep_shard.stop) for name, p in saved(model)
            if is_expert_split(p)}
    writers: dict[str, list[tuple[int, int, int]]] = {}
    for i, theirs in enumerate(grid.agree_in_stage(mine)):
        for name, (a, b) in theirs.items():
            held = writers.setdefault(name, [])
            if any((a, b) == (x, y) for _, x, y in held):
                continue  # an expert-data replica of experts a lower rank writes
            if any(a < y and x < b for _, x, y in held):
                raise ValueError(f"the ranks split the experts of {name} differently: "
                                 f"{[(x, y) for _, x, y in held]} and ({a}, {b})")
            held.append((grid.first + i, a, b))
    return {name: sorted(held, key=lambda w: w[1]) for name, held in writers.items()}


def _has_experts(model, pp_group: ProcessGroup | None) -> bool:
    """Whether the model (any pipeline stage of it) has routed experts split across ranks: then
    every data rank writes (the experts it holds), on every stage alike. (Experts held whole by
    every rank are written as any replicated tensor.)"""
    mine = any(is_expert_split(p) for _, p in saved(model))
    if pp_group is None or tp_size(pp_group) == 1:
        return mine
    return any(_agree(mine, pp_group))


def _first_failure(statuses: list):
    """The first rank's exception, raised on every rank alike (a copy: no traceback)."""
    for status in statuses:
        if status is not None:
            raise status


def _io_error(e: Exception, path: Path) -> Exception:
    """What a write raised, as an OSError naming ``path`` when it is one: safetensors raises
    SafetensorError ("I/O error: File too large (os error 27)"), no OSError. Others: as is."""
    if isinstance(e, OSError):
        return e if e.filename else OSError(e.errno, e.strerror or str(e), str(path))
    if not (isinstance(e, SafetensorError) and "I/O error" in str(e)):
        return e
    found = re.search(r"os error (\d+)", str(e))
    code = int(found[1]) if found else errno.EIO
    error = OSError(code, os.strerror(code) if found else str(e), str(path))
    error.__cause__ = e  # for --debug's traceback
    return error


def _nonfinite(tensors: dict[str, torch.Tensor]) -> tuple[str, str] | None:
    """The first tensor holding a NaN or an infinity, and which: (name, "nan" | "inf")."""
    for key, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return key, "nan" if bool(torch.isnan(t).any()) else "inf"
    return None


def _fsync(path: Path) -> None:
    """Flush a file (or a directory's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(text: str):
    """A writer for ``write_atomically``: ``text``, flushed to disk before the rename."""
    def write(tmp: Path) -> None:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    return write


def remove_unfinished(run_dir: str | Path) -> None:
    """Delete the hidden ``.step-N.tmp/`` directories that saves which were killed left behind
    (they are never read as checkpoints)."""
    for stale in Path(run_dir).glob(".step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def _whole(t) -> torch.Tensor:
    """FSDP2's piece (a DTensor split on dim 0 over dp) -> the whole TP shard. Over gloo with
    CUDA tensors (``--device cuda``, every rank on one GPU) the pieces are gathered on the CPU:
    DTensor's own gather of CUDA tensors over gloo ended the ranks with SIGSEGV (torch 2.11,
    H200)."""
    group = t.device_mesh.get_group()
    if t.device.type != "cuda" or dist.get_backend(group) != "gloo":
        return t.full_tensor()
    pieces = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, t.to_local().cpu(), group=group)
    return torch.cat(pieces, dim=0)


def save_checkpoint(run_dir: str | Path, step: int, model: nn.Module, ownership: ShardOwnership,
                    optimizer: torch.optim.Optimizer | None = None,
                    group: ProcessGroup | None = None, meta: dict | None = None,
                    keep: int = 2, dp_group: ProcessGroup | None = None,
                    pp_group: ProcessGroup | None = None) -> Path:
    """Write ``RUN_DIR/step-{step}``; every rank of ``group`` calls it. Keeps the newest ``keep``
    checkpoints. ``meta`` (JSON-serializable) goes into the manifest. Returns the directory.

    dp_group: with data parallelism (None: without), every rank of the run calls it, with its
    data-parallel group. The first replica (dp rank 0) of each TP rank writes, so nothing is
    stored twice: FSDP2's pieces (DTensors) are first gathered over ``dp_group`` into the whole
    TP shard, DDP's are whole already. The other replicas wait for the writers' outcome and
    raise what they raised, so every rank ends alike.

    pp_group: with pipeline stages, every stage's ranks call it with their part of the model
    (each parameter under its name in the whole model): stage p's TP rank r writes file
    p · tp + r, and one manifest lists every stage's tensors, so that the checkpoint loads at
    any TP and pipeline size."""
    dp = dp_group is not None and tp_size(dp_group) > 1  # None: no data parallelism
    experts = _has_experts(model, pp_group)
    grid = Grid(group, pp_group, dp_group if dp and experts else None)
    writers = _expert_writers(model, grid) if experts else {}
    tensors = {}
    rank = tp_rank(group)
    if rank == 0 and grid.dp_rank == 0:  # the same on every rank: the stage's first file
        tensors |= {name: b.detach().to("cpu", copy=True).contiguous()
                    for name, b in checkpointed_buffers(model)}
    for name, p in saved(model):  # every dp rank: FSDP2's gathers are collectives
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key, t in [(name, p.detach())] + [(f"optimizer.{s}.{name}", state[s])
                                              for s in ADAM_STATES if s in state]:
            if is_dtensor(t):
                t = _whole(t)
            if name in writers:  # routed experts: this rank's, if it is their writer
                spec = p.ep_shard
                mine = t if (grid.rank, spec.start, spec.stop) in writers[name] else None
            else:  # the first data replica's
                mine = owned_local(ownership, name, t, rank) if grid.dp_rank == 0 else None
            if mine is not None:
                tensors[key] = mine.detach().to("cpu", copy=True).contiguous()
    if not dp or grid.dp > 1:
        return _write(run_dir, step, model, ownership, optimizer, grid, meta, keep, tensors,
                      writers)
    status = None
    if tp_rank(dp_group) == 0:
        try:
            _write(run_dir, step, model, ownership, optimizer, grid, meta, keep, tensors,
                   writers)
        except Exception as e:  # noqa: BLE001 (the replicas raise it too, below)
            status = e
    outcome = [status]
    dist.broadcast_object_list(outcome, src=dist.get_global_rank(dp_group, 0), group=dp_group)
    if outcome[0] is not None:
        raise outcome[0]
    return Path(run_dir) / f"step-{step:08d}"


def _write(run_dir, step, model, ownership, optimizer, grid: Grid, meta, keep, tensors,
           writers) -> Path:
    """The writing ranks' part of ``save_checkpoint``: ``tensors`` is what this rank owns,
    ``writers`` who writes each routed expert (``_expert_writers``)."""
    rank, n = grid.rank, grid.size
    run_dir = Path(run_dir)
    final, tmp = run_dir / f"step-{step:08d}", run_dir / f".step-{step:08d}.tmp"
    # 1. nothing non-finite is ever written, and rank 0 makes the directory: agreed on first
    bad, status = _nonfinite(tensors), None
    if bad is not None:
        status = ValueError(f"refusing to save step {step}: {bad[0]} holds {bad[1]} (rank {rank})")
    elif rank == 0:
        try:
            remove_unfinished(run_dir)
            tmp.mkdir(parents=True)
        except OSError as e:
            status = _io_error(e, tmp)
    statuses = grid.agree(status)
    if rank == 0 and any(s is not None for s in statuses):
        shutil.rmtree(tmp, ignore_errors=True)
    _first_failure(statuses)
    # 2. each rank writes its file; a failed write (a full disk, ``ulimit -f``) is agreed on too
    fname = f"rank{rank:02d}-of{n:02d}.safetensors"
    try:
        save_file(tensors, tmp / fname, metadata={"format": FORMAT, "rank": str(rank)})
        make_readable(tmp / fname)
        _fsync(tmp / fname)
        status = {"name": fname, "bytes": (tmp / fname).stat().st_size,
                  "sha256": sha256_of(tmp / fname), "keys": sorted(tensors)}
    except Exception as e:  # noqa: BLE001 (a bug too: the other ranks must not wait for it)
        status = _io_error(e, tmp / fname)
    infos = grid.agree(status)
    failed = [i for i in infos if isinstance(i, BaseException)]
    if rank == 0 and failed:
        shutil.rmtree(tmp, ignore_errors=True)
    _first_failure(failed)
    # 3. every stage's tensors (its pieces in the grid's files); rank 0 adds the manifest and
    # renames the directory into place
    entries = _entries(model, ownership, optimizer, grid.tp, grid.first, writers)
    if grid.stages > 1:
        entries = {k: v for stage in _agree(entries, grid.pp_group) for k, v in stage.items()}
    status = None
    if rank == 0:
        try:
            _finish(run_dir, step, tmp, final, entries, optimizer, infos, meta, keep, grid)
        except Exception as e:  # noqa: BLE001 (as above)
            shutil.rmtree(tmp, ignore_errors=True)
            status = _io_error(e, tmp / "manifest.json")
    _first_failure(grid.agree(status))
    return final


def _finish(run_dir, step, tmp, final, entries, optimizer, infos, meta, keep, grid) -> None:
    manifest = _manifest(step, grid, entries, optimizer, infos, meta or {})
    write_atomically(tmp / "manifest.json", _write_synced(json.dumps(manifest, indent=1)))
    _fsync(tmp)
    old = run_dir / f".step-{step:08d}.old"
    if final.exists():  # the same step saved again: swap (the .old still counts until
        shutil.rmtree(old, ignore_errors=True)  # the new one is in place), drop the old
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync(run_dir)
    shutil.rmtree(old, ignore_errors=True)
    for stale in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)


def _pieces(ownership: ShardOwnership, name: str, n: int, first_file: int = 0) -> list[dict]:
    """Which rank's file holds which dense rows of ``name``: a rank's owned ranges, stacked in its
    file in the order ``owned_local`` concatenates them (``offset``: where each one starts). TP
    rank r's file is ``first_file`` + r (its stage's first file, with pipeline stages)."""
    pieces = []
    for r in range(n):
        offset = 0
        for a, b in ownership.owned_ranges(name, r):
            if offset and pieces[-1]["stop"] == a:  # adjacent in the file and in the dense tensor
                pieces[-1]["stop"] = b  # (a fused dim at TP=1): one piece
            else:
                pieces.append({"rank": first_file + r, "start": a, "stop": b} |
                              ({"offset": offset} if offset else {}))
            offset += b - a
    return pieces


def _entries(model, ownership, optimizer, n: int, first_file: int, writers) -> dict:
    """The manifest's entry of each tensor ``model`` saves (its AdamW moments' too, and its
    ``checkpointed_buffers``): a routed expert's pieces are its writers' (split dim 0), any
    other's its owners' in the stage's first data replica."""
    tensors = {}
    for name, p in saved(model):
        if name in writers:
            split, pieces = 0, [{"rank": f, "start": a, "stop": b} for f, a, b in writers[name]]
        else:
            split, pieces = ownership.shards[name][0].dim, _pieces(ownership, name, n, first_file)
        entry = {"shape": list(ownership.shapes[name]),
                 "dtype": str(p.dtype).removeprefix("torch."),
                 "split_dim": split, "pieces": pieces}
        tensors[name] = entry
        if optimizer is not None and optimizer.state.get(p):
            for s in ADAM_STATES:
                tensors[f"optimizer.{s}.{name}"] = entry
    for name, b in checkpointed_buffers(model):  # whole, in the stage's first file
        tensors[name] = {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch."),
                         "split_dim": None, "pieces": [{"rank": first_file, "start": 0,
                                                        "stop": 0}]}
    return tensors


def _manifest(step, grid: Grid, tensors, optimizer, infos, meta) -> dict:
    files = [{k: v for k, v in info.items() if k != "keys"} for info in infos]
    opt = None
    if optimizer is not None:
        opt = {"type": type(optimizer).__name__, "step": step,
               "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                for g in optimizer.param_groups]}
    # version 1 when no piece needs an offset: older readers then read it as before
    packed = any("offset" in piece for t in tensors.values() for piece in t["pieces"])
    version = 4 if grid.dp > 1 else 3 if grid.stages > 1 else 2 if packed else 1
    stages = {"pp_size": grid.stages} if grid.stages > 1 else {}
    stages |= {"dp_size": grid.dp} if grid.dp > 1 else {}
    return {"format": FORMAT, "version": version, "tp_size": grid.tp, **stages, "step": step,
            **meta, "optimizer": opt, "files": files, "tensors": tensors}
