"""Count the collectives a piece of code issues, by kind.

A ``TorchDispatchMode`` (like ``torch.distributed.tensor.debug.CommDebugMode``, without its module
tracking): it sees every c10d op, including the hand-written ones inside tensorpar's autograd
Functions and those run in backward::

    with CollectiveCounter() as fwd:
        loss = model(x)
    fwd.counts  # {"all_reduce": 3, "all_gather": 1}
    fwd.bytes   # {"all_reduce": 98304, "all_gather": 4096}

``bytes`` is the payload of each collective, the size of the full tensor it produces or reduces:
the tensor of an all-reduce, the gathered output of an all-gather, the unscattered input of a
reduce-scatter: the b·s·h of Megatron's analysis. ``ring_bytes`` is what each rank sends with
ring algorithms: 2(n-1)/n of the payload for an all-reduce, (n-1)/n for the others, so the
all-gather plus reduce-scatter that sequence parallelism puts in place of an all-reduce send the
same bytes (their payloads add up to twice the all-reduce's).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

KIND_OF_OP = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "send": "send",  # point to point: a pipeline's activations and gradients
    "recv_": "recv",
}
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def ring_share(kind: str, n: int) -> float:
    """The fraction of a collective's payload each of ``n`` ranks sends with ring algorithms (a
    send: all of it; a receive: nothing)."""
    if kind in ("send", "recv"):
        return 1.0 if kind == "send" else 0.0
    return 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def _payload_bytes(args, out) -> int:
    """The largest argument's or result's total tensor bytes: the full side of the collective
    (a c10d all-gather takes its output as an argument, a functional one returns it)."""
    sizes = [sum(t.numel() * t.element_size() for t in tree_leaves(a)
                 if isinstance(t, torch.Tensor)) for a in (*args, out)]
    return max(sizes, default=0)


def _group_of(args) -> ProcessGroup | None:
    for a in args:
        if isinstance(a, torch.ScriptObject):  # c10d ops carry their group as a boxed one
            try:
                return ProcessGroup.unbox(a)
            except (RuntimeError, TypeError):
                continue
        if isinstance(a, str):  # functional collectives (DTensor's) carry the group's name
            try:
                return _resolve_process_group(a)
            except (RuntimeError, ValueError, KeyError):
                continue
    return None


class CollectiveCounter(TorchDispatchMode):
    """Context manager; afterwards ``counts``, ``bytes`` and ``ring_bytes`` map each kind of
    collective to its call count, payload bytes and bytes sent per rank.

    groups: {label: ProcessGroup, or a list of them} to count apart as well (``{"tp": ...,
    "dp": ...}``): ``by_group[label]`` then holds ``counts``, ``bytes`` and ``ring_bytes`` of
    the collectives on that label's groups; those on other groups are under "other"."""

    def __init__(self, groups: dict[str, ProcessGroup | list[ProcessGroup] | None] | None = None):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.ring_bytes: Counter[str] = Counter()
        self._labels = {g.group_name: label for label, gs in (groups or {}).items()
                        for g in (gs if isinstance(gs, list) else [gs]) if g is not None}
        self.by_group: dict[str, dict[str, Counter[str]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor and hasattr(t, "__tensor_flatten__") for t in types):
            # a wrapper subclass (DTensor): let it run, so the collectives it issues on its
            # local tensors, inside its own dispatch too, come back here and are counted
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        packet = getattr(func, "_overloadpacket", None)
        kind = KIND_OF_OP.get(getattr(packet, "__name__", ""))
        if kind is not None:
            group = _group_of(args)
            payload, n = _payload_bytes(args, out), 1 if group is None else group.size()
            sent = round(payload * ring_share(kind, n))
            tallies = [self.__dict__]
            if self._labels:
                label = self._labels.get(getattr(group, "group_name", None), "other")
                tallies.append(self.by_group.setdefault(
                    label, {"counts": Counter(), "bytes": Counter(), "ring_bytes": Counter()}))
            for tally in tallies:
                tally["counts"][kind] += 1
                tally["bytes"][kind] += payload
                tally["ring_bytes"][kind] += sent
        return out
