"""The GPT cut into pipeline stages, for ``torch.distributed.pipelining``.

With pipeline parallelism over ``pp`` ranks and ``v`` stages per rank (interleaved schedules),
the model's L blocks are cut into S = pp · v stages of consecutive blocks, as ``tensor_split``
cuts (sizes differ by at most one, the larger first); stage s runs on pp rank s % pp::

    L = 5, pp = 2, v = 1    stage 0: embedding, blocks 0-2      (rank 0)
                            stage 1: blocks 3-4, norm, head     (rank 1)
    L = 8, pp = 2, v = 2    stage 0: embedding, blocks 0-1      (rank 0)
                            stage 1: blocks 2-3                 (rank 1)
                            stage 2: blocks 4-5                 (rank 0)
                            stage 3: blocks 6-7, norm, head     (rank 1)

A rank builds only its part of the model (``GPT(..., blocks=, embed=, head=)``): every
parameter has its name and its initial values in the whole model, so checkpoints, the TP layout
and a resume at another pipeline size see the same tensors. Each stage is a ``GPTStage``: a
module over the part's embedding, blocks, norm and head (the same module objects), whose forward
is what ``PipelineStage`` runs for one micro-batch: token ids in on the first stage, the residual
stream (B, T, D) between stages (under sequence parallelism this TP rank's (B, T_r, D) shard),
this rank's logits (B, T, V_local) out of the last. Under context parallelism the first stage
takes the whole rows and keeps its CP chunks; the stream and the logits hold those tokens. The
cut itself and what a pipeline may be are ``parallel/stages.py``'s.

A tied head (the default GPT's) is the embedding table: the last stage's part holds a copy of
it (``parallel.stages.mark_stage_copy``), drawn from the same name, so equal at the start; the
trainer sums the two copies' gradients after each step's backward (``train/pipeline.py``), so
they stay equal.

Dropout: a stage counts the micro-batches it runs within a step and gives block i of
micro-batch j the key number j · L + i + 1 of its stream, the number the whole model's forward
takes for it on the j-th pass of gradient accumulation: the masks are those of the same run
without a pipeline, and no two stages, blocks or micro-batches share one.
"""

from __future__ import annotations

import torch
from torch import nn

from tensorpar.gpt.model import GPT, BlockDict
from tensorpar.parallel.stages import check_pipeline, rank_stages, stage_blocks

__all__ = ["GPTStage", "describe_split", "rank_part"]


def rank_part(n_layer: int, pp: int, virtual: int, rank: int) -> tuple[list[int], list[range],
                                                                        dict]:
    """Pipeline rank ``rank``'s stages, every stage's blocks, and the rank's part of the GPT as
    ``GPT(..., **part)`` takes it: {"blocks": [...], "embed": bool, "head": bool}."""
    check_pipeline(pp, virtual, n_layer)
    count = pp * virtual
    ranges = stage_blocks(n_layer, count)
    mine = rank_stages(pp, virtual, rank)
    part = {"blocks": [i for s in mine for i in ranges[s]], "embed": 0 in mine,
            "head": count - 1 in mine}
    return mine, ranges, part


def describe_split(n_layer: int, pp: int, virtual: int = 1) -> str:
    """One line on how the blocks are cut, e.g. "blocks 0-2 | 3-4 (5 over 2 stages)"."""
    parts = [f"{r.start}-{r.stop - 1}" if len(r) > 1 else f"{r.start}"
             for r in stage_blocks(n_layer, pp * virtual)]
    placed = "" if virtual == 1 else f", stage s on pp rank s % {pp}"
    return f"blocks {' | '.join(parts)} ({n_layer} over {pp * virtual} stages{placed})"


class GPTStage(nn.Module):
    """Stage ``index`` of ``count`` of a GPT, over ``gpt`` (this rank's part of the model)
    holding its ``blocks``: the embedding first if it is the first stage, the norm and head
    after if it is the last (a tied head: the embedding table, a copy of the first stage's)."""

    def __init__(self, gpt: GPT, index: int, count: int, blocks: range):
        super().__init__()
        self.index, self.count = index, count
        self.first, self.last = index == 0, index == count - 1
        if self.first or (self.last and gpt.lm_head is None):  # a tied head: the table
            self.embed = gpt.embed
        self.blocks = BlockDict({str(i): gpt.blocks[i] for i in blocks})
        if self.last:
            self.norm, self.lm_head = gpt.norm, gpt.lm_head
        object.__setattr__(self, "gpt", gpt)  # its steps, not a submodule: no parameter twice
        self._step, self._micro = None, 0

    def _micro_batch(self) -> int:
        """This forward's micro-batch within the step (the schedule runs them in order)."""
        step = self.gpt.rng.step
        if self._step != step or not self.training:
            self._step, self._micro = step, 0
        self._micro += 1
        return self._micro - 1

    def forward(self, x: torch.Tensor, seq_len: int,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One micro-batch: ids (B, T) into the first stage, the residual stream between stages,
        this rank's logits out of the last. seq_len: T (under sequence parallelism the stream
        holds this rank's shard of it). position_ids: packed examples' positions (B, T)."""
        gpt, micro = self.gpt, self._micro_batch()
        if self.first:
            x = gpt.embed(gpt.cp_local(x))  # under CP: the whole rows in, this rank's chunks
        B = x.shape[0]
        t = gpt.cp_tokens(seq_len)  # the tokens this CP rank holds
        rope, mask = gpt.positions(B, seq_len, x.device, position_ids=position_ids)
        x = gpt.run_blocks(x, rope, mask, t, blocks=self.blocks,
                           first_key=micro * gpt.cfg.n_layer,
                           context=gpt.cp_context(seq_len, position_ids))
        return gpt.logits(x, t) if self.last else x
