"""Process groups: starting torch.distributed and asking a group for its size and rank.

``init_tensor_parallel()`` reads the environment that torchrun (or ``tensorpar.launch``) sets,
once, at the entry point, and returns the tensor-parallel group. Layers never look a group up:
they take ``group=`` (None meaning the whole world) and ask it for size and rank here.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tensorpar.runtime.checking import checks_wanted, collectives_checked, turn_on_checks


def tp_size(group: ProcessGroup | None = None) -> int:
    """Number of ranks in ``group``; 1 when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def tp_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank within ``group``; 0 when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def pick_backend(local_world_size: int) -> str:
    """NCCL when every local rank can have its own GPU, gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


# the collective timeout in seconds, inherited by every rank (``tensorpar --timeout``)
TIMEOUT_ENV = "TENSORPAR_TIMEOUT"


def init_tensor_parallel(
    tp_size: int | None = None,
    backend: str | None = None,
    timeout: timedelta | None = None,
    check_collectives: bool | None = None,
) -> ProcessGroup:
    """Start torch.distributed from the launcher's environment and return the TP group.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun
    sets them (multi-node works through torchrun's rendezvous). Without them it starts a
    single-process group of size 1. With NCCL each rank uses ``cuda:LOCAL_RANK``.

    tp_size: ranks per tensor-parallel group (default: the whole world). Groups are made of
        consecutive ranks, so with one node's GPUs per group TP stays inside the node.
    backend: "nccl" or "gloo"; by default NCCL when each local rank has a GPU, else gloo.
    timeout: how long a collective may wait for the other ranks before it raises (a rank that
        stopped answering); default ``TENSORPAR_TIMEOUT`` seconds from the environment (what
        ``tensorpar --timeout`` sets for every rank it starts), else torch's 10 minutes.
    check_collectives: compare every collective's op, shapes and dtypes across ranks before it
        runs, so that ranks that disagree raise on every rank instead of aborting (see
        ``checking.py``; slower); default ``TENSORPAR_CHECK_COLLECTIVES`` from the environment
        (what ``tensorpar --check-collectives`` sets), else off. It takes effect only when this
        call creates the process group: True with a group already created unchecked is refused.
    """
    if timeout is None:
        timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, 600)))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    tp = world if tp_size is None else tp_size
    if tp < 1 or world % tp != 0:
        raise ValueError(f"tp_size={tp} must be >= 1 and divide the world size {world}")
    if not dist.is_initialized():
        if checks_wanted(check_collectives):
            turn_on_checks()
        backend = backend or pick_backend(local_world)
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
        else:
            if world != 1:
                raise RuntimeError(
                    f"WORLD_SIZE={world} but MASTER_ADDR is not set: launch with torchrun "
                    "or tensorpar.launch"
                )
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
    elif check_collectives and not collectives_checked():
        raise ValueError("check_collectives=True, but the process group was created before "
                         "without the check: pass it to the first init_tensor_parallel (or "
                         "RankPool), or set TENSORPAR_CHECK_COLLECTIVES=1 before it")
    world = dist.get_world_size()
    if tp == world:
        return dist.group.WORLD
    group, _ = dist.new_subgroups(group_size=tp)
    return group


def device_for(group: ProcessGroup | None = None) -> torch.device:
    """Where this rank computes: its GPU when the group runs on NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
