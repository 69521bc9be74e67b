"""Process groups: starting torch.distributed and asking a group for its size and rank.

``init_tensor_parallel()`` reads the environment that torchrun (or ``tensorpar.launch``) sets,
once, at the entry point, and returns the tensor-parallel group. Layers never look a group up:
they take ``group=`` (None meaning the whole world) and ask it for size and rank here.

Where ranks compute: the GPU over NCCL when every local rank has one, else the CPU over gloo.
``TENSORPAR_DEVICE`` in the ranks' environment overrides it (``tensorpar --device``, or
``RankPool(n, device=...)``; spawned ranks and torchrun's inherit it): ``cpu`` keeps every rank
on the CPU, ``cuda`` puts every rank on a GPU over gloo, whose collectives take CUDA tensors.
That is a test mode: it runs the CUDA code path at TP > 1 on one GPU (rank r on
``cuda:(LOCAL_RANK % device_count)``; NCCL refuses two ranks on one GPU), much slower than NCCL.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


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


# "cpu" or "cuda": where every rank computes, inherited by the ranks (``tensorpar --device``)
DEVICE_ENV = "TENSORPAR_DEVICE"


def wanted_device() -> str | None:
    """``TENSORPAR_DEVICE`` from the environment ("cpu" or "cuda"); None when unset (the rule
    of :func:`pick_backend`). A read: nothing is set or checked here (see :func:`check_device`)."""
    return os.environ.get(DEVICE_ENV, "").strip().lower() or None


def check_device(device: str | None) -> None:
    """Refuse, in one line, a device this machine cannot give the ranks (before any starts)."""
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV}={device}: expected cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda ({DEVICE_ENV}=cuda): no CUDA GPU is visible to torch "
                         f"{torch.__version__} here; leave it out to run on the CPU")


def pick_backend(local_world_size: int) -> str:
    """gloo when ``TENSORPAR_DEVICE`` is set (on the CPU, or the GPU test mode); else NCCL when
    every local rank can have its own GPU, gloo otherwise."""
    if wanted_device() is not None:
        return "gloo"
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def rank_device_type(local_world_size: int) -> str:
    """"cuda" or "cpu": where ranks started now, ``local_world_size`` of them on this machine,
    would compute (for what a launcher says before it starts them)."""
    return wanted_device() or ("cuda" if pick_backend(local_world_size) == "nccl" else "cpu")


# "1" in a rank's environment: check every collective (``tensorpar --check-collectives``)
CHECK_ENV = "TENSORPAR_CHECK_COLLECTIVES"

_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def env_switch(name: str) -> bool:
    """Whether the environment variable ``name`` is on: "1", "true", "yes" or "on" (any case);
    unset, "", "0", "false", "no" or "off" is off; anything else is a ValueError naming it."""
    value = os.environ.get(name, "").strip().lower()
    if value in _ON or value in _OFF:
        return value in _ON
    raise ValueError(f"{name}={os.environ[name]!r}: set it to 1 or 0 (or true/false, yes/no, "
                     "on/off)")


def checks_wanted(check_collectives: bool | None = None) -> bool:
    """``check_collectives`` when given, else ``env_switch(TENSORPAR_CHECK_COLLECTIVES)``."""
    if check_collectives is not None:
        return check_collectives
    return env_switch(CHECK_ENV)


def turn_on_checks() -> None:
    """Make every process group created from now on in this process check its collectives
    (torch's debug level DETAIL: process-wide, as the variable it stands for)."""
    dist.set_debug_level(dist.DebugLevel.DETAIL)


def collectives_checked(group: ProcessGroup | None = None) -> bool:
    """Whether ``group`` (default: the whole world) compares its collectives across ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    group = group or dist.group.WORLD
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    try:
        backend = group._get_backend(device)
    except RuntimeError:  # no backend for that device
        return False
    return isinstance(backend, torch._C._distributed_c10d._ProcessGroupWrapper)


# the collective timeout in seconds, inherited by every rank (``tensorpar --timeout``)
TIMEOUT_ENV = "TENSORPAR_TIMEOUT"


def collective_timeout_s() -> float:
    """How long a collective of a rank started from this environment waits for the others:
    ``TENSORPAR_TIMEOUT`` seconds, else torch's 10 minutes."""
    return float(os.environ.get(TIMEOUT_ENV, 600))


def init_tensor_parallel(
    tp_size: int | None = None,
    backend: str | None = None,
    timeout: timedelta | None = None,
    check_collectives: bool | None = None,
) -> ProcessGroup:
    """Start torch.distributed from the launcher's environment and return the TP group.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun
    sets them (multi-node works through torchrun's rendezvous). Without them it starts a
    single-process group of size 1. With NCCL each rank uses ``cuda:LOCAL_RANK``; with
    ``TENSORPAR_DEVICE=cuda`` (the test mode, gloo) ``cuda:(LOCAL_RANK % device_count)``.

    tp_size: ranks per tensor-parallel group (default: the whole world). Groups are made of
        consecutive ranks, so with one node's GPUs per group TP stays inside the node.
    backend: "nccl" or "gloo"; by default NCCL when each local rank has a GPU and
        ``TENSORPAR_DEVICE`` is unset, else gloo.
    timeout: how long a collective may wait for the other ranks before it raises (a rank that
        stopped answering); default ``TENSORPAR_TIMEOUT`` seconds from the environment (what
        ``tensorpar --timeout`` sets for every rank it starts), else torch's 10 minutes.
    check_collectives: compare every collective's op, shapes and dtypes across ranks before it
        runs, so that ranks that disagree raise on every rank instead of aborting (see
        ``checking.py``; slower); default ``TENSORPAR_CHECK_COLLECTIVES`` from the environment
        (what ``tensorpar --check-collectives`` sets), else off. It takes effect only when this
        call creates the process group: True with a group already created unchecked is refused.
    """
    world = world_size_to_be()
    tp = world if tp_size is None else tp_size
    if tp < 1 or world % tp != 0:
        raise ValueError(f"tp_size={tp} must be >= 1 and divide the world size {world}")
    start_process_group(backend, timeout, check_collectives)
    world = dist.get_world_size()
    if tp == world:
        return dist.group.WORLD
    group, _ = dist.new_subgroups(group_size=tp)
    return group


def world_size_to_be() -> int:
    """The world size: the process group's once started, else what the launcher's WORLD_SIZE
    says it will be (1 without a launcher). Known before any collective, for checking sizes."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def start_process_group(backend: str | None = None, timeout: timedelta | None = None,
                        check_collectives: bool | None = None) -> None:
    """Start torch.distributed from the launcher's environment, once (a no-op when it is
    already started, except that asking for the check mode then is refused). The arguments are
    ``init_tensor_parallel``'s."""
    if timeout is None:
        timeout = timedelta(seconds=collective_timeout_s())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if not dist.is_initialized():
        if checks_wanted(check_collectives):
            turn_on_checks()
        check_device(wanted_device())
        backend = backend or pick_backend(local_world)
        if backend == "nccl" and wanted_device() == "cpu":
            raise ValueError(f"backend nccl needs GPUs, but {DEVICE_ENV}=cpu")
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        elif wanted_device() == "cuda":
            torch.cuda.set_device(device_for())
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


def device_for(group: ProcessGroup | None = None) -> torch.device:
    """Where this rank computes: its GPU when the group runs on NCCL; under
    ``TENSORPAR_DEVICE=cuda`` (the test mode, gloo) ``cuda:(LOCAL_RANK % device_count)``, so
    with one GPU every rank shares ``cuda:0``; else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if wanted_device() == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")
