"""Dropout in Hugging Face models after ``parallelize``: each region draws from the right stream.

HF layers draw their masks from torch's global generator. That is right for activations every TP
rank holds whole (the embeddings, the residual stream): seeded alike on every rank
(``torch.manual_seed``), the global generator is the stream the TP group shares, and every rank
draws the same masks as long as every rank draws the same amount. It is wrong inside a TP region,
where each rank holds other heads or hidden units: dense head h and head h + H/n would get the
same attention-dropout mask, and with heads split unevenly (6 over 4 ranks: 2, 2, 1, 1) the ranks
would draw different amounts and their residual masks would drift apart afterwards.

So inside each region the global generator is swapped for a stream of this rank's own::

    module entry (attention / MLP, f)  ── per-rank stream ──>  row layer starts (g)  ── global ──>
    e.g. GPT-2:  attn(q, k, v, dropout on the probabilities) | c_proj, resid_dropout

The stream's seed hashes (base seed, "hf-tp-region", dp rank 0, tp rank) (``runtime/seeds.py``);
the base seed is ``torch.initial_seed()`` when ``parallelize`` runs, i.e. the seed the user gave
every rank. The stream then runs on from step to step, as the global generator does. The model
keeps it as ``model.tp_region_stream``. ``seed_dropout(model, seed, step, dp_rank)`` starts both
streams over from (seed, step, dp rank[, tp rank]): called before each step (``tensorpar train
--hf`` does), the masks differ between steps and between data-parallel replicas, which would
otherwise draw the same ones, and a resumed run draws those of the uninterrupted one.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from tensorpar.parallel.linear import RowParallelLinear
from tensorpar.runtime.seeds import derive_seed


def _global_state(device: torch.device) -> torch.Tensor:
    return torch.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)


def _set_global_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state, device)


class RegionStream:
    """This rank's stream for dropout inside TP regions, swapped in for torch's global generator
    while a region runs (one state per device)."""

    def __init__(self, seed: int, tp_rank: int = 0):
        self.seed, self.tp_rank = seed, tp_rank
        self._states: dict[torch.device, torch.Tensor] = {}
        self._outside: dict[torch.device, torch.Tensor] = {}  # the global state, while inside

    def restart(self, seed: int) -> None:
        """Start the stream over from ``seed`` (a trainer, once per step: the step's masks then
        depend on the step alone, so a resumed run draws those of the uninterrupted one)."""
        self.seed = seed
        self._states.clear()

    def enter(self, device: torch.device) -> None:
        if device in self._outside:  # already inside (a region nested in another)
            return
        if device not in self._states:
            self._states[device] = torch.Generator(device).manual_seed(self.seed).get_state()
        self._outside[device] = _global_state(device)
        _set_global_state(device, self._states[device])

    def leave(self, device: torch.device) -> None:
        if device not in self._outside:
            return
        self._states[device] = _global_state(device)
        _set_global_state(device, self._outside.pop(device))

    def checkpoint_contexts(self):
        """For ``torch.utils.checkpoint(..., context_fn=...)`` (``tensorpar train --hf
        --recompute``, through transformers' gradient checkpointing): the forward notes where
        the stream stands; the recomputation in backward starts it there, so the recomputed
        layer draws the masks of its first forward inside its TP regions, and puts it back
        after. (Outside them the layer draws from torch's global generator, which the
        checkpoint itself restores: ``preserve_rng_state``.) Eager mode only: dynamo traces no
        ``context_fn``."""
        saved: dict = {}

        @contextlib.contextmanager
        def forward():
            saved.update(self._states)  # get_state() tensors, replaced (never changed) later
            yield

        @contextlib.contextmanager
        def recompute():
            now = dict(self._states)
            self._states.clear()
            self._states.update(saved)
            try:
                yield
            finally:
                self._states.clear()
                self._states.update(now)

        return forward(), recompute()


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def install_region_streams(model: nn.Module, regions: list[str], tp_rank: int) -> RegionStream:
    """Make the modules named in ``regions`` (converted attention and MLP modules) draw their
    dropout from a per-rank stream, from their entry until their row layer starts; seeded as
    dp rank 0 until ``seed_dropout`` says otherwise."""
    stream = RegionStream(derive_seed(torch.initial_seed(), "hf-tp-region", 0, tp_rank), tp_rank)
    for name in regions:
        module = model.get_submodule(name)
        module.register_forward_pre_hook(lambda m, args: stream.enter(_device(m)))
        # leaves at the row layer, and in any case when the module returns (or raises)
        module.register_forward_hook(lambda m, args, out: stream.leave(_device(m)),
                                     always_call=True)
        for row in (m for m in module.modules() if isinstance(m, RowParallelLinear)):
            row.register_forward_pre_hook(lambda m, args: stream.leave(_device(m)))
    return stream


def seed_dropout(model: nn.Module, seed: int, step: int, dp_rank: int = 0) -> None:
    """Seed the dropout of a model converted by ``parallelize`` for one step, on every rank
    before the step's forward: torch's global generator (the TP group's shared stream, outside
    the TP regions) from (seed, "hf-dropout", step, dp_rank), and this rank's region stream from
    (seed, "hf-tp-region", step, dp_rank, tp rank), and LoRA's adapter dropout (``add_lora``), if
any, from (seed, "lora-dropout", step, dp_rank). Each step and each data-parallel replica then
    draws masks of its own, and a step's masks depend on (seed, step) alone: a resumed run draws
    the uninterrupted one's. ``model``: the converted model, or a DDP wrapper of it (FSDP2
    converts it in place). Reseeding the global generator also reseeds whatever else draws from
    it, as ``torch.manual_seed`` does."""
    stream = getattr(getattr(model, "module", model), "tp_region_stream", None)
    if stream is None:
        raise ValueError("seed_dropout: the model has no tp_region_stream; convert it with "
                         "tensorpar.parallelize first")
    torch.manual_seed(derive_seed(seed, "hf-dropout", step, dp_rank))
    stream.restart(derive_seed(seed, "hf-tp-region", step, dp_rank, stream.tp_rank))
    adapters = getattr(getattr(model, "module", model), "lora_dropout", None)
    if adapters is not None:  # LoRA's masks: the same at every TP size
        adapters.restart(derive_seed(seed, "lora-dropout", step, dp_rank))
