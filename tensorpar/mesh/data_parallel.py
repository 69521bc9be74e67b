"""Data parallelism over a mesh's "dp" dimension, by torch's own engines, around a TP model.

``data_parallel(model, mesh, "fsdp")`` applies FSDP2 (``torch.distributed.fsdp.fully_shard`` on
the "dp" dimension) to each transformer block and then to the whole model, as torchtitan does:
each rank keeps 1/dp of its TP shard of every weight, gradient and AdamW state (ZeRO-3). A block's
weights are all-gathered over dp just before its forward and again before its backward, and its
gradients reduce-scattered (averaged) right after; torch's defaults for prefetching and
resharding are kept. ``"ddp"`` wraps the model in ``DistributedDataParallel`` over the dp group:
replicated weights and states, gradients all-reduced (averaged) in buckets during backward.

bf16 (``param_dtype=torch.bfloat16``, what ``tensorpar train --dtype bf16`` passes), as
torchtitan does it: under FSDP2 each ``fully_shard`` takes a ``MixedPrecisionPolicy`` that
all-gathers bf16 copies of the fp32 shards, so the layers compute with bf16 weights (autocast,
which the trainer keeps around forward, casts nothing more, and still runs the ops it keeps in
fp32 in fp32), and reduce-scatters the bf16 gradients in fp32: the parameters, their gradients
and AdamW stay fp32 and sharded (the fp32 master weights; checkpoints as in fp32). The embedding's
bf16 table and FSDP2's cast of each block's input make the residual stream, and the TP
collectives that carry it, bf16 too. No autocast copy of a weight is kept for backward: a block's
gathered bf16 weights are freed after its forward and gathered again for its backward.
``"ddp"`` ignores ``param_dtype``: replicated fp32 weights under autocast, which keeps a bf16
copy of each weight it casts until backward (``planner/data_parallel.py``).

Either way the TP collectives stay tensorpar's, inside the model, on the "tp" group; the two
never mix. Averaging over dp makes the gradient that of the mean loss over the global batch when
each dp rank takes an equal slice of it (the trainer's rule), so TP x DP is exact against one
device.

What tensorpar's own code needs of a parameter survives the wrapping: FSDP2 replaces each
parameter by a DTensor (sharded on dim 0 over dp) and the ``tp_shard`` tag (``ShardSpec``) is
copied onto it, so the ownership, the checkpoint and the gradient norm read it as before; its shape
is the whole TP shard's. DDP keeps the parameters; the model is ``wrapped.module``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.nn.parallel import DistributedDataParallel  # loaded by ``import torch`` already

from tensorpar.mesh.experts import ignore_experts_in_ddp, split_expert_params
from tensorpar.mesh.mesh import replica_mesh
from tensorpar.runtime.dtensors import is_dtensor
from tensorpar.runtime.groups import collectives_checked

if TYPE_CHECKING:  # torch's FSDP and DTensor modules take most of a second to import: on use
    from torch.distributed.device_mesh import DeviceMesh

DP_MODES = ("fsdp", "ddp")


def check_dp_mode(mode: str) -> None:
    if mode not in DP_MODES:
        raise ValueError(f"--dp-mode {mode}: expected {' or '.join(DP_MODES)}")


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: the blocks of the model's first ``ModuleList`` or
    ``ModuleDict`` (tensorpar's ``GPT.blocks``, a Hugging Face model's ``model.layers``)."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            return list(module)
        if isinstance(module, nn.ModuleDict):
            return list(module.values())
    return []


def data_parallel(model: nn.Module, mesh: DeviceMesh, mode: str = "fsdp",
                  units: Iterable[nn.Module] | None = None,
                  param_dtype: torch.dtype | None = None) -> nn.Module:
    """Make ``model`` (built on ``mesh["tp"]``) data-parallel over ``mesh["dp"]`` (under context
    parallelism the flattened ("dp", "cp") mesh, ``mesh.replica_mesh``: gradients summed over
    the CP ranks' tokens too).

    mode: "fsdp" (FSDP2: ``fully_shard`` each of ``units``, then the root; default) or "ddp"
        (``DistributedDataParallel``). units: the modules FSDP2 shards separately; default
        :func:`shard_units`. param_dtype: under FSDP2, the dtype the weights are gathered and
        computed in (``torch.bfloat16``: mixed precision, gradients reduced in fp32; None: the
        parameters' own); DDP ignores it (module docstring).

    Returns the model to call: the same object under FSDP2, the DDP wrapper under DDP. With a
    dp dimension of 1 nothing is wrapped (there is nothing to share). Parameters of the model
    must not be used by an optimizer made before: make it after.
    """
    check_dp_mode(mode)
    replicas = replica_mesh(mesh)
    if replicas.size() == 1:
        return model
    if mode == "ddp":
        # tensorpar's buffers (rotary tables, head indices) are the same on every rank: no
        # broadcast of them before each forward (torch 2.13 renamed the switch)
        params = inspect.signature(DistributedDataParallel).parameters
        quiet = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
        group = replicas.get_group()
        if collectives_checked(group):
            group = _unchecked_dp_group(mesh)
        ignore_experts_in_ddp(model)
        return DistributedDataParallel(model, process_group=group, **{quiet: False})
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # bf16 compute on gathered bf16 copies; the fp32 shards stay the parameters (master weights)
    # and the gradients are reduce-scattered, and so stored, in fp32
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) \
        if param_dtype is not None else MixedPrecisionPolicy()
    specs = {name: p.tp_shard for name, p in model.named_parameters() if hasattr(p, "tp_shard")}
    # split experts (--ep) are left to the trainer, which sums them over the expert-data ranks
    ignored = set(split_expert_params(model)) or None
    for unit in shard_units(model) if units is None else units:
        fully_shard(unit, mesh=replicas, mp_policy=policy, ignored_params=ignored)
    fully_shard(model, mesh=replicas, mp_policy=policy, ignored_params=ignored)
    for name, p in model.named_parameters():
        if name in specs:
            p.tp_shard = specs[name]
    return model


def _unchecked_dp_group(mesh: DeviceMesh) -> ProcessGroup:
    """This rank's dp group again, without the check mode's wrapper, for DDP.

    torch 2.13's DDP crashes (SIGSEGV in its logger, while it is built) on a process group that
    checks its collectives (``ranks/checking.py``). It needs no check: its collectives are its
    gradient buckets, whose shapes come from the parameters, and it compares the parameters'
    shapes across ranks itself when it is built. Every rank creates every dp group (column j of
    the (dp, tp) mesh holds TP rank j of each replica; under CP the (dp, cp) ranks of TP rank
    j), as ``new_group`` requires.
    """
    names = list(mesh.mesh_dim_names)
    replicas = [names.index(d) for d in ("dp", "cp") if d in names]
    others = [i for i in range(len(names)) if i not in replicas]
    columns = mesh.mesh.permute(*others, *replicas).reshape(-1, replica_mesh(mesh).size())
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.OFF)  # groups created now are not wrapped
    try:
        mine = None
        for ranks in columns.tolist():  # one dp group per TP rank
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
    finally:
        dist.set_debug_level(level)
    return mine


def dp_groups(model: nn.Module, mesh: DeviceMesh) -> list[ProcessGroup]:
    """The groups ``model`` (what :func:`data_parallel` returned) runs its dp collectives on:
    the mesh's dp group, and under the check mode DDP's own copy of it, to count both as dp."""
    groups = [replica_mesh(mesh).get_group()]
    if isinstance(model, DistributedDataParallel) and model.process_group not in groups:
        groups.append(model.process_group)
    return groups


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Within the block, whether backward reduces the gradients over dp. Off for each pass of an
    accumulated step but the last, so that they are reduced once per step: DDP's ``no_sync``
    (the gradients add up locally), FSDP2's ``set_requires_gradient_sync(False)`` (unsharded
    gradients add up, reduce-scattered with the last pass's). A model that is not
    data-parallel: nothing to hold back."""
    if enabled:
        yield
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def inner(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (the model itself otherwise): parameter names without
    DDP's ``module.`` prefix, for checkpoints and the shard ownership."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def is_dp_sharded(t) -> bool:
    """Whether ``t`` (a parameter, gradient or optimizer state) is an FSDP2 DTensor."""
    return is_dtensor(t)
