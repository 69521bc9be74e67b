"""Context parallelism for converted Llama-family models (``parallelize(model, group=tp_group,
cp_group=cp_group)``, ``from_pretrained(path, ..., cp_group=)``).

Every rank of a CP group calls the model on the same whole rows; the model keeps this rank's
load-balanced chunks of them (``parallel/context.py``: rank i of N holds chunks i and 2N-1-i of
2N) and returns the logits of those tokens only::

    model(input_ids (B, T), position_ids (B, T) | None, labels (B, T) | None)
      entry (pre-hook)      input_ids, position_ids -> this rank's (B, T_i) chunks; the whole
                            rows' positions travel to attention as a ``CPSequence``
      embedding, norms,     on the T_i tokens alone; rotary positions from the chunks' global
      q/k/v, rotary, MLP    position ids (transformers derives them from position_ids)
      attention             transformers' attention interface ``tensorpar_cp``: K and V
                            all-gathered over the CP group (``cp_keys_values``, one collective;
                            backward: reduce-scatter), the mask from global positions
                            (``cp_attention_mask``: causal, packed examples kept apart, and the
                            sliding window of the families that have one), torch's SDPA
      lm_head               (B, T_i, V) logits of this rank's tokens
      loss (labels=)        the labels shifted on the whole rows, then split; each rank sums its
                            tokens' losses over the whole rows' count, the sum all-reduced over
                            the CP group (backward: identity), so ``out.loss`` is the full loss

Packed rows (several examples a row, ``position_ids`` restarting at 0 at each) never attend
across an example's start, on any rank. The weights' gradients on a CP rank are its tokens'
share: summed over the CP group (with the data-parallel sum) they are the full gradient.

The context travels as a keyword argument of the forward (``tensorpar_cp``), which transformers
hands down to every attention call, so a recomputed layer (gradient checkpointing) sees it again.
The attention function is registered once in transformers' ``AttentionInterface`` (its way to
add an attention kernel, a constant name -> function entry) and the model's config names it; it
keeps no state: the group and the sequence come with each call.

An MoE family's router logits (``output_router_logits``) come back as this rank's tokens' rows,
(B x T_i, E) a layer, and the model's own ``aux_loss`` is left out (None): from one rank's chunks
it is not the whole rows' load-balancing loss, which ``hf/moe.py``'s ``balancing_loss(
out.router_logits, E, k, cp_group)`` computes (its statistics summed over the group: the loss of
one rank holding every token; the trainer sums them over dp x cp).

For training and scoring: no KV cache (``generate()`` needs a model converted without CP), no
padding ``attention_mask`` (pad with labels -100, or pack), no router logits with ``labels=``
(transformers would add each rank's own load-balancing loss to the loss summed over the group),
and not with sequence parallelism or dropout yet.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.parallel.context import check_cp_split, cp_key_index, cp_token_index
from tensorpar.parallel.mappings import reduce_from_tp
from tensorpar.runtime.groups import tp_rank, tp_size
from tensorpar.transformer.context_parallel import CPSequence, cp_attention_mask, cp_keys_values

CP_ATTENTION = "tensorpar_cp"  # the attention interface's name for the function below
CP_KWARG = "tensorpar_cp"  # the forward keyword that carries a call's CPBatch
# families whose attention is Llama's: q/k/v/o projections, rotary from position_ids,
# transformers' attention interface
CP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
IGNORE = -100


@dataclass(frozen=True)
class CPBatch:
    """What attention needs beyond its chunks: the CP group and the whole rows' sequence."""

    group: ProcessGroup
    sequence: CPSequence


def check_context_parallel(model: nn.Module, sequence_parallel: bool, dropout: bool) -> None:
    """Raise ValueError, the same on every rank, unless ``model`` can run context-parallel."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in CP_FAMILIES:
        raise ValueError(f"context parallelism runs the families whose attention is Llama's "
                         f"({', '.join(CP_FAMILIES)}), not model_type={family!r}")
    if sequence_parallel:
        raise ValueError("sequence parallelism with context parallelism is not built for "
                         "Hugging Face models yet; leave out sequence parallelism")
    if dropout:
        raise ValueError("the model has dropout, which context parallelism does not support "
                         "for Hugging Face models yet; set its dropout probabilities to 0")


def cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask, scaling: float | None = None, dropout: float = 0.0,
                 sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface under CP. query (B, h, T_i, hd), key and value
    (B, kv, T_i, hd): this rank's tokens, rotated at their global positions. Returns
    (B, T_i, h, hd) and no weights. ``attention_mask`` is unused (none is built for this
    interface): the mask comes from the whole rows' positions."""
    batch = kwargs.get(CP_KWARG)
    if batch is None:
        raise ValueError(f"{type(module).__name__}: the model runs context-parallel attention; "
                         "call the whole model (its forward splits the rows and passes "
                         f"{CP_KWARG}=), not a submodule")
    if dropout:
        raise ValueError("context-parallel attention does not drop (attention_dropout 0)")
    seq, group = batch.sequence, batch.group
    k, v = cp_keys_values(key, value, seq.seq_len, group)  # (B, kv, T, hd), rank order
    mask = cp_attention_mask(seq, group, causal=True, device=query.device)  # (B|1, 1, T_i, T)
    if sliding_window:  # a query reads the last ``sliding_window`` positions, itself included
        q_pos = cp_token_index(seq.seq_len, tp_size(group), tp_rank(group), query.device)
        k_pos = cp_key_index(seq.seq_len, tp_size(group), query.device)
        mask = mask & (q_pos[:, None] - k_pos[None, :] < sliding_window)
    groups = query.shape[1] // k.shape[1]  # query heads per KV head on this rank
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    y = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
    return y.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, cp_attention)


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """Each token's target: the next label on the whole row (-100 after the last)."""
    return F.pad(labels, (0, 1), value=IGNORE)[..., 1:]


