"""Count the collectives a piece of code issues, by kind.

A thin wrapper over ``torch.distributed.tensor.debug.CommDebugMode``, which sees every c10d op,
including the hand-written ones inside tensorpar's autograd Functions and those run in backward::

    with CollectiveCounter() as fwd:
        loss = model(x)
    fwd.counts  # {"all_reduce": 3, "all_gather": 1}
"""

from __future__ import annotations

import warnings
from collections import Counter

from torch.distributed.tensor.debug import CommDebugMode

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
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
}
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


class CollectiveCounter:
    """Context manager; afterwards ``counts`` maps each kind of collective to its call count."""

    def __init__(self):
        self._mode = CommDebugMode()
        self.counts: Counter[str] = Counter()

    def __enter__(self) -> CollectiveCounter:
        # CommDebugMode's module hooks warn when no module input requires grad (token ids)
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._warnings.__exit__(*exc)
        for op, n in self._mode.get_comm_counts().items():
            name = str(op).split(".")[-1]
            self.counts[KIND_OF_OP.get(name, name)] += n
