"""The device mesh: data parallelism (``dp``) across tensor-parallel groups (``tp``), context
parallelism (``cp``, the sequence split) between the two, and pipeline stages (``pp``) across all.

``init_parallel(tp=2, dp=4)`` starts torch.distributed (as ``init_tensor_parallel`` does, from
torchrun's environment) and returns a ``torch.distributed.device_mesh.DeviceMesh`` with the dims
("dp", "tp"), or ("pp", "dp", "tp") with pipeline stages (``pp=``). The TP ranks of one group are
consecutive: with torchrun's node-major rank order, a TP group stays inside a node (on NVLink) and
data parallelism runs across nodes. With ``cp=N`` > 1 the mesh is ("dp", "cp", "tp") (under
("pp", ...) with stages): CP outside TP, inside dp; without it the "cp" dim is absent::

    world 8 = dp 2 x tp 4        tp group   ranks         dp group   ranks
                                 0          0 1 2 3       0          0 4
                                 1          4 5 6 7       1          1 5   (... 2 6, 3 7)

Every tensorpar layer takes ``mesh["tp"].get_group()`` as its ``group``; FSDP2 and DDP take the
``mesh["dp"]`` dimension (``data_parallel.py``), or under CP the flattened ("dp", "cp") one
(:func:`replica_mesh`: the CP ranks hold different tokens of the same sequences, so their
gradients are summed with the data-parallel ones, as torchtitan does). Everything is checked
before the mesh is built (before any collective), so a size that does not fit the world fails
alike on every rank.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from tensorpar.runtime.groups import device_for, start_process_group, world_size_to_be

if TYPE_CHECKING:  # imported on use: torch's mesh module pulls in DTensor (most of a second)
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("dp", "tp")


def mesh_sizes(world: int, tp: int | None = None, dp: int | None = None) -> tuple[int, int]:
    """(dp, tp) for ``world`` ranks: a size left out is what the other leaves of the world
    (tp defaults to the whole world when both are). ValueError, naming the numbers, when they
    do not multiply to ``world``."""
    for flag, value in (("tp", tp), ("dp", dp)):
        if value is not None and value < 1:
            raise ValueError(f"--{flag} {value} must be >= 1")
    if tp is None and dp is None:
        tp = world
    if tp is None:
        if world % dp:
            raise ValueError(f"--dp {dp} does not divide the world size {world}")
        tp = world // dp
    if dp is None:
        if world % tp:
            raise ValueError(f"--tp {tp} does not divide the world size {world}")
        dp = world // tp
    if tp * dp != world:
        raise ValueError(f"--tp {tp} x --dp {dp} = {tp * dp} ranks, but the world has {world} "
                         "(torchrun's --nnodes x --nproc-per-node)")
    return dp, tp


def init_parallel(tp: int | None = None, dp: int | None = None, *, pp: int = 1, cp: int = 1,
                  backend: str | None = None, timeout: timedelta | None = None,
                  check_collectives: bool | None = None) -> DeviceMesh:
    """Start torch.distributed from the launcher's environment and return the ("dp", "tp") mesh.

    tp, dp: the tensor- and data-parallel sizes; one left out is the world divided by the other
        (under torchrun ``dp`` defaults to world / tp). ``tp * dp`` must be the world size.
    pp: pipeline stages (``train/pipeline.py``); above 1 the mesh is ("pp", "dp", "tp"), the
        stages outermost, and ``tp * dp * pp`` is the world size.
    cp: context-parallel ranks (the sequence split over them, ``transformer/context_parallel.py``);
        above 1 a "cp" dim sits between "dp" and "tp", and ``tp * cp * dp * pp`` is the world.
    backend, timeout, check_collectives: as for ``init_tensor_parallel``.

    Use ``mesh["tp"].get_group()`` for tensorpar's layers, ``GPT`` and ``parallelize``, and
    ``mesh`` for :func:`tensorpar.mesh.data_parallel.data_parallel`. On one process (no torchrun)
    it is a 1 x 1 mesh.
    """
    world = world_size_to_be()
    for flag, size in (("pp", pp), ("cp", cp)):
        if size < 1 or world % size:
            raise ValueError(f"--{flag} {size} does not divide the world size {world}")
    if world % (pp * cp):
        raise ValueError(f"--pp {pp} x --cp {cp} = {pp * cp} does not divide the world size "
                         f"{world}")
    dp_size, tp_size = mesh_sizes(world // (pp * cp), tp, dp)  # before any collective
    start_process_group(backend=backend, timeout=timeout, check_collectives=check_collectives)
    from torch.distributed.device_mesh import init_device_mesh

    # pipeline stages outermost (across nodes), TP innermost (inside one), CP just outside TP
    dims = [("pp", pp)] * (pp > 1) + [("dp", dp_size)] + [("cp", cp)] * (cp > 1) + \
        [("tp", tp_size)]
    return init_device_mesh(device_for().type, tuple(n for _, n in dims),
                            mesh_dim_names=tuple(name for name, _ in dims))


def has_cp(mesh: DeviceMesh | None) -> bool:
    """Whether ``mesh`` has a "cp" dim (context parallelism over more than one rank)."""
    return mesh is not None and "cp" in (mesh.mesh_dim_names or ())


def replica_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks a gradient is summed (averaged) over: ``mesh["dp"]``, or with a "cp" dim the
    flattened ("dp", "cp") mesh, "dp_cp" (FSDP2 and DDP take it as their data-parallel mesh)."""
    if not has_cp(mesh):
        return mesh["dp"]
    # flattened once: torch keeps it on the root mesh and hands the same one back after
    return mesh["dp", "cp"]._flatten("dp_cp")


def replica_group(mesh: DeviceMesh | None):
    """The group a gradient is reduced over (None without a mesh: no data parallelism): the
    data-parallel group, or under CP the ("dp", "cp") one (:func:`replica_mesh`); its size is
    dp x cp, where :func:`dp_size` is dp alone."""
    return None if mesh is None else replica_mesh(mesh).get_group()


def dp_size(mesh: DeviceMesh | None) -> int:
    """The data-parallel size alone (the "dp" dim; without the CP ranks)."""
    return 1 if mesh is None else mesh["dp"].size()


def cp_group(mesh: DeviceMesh | None):
    """A process group of this rank's CP ranks in ``mesh`` (None without a "cp" dim: no CP), of
    its own: torch hands the mesh's "cp" dim the very group of the flattened ("dp", "cp") one
    when dp is 1 (the world's, at tp 1), and the K/V gathers would then be counted with FSDP's
    and the loss's collectives. Every rank calls it (each group is created by all), once."""
    if not has_cp(mesh):
        return None
    import torch.distributed as dist

    names = list(mesh.mesh_dim_names)
    n = mesh["cp"].size()
    ranks = mesh.mesh.movedim(names.index("cp"), -1).reshape(-1, n).tolist()
    group, _ = dist.new_subgroups_by_enumeration(ranks)
    return group


def cp_size(mesh: DeviceMesh | None) -> int:
    return mesh["cp"].size() if has_cp(mesh) else 1


def cp_rank(mesh: DeviceMesh | None) -> int:
    return mesh["cp"].get_local_rank() if has_cp(mesh) else 0


def dp_rank(mesh: DeviceMesh | None) -> int:
    return 0 if mesh is None else mesh["dp"].get_local_rank()
