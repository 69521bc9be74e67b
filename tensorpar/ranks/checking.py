"""Check mode: every collective compared across ranks before it runs, and the layer named.

Ranks that feed one collective different shapes (a batch of 3 on one rank and 2 on the others,
sequence shards of different lengths) make gloo abort every process ("Received data size doesn't
match expected size"), and NCCL hang or read garbage. With the check on, torch's own
ProcessGroupWrapper (what ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` turns on) first gathers every
rank's fingerprint of the call (op, shapes, dtypes) over a side gloo group, and raises a
RuntimeError on every rank when they differ, before any data moves. ``failures.py`` reads it
into one line (:class:`~tensorpar.ranks.failures.CollectiveMismatch`); :class:`naming_layers`
adds the layer that issued it::

    collective mismatch in blocks.0.mlp.down (forward): rank 0 all_reduce [3, 8, 16] float32;
    ranks 1-3 all_reduce [2, 8, 16] float32

It must be on before the process group is created, on every rank:
``init_tensor_parallel(check_collectives=True)``, ``RankPool(n, check_collectives=True)``, or
``TENSORPAR_CHECK_COLLECTIVES=1`` in the ranks' environment (what ``tensorpar
--check-collectives`` sets; spawned ranks and torchrun's inherit it). torch reads its own
``TORCH_DISTRIBUTED_DEBUG`` once, when ``torch`` is imported, so setting that variable later has
no effect: :func:`turn_on_checks` sets torch's level itself. The cost: a barrier and a small
all-gather before each collective (the README's "Failure behaviour" has the numbers).
"""

from __future__ import annotations

import os
import traceback

from torch import nn

from tensorpar.ranks.failures import CollectiveMismatch, collective_mismatch

# what the launcher says after a rank's abort when the ranks did not check their collectives
CHECK_HINT = ("if the dead rank said \"Received data size doesn't match expected size\", ranks fed "
              "a collective different shapes: run again with tensorpar --check-collectives CMD "
              "(in code: TENSORPAR_CHECK_COLLECTIVES=1) to have the layer and each rank's shape "
              "named")


class naming_layers:  # noqa: N801 (used as a function: ``with naming_layers(model):``)
    """Within the block, a collective mismatch raised by torch's check names where it happened.

    ``with naming_layers(model): ...``: for the block's duration every module of ``model`` (and
    only those) has a forward pre-hook and hook that keep the names of the modules running, so
    when torch's mismatch error leaves the block it becomes a ``CollectiveMismatch`` whose place
    is the innermost module: ``blocks.0.mlp.down (forward)`` (the model itself by its class
    name). In backward the modules are not tracked (a module's backward has no reliable edges):
    the place is ``backward`` and the autograd function that issued the collective, e.g.
    ``backward (_CopyToTP.backward)``. The hooks are removed on exit; other errors pass through
    unchanged, and without the check mode there is nothing to name (gloo aborts first).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._running: list[str] = []  # modules whose forward has started and not returned
        self._handles: list = []

    def __enter__(self) -> naming_layers:
        root = type(self.model).__name__
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._enter(name or root)))
            self._handles.append(module.register_forward_hook(self._leave))
        return self

    def _enter(self, name: str):
        def hook(module, args):
            if module is self.model:  # a new forward: forget one that raised and was caught
                self._running.clear()
            self._running.append(name)
        return hook

    def _leave(self, module, args, output) -> None:
        if self._running:  # not run when the forward raised: the name stays for __exit__
            self._running.pop()

    def __exit__(self, exc_type, exc, tb) -> bool:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        running, self._running = self._running, []
        if exc is None or collective_mismatch(exc) is None:
            return False
        if isinstance(exc, CollectiveMismatch) and exc.where:  # an inner block named it
            return False
        raise collective_mismatch(exc, _place(running, tb)) from exc


def _place(running: list[str], tb) -> str | None:
    """Where the error was raised: ``NAME (forward)``, ``NAME (forward, recomputed in
    backward)`` under activation checkpointing, ``backward (Function.backward)``; None outside
    the model's forward and backward (a loss function called on its output)."""
    frames = [frame for frame, _ in traceback.walk_tb(tb)]
    in_backward = any(f.f_code.co_name == "_engine_run_backward" for f in frames)
    if running:
        return f"{running[-1]} (forward{', recomputed in backward' * in_backward})"
    if in_backward:
        # the innermost backward() outside torch: the autograd function that made the call
        ours = [f for f in frames if f.f_code.co_name == "backward"
                and f"{os.sep}torch{os.sep}" not in f.f_code.co_filename]
        code = ours[-1].f_code if ours else None
        return f"backward ({getattr(code, 'co_qualname', code.co_name)})" if code else "backward"
    return None