def _split_call(kwargs: dict, group: ProcessGroup, config) -> dict:
    """The forward's keyword arguments with the whole rows replaced by this rank's chunks, the
    sequence passed on as ``CP_KWARG``; refusals in one line, before any collective."""
    what = "context parallelism"
    if kwargs.get("labels") is not None and _router_logits(kwargs, config):
        raise ValueError(f"{what}: labels= with router logits (output_router_logits) would "
                         "add each rank's load-balancing loss, from its chunks alone; pass "
                         "output_router_logits=False, or leave out labels= and add "
                         "tensorpar.hf.moe.balancing_loss(out.router_logits, ..., cp_group)")
    for name in ("cache", "past_key_values"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{what} takes no KV cache: it is for training and scoring; "
                             "generate with a model converted without cp_group")
    if kwargs.get("logits_to_keep", 0):
        raise ValueError(f"{what}: logits_to_keep is not supported (a rank holds its chunks)")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.bool().all()):
        raise ValueError(f"{what} takes no padding attention_mask: pad with labels -100 (or "
                         "pack examples with position_ids)")
    rows = kwargs.get("input_ids")
    rows = rows if rows is not None else kwargs.get("inputs_embeds")
    if rows is None:
        raise ValueError(f"{what}: pass input_ids or inputs_embeds")
    B, T = rows.shape[:2]
    n = tp_size(group)
    check_cp_split(T, n, what)
    idx = cp_token_index(T, n, tp_rank(group), rows.device)
    pos = kwargs.get("position_ids")
    if pos is not None:
        if pos.shape[-1] != T:
            raise ValueError(f"{what}: position_ids cover {pos.shape[-1]} tokens, the rows {T}")
        pos = pos.expand(B, T)
    out = dict(kwargs, attention_mask=None, use_cache=False)
    for name in ("input_ids", "inputs_embeds"):
        if kwargs.get(name) is not None:
            out[name] = kwargs[name].index_select(1, idx)
    out["position_ids"] = idx.expand(B, -1) if pos is None else pos.index_select(1, idx)
    labels = kwargs.get("labels")
    if labels is not None:
        shifted = kwargs.get("shift_labels")
        shifted = _shifted(labels) if shifted is None else shifted
        if kwargs.get("num_items_in_batch") is None:  # the whole rows' count, on every rank
            out["num_items_in_batch"] = (shifted != IGNORE).sum()
        out["labels"] = labels.index_select(1, idx)
        out["shift_labels"] = shifted.index_select(1, idx)
    out[CP_KWARG] = CPBatch(group, CPSequence(T, pos))
    return out


def _router_logits(kwargs: dict, config) -> bool:
    """Whether a call returns an MoE model's router logits (asked by the call or its config)."""
    router = kwargs.get("output_router_logits")
    return bool(getattr(config, "output_router_logits", False) if router is None else router)


def _attention_in_own_config(model: nn.Module) -> None:
    """Name ``CP_ATTENTION`` in a copy of the model's config that its modules then hold (a config
    object may be shared with other models: a dense reference built from it keeps its own)."""
    old = model.config
    new = copy.deepcopy(old)
    new._attn_implementation = CP_ATTENTION
    for m in model.modules():
        if getattr(m, "config", None) is old:
            m.config = new


def model_cp_group(model: nn.Module) -> ProcessGroup | None:
    """The CP group ``model`` was converted with (through a DDP wrapper too); None: no CP."""
    return getattr(getattr(model, "module", model), "cp_group", None)


def install_context_parallel(model: nn.Module, group: ProcessGroup) -> None:
    """Make ``model`` (a converted Llama-family causal LM) context-parallel over ``group``: its
    forward splits the rows (module docstring), its attention runs ``cp_attention``, its
    ``labels=`` loss is summed over the CP group."""
    _register()
    _attention_in_own_config(model)
    model.cp_group = group

    def split(module, args, kwargs):
        if len(args) > 1:
            raise ValueError("context parallelism: pass the model's inputs by name after "
                             "input_ids")
        if args:
            kwargs = kwargs | {"input_ids": args[0]}
        return (), _split_call(kwargs, group, module.config)

    def loss_over_cp(module, args, kwargs, out):
        if getattr(out, "loss", None) is not None:  # each rank's share -> the whole rows' loss
            # forward: all-reduce, backward: identity, over whichever group it is given (the
            # g operator; parallel/ has no CP-named copy): each rank's loss is its tokens' share,
            # so the sum is the whole rows' loss and each rank's gradient stays its share
            out.loss = reduce_from_tp(out.loss, group)
        if getattr(out, "aux_loss", None) is not None:  # this rank's chunks' alone: not the
            out.aux_loss = None  # rows' (balancing_loss over the group is; module docstring)
        return out

    model.register_forward_pre_hook(split, with_kwargs=True)
    model.register_forward_hook(loss_over_cp, with_kwargs=True)
