"""Convert an existing dense model (a Hugging Face transformer, or your own) in place, following a
plan: a dict from module-name patterns to styles, so a model's whole split fits on one screen::

    LLAMA = {
        "model.embed_tokens":       "vocab",          # VocabParallelEmbedding
        "model.layers.*.self_attn": "attention",      # q/k/v column by heads, o row; one f
        "model.layers.*.mlp":       "mlp",            # gate/up column, down row; one f
        "lm_head":                  "column_gather",  # logits gathered for the model's own loss
    }

``*`` matches one name component. Styles:

- ``vocab``: an ``nn.Embedding`` split by vocabulary rows.
- ``column`` / ``column_gather`` / ``row``: one ``nn.Linear`` (or GPT-2 ``Conv1D``) split on its
  output / its output, gathered after / its input (partial sums all-reduced, bias added once).
- ``attention``: an attention module with ``q_proj, k_proj, v_proj, o_proj`` (Llama, Mistral,
  Qwen) or ``c_attn, c_proj`` (GPT-2). Heads are dealt like ``tensor_split``; q, k and v are one
  fused op (``fused_blocks.py``: the input enters the TP region once, and the backward all-reduce
  runs while the weight-gradient matmuls compute, as in tensorpar's GPT), the output projection
  reduces its product in place, and the head-count attributes are set to the local values. With
  fewer KV heads than ranks, each rank holds the KV heads its query heads read (their gradients
  summed over the ranks that share them); when a rank's query heads do not map onto its KV heads
  as a uniform repeat, the KV heads are repeated per query head locally.
- ``mlp``: an MLP whose linear children map D -> H (column, e.g. gate and up, fused as above)
  and H -> D (row); the activation runs on shards.
- ``moe``: a Mixture-of-Experts block (``moe.py``): its router whole, its routed experts cut
  across the EP group (``ep_group=``, default the TP group), its shared expert(s) as ``mlp``;
  a dense layer in an MoE model's place as ``mlp``.
- ``replicated``: left whole on every rank (the default for everything the plan does not name).

Weights come from a *source*: the dense model itself (``parallelize``) or the safetensors files of
a checkpoint, read slice by slice (``from_pretrained``), so the dense weights never need to exist.

``sequence_parallel=True`` (Llama family): the residual stream between the blocks holds sequence
shards, the norms run on them (``sequence.py``). The Llama family's RMSNorms run torch's fused
kernel on float32 activations, as the GPT's do (``norms.py``).
"""

from __future__ import annotations

import re
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.hf.context import check_context_parallel, install_context_parallel
from tensorpar.hf.dropout import install_region_streams
from tensorpar.hf.fused_blocks import FusedColumnLinear
from tensorpar.hf.labels_loss import vocab_parallel_labels_loss
from tensorpar.hf.norms import fuse_rms_norms
from tensorpar.hf.plans import check_split, plan_for, tied_heads
from tensorpar.hf.sequence import SequenceLength, check_sequence_parallel, split_at_first_layer
from tensorpar.hf.styles import Converter, ModuleSource
from tensorpar.parallel.collectives import all_reduce
from tensorpar.parallel.sharding import REPLICATED
from tensorpar.runtime.groups import device_for, tp_rank, tp_size

STYLES = ("vocab", "column", "column_gather", "row", "attention", "mlp", "moe", "replicated")


def _pattern(p: str) -> re.Pattern:
    return re.compile("^" + re.escape(p).replace(r"\*", r"[^.]+") + "$")


def check_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, list[str]]:
    """Module names each pattern matches; ValueError for unknown styles or unmatched patterns."""
    names = [n for n, _ in model.named_modules() if n]
    matches = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"plan entry {pattern!r}: unknown style {style!r}; use one of "
                             f"{STYLES}")
        matches[pattern] = [n for n in names if _pattern(pattern).match(n)]
        if not matches[pattern]:
            raise ValueError(f"plan entry {pattern!r} matches no module of "
                             f"{type(model).__name__}")
    return matches


def check_plan_fits(model: nn.Module, plan: dict[str, str], n: int,
                    sequence_parallel: bool = False, context_parallel: bool = False, *,
                    ep: int | None = None) -> None:
    """Raise ValueError, the same on every rank, for a plan (or sequence or context parallelism)
    that cannot split ``model`` over ``n`` ranks (MoE experts over ``ep``, default ``n``):
    before any collective, before a byte is read."""
    if context_parallel:
        check_context_parallel(model, sequence_parallel, has_dropout(model))
    matches = check_plan(model, plan)
    for pattern, names in matches.items():
        for name in names:
            check_split(model, name, plan[pattern], n, n if ep is None else ep)
    if sequence_parallel:
        styles = {name: plan[p] for p, names in matches.items() for name in names}
        check_sequence_parallel(model, styles, has_dropout(model))


@torch.no_grad()
def apply_plan(model: nn.Module, plan: dict[str, str], group: ProcessGroup | None = None,
               source=None, dtype: torch.dtype | None = None,
               tied: dict[str, str] | None = None,
               sequence_parallel: bool = False,
               cp_group: ProcessGroup | None = None,
               ep_group: ProcessGroup | None = None) -> nn.Module:
    """Swap the modules ``plan`` names for their tensor-parallel versions (see module doc).

    source: where dense weights are read (default: the model itself). tied: column module name ->
    embedding module name whose weight it shares (a tied LM head keeps sharing the vocab shard).
    sequence_parallel: sequence shards between the blocks (checked by ``check_plan_fits``).
    cp_group: the context-parallel group (``context.py``; None or one rank: no CP).
    ep_group: the ranks the MoE blocks' routed experts are cut across (None: ``group``).
    """
    matches = check_plan(model, plan)
    source = source or ModuleSource(model)
    seq = SequenceLength() if sequence_parallel else None
    conv = Converter(source, group, dtype, seq, ep_group)  # dtype None: each keeps its own
    tied, embeddings, regions = tied or {}, {}, []
    # embeddings first, so that a tied head finds its shard
    for pattern, style in sorted(plan.items(), key=lambda kv: kv[1] != "vocab"):
        for name in matches[pattern]:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            m = getattr(parent, child)
            if style == "vocab":
                new = embeddings[name] = conv.vocab(name, m)
            elif style in ("column", "column_gather"):
                if name in tied and tied[name] not in embeddings:
                    raise ValueError(f"{name} shares its weight with {tied[name]}: the plan must "
                                     f"also give {tied[name]!r} the style 'vocab'")
                emb = embeddings.get(tied.get(name, ""))
                new = conv.column(name, m, gather=style == "column_gather",
                                  weight=None if emb is None else emb.weight)
            elif style == "row":
                new = conv.row(name, m)
            elif style == "attention":
                new = conv.attention(name, m)
                regions.append(name)
            elif style == "mlp":
                new = conv.mlp(name, m)
                regions.append(name)
            elif style == "moe":
                regions += conv.moe(name, m)
                new = m
            else:
                continue
            setattr(parent, child, new)
    for name, p in list(model.named_parameters()):
        if p.is_meta:  # loading from files: what the plan left whole (norms, position tables)
            owner, _, attr = name.rpartition(".")
            p = nn.Parameter(source.read(name).to(dtype or p.dtype), requires_grad=p.requires_grad)
            setattr(model.get_submodule(owner), attr, p)
        if not hasattr(p, "tp_shard"):
            p.tp_shard = REPLICATED
    if seq is not None:  # the norms see only this rank's tokens: their gradients are partial
        conv.grad_sum += split_at_first_layer(model, seq, regions, group)
    if conv.n > 1:
        sum_grads_over_tp(model, conv.grad_sum, group)
    # dropout between f and g draws from a per-rank stream (hf/dropout.py), kept on the model;
    # a model that drops nothing swaps no generator states (nor breaks a compiled graph there)
    model.tp_region_stream = install_region_streams(
        model, regions if has_dropout(model) else [], tp_rank(group))
    fuse_rms_norms(model)  # the GPT's one-kernel RMSNorm (norms.py)
    head = getattr(model, "lm_head", None)
    if isinstance(head, FusedColumnLinear) and head.gather_output and conv.n > 1 and \
            hasattr(model, "loss_function"):  # labels= losses on the split logits
        vocab_parallel_labels_loss(model, head, group)
    if cp_group is not None and tp_size(cp_group) > 1:
        install_context_parallel(model, cp_group)
    return model


def sum_grads_over_tp(model: nn.Module, names: list[str], group: ProcessGroup | None) -> None:
    """Complete the partial gradients of the replicated parameters ``names`` (Qwen3's per-head
    q/k norms, which see only this rank's heads): summed over the TP group in backward.

    The gradient hook goes on the tensor the owning module holds when its forward starts, once
    per tensor object, not on the parameter at conversion time: FSDP2 (``data_parallel``) swaps
    each parameter for a DTensor and, during forward, for a gathered tensor of its own (kept
    from step to step), so a hook on the original parameter would never fire. Without FSDP2 the
    tensor is the parameter itself, hooked at the first forward.
    """
    def hook_once(module: nn.Module, args, attr: str) -> None:
        p = getattr(module, attr)
        if p.requires_grad and not getattr(p, "_tp_grad_sum", False):
            p.register_hook(partial(all_reduce, group=group))
            p._tp_grad_sum = True

    for name in names:
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner).register_forward_pre_hook(partial(hook_once, attr=attr))


def has_dropout(model: nn.Module) -> bool:
    """Whether the model drops anything: a dropout module or a config probability above 0."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    cfg = vars(getattr(model, "config", None) or object())
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
               for k, v in cfg.items() if "dropout" in k or "pdrop" in k)


def check_same_weights(model: nn.Module, group: ProcessGroup | None = None) -> None:
    """Raise ValueError on every rank unless all ranks hold the same dense weights, and, for a
    model with dropout, the same state of torch's global generator (the stream the TP group
    shares outside TP regions). One small all-gather of checksums."""
    if tp_size(group) == 1:
        return
    names = [n for n, p in model.named_parameters() if not p.is_meta] + ["<global RNG state>"]
    # the state's bytes weighted by position: equal sums mean equal states in practice
    state = torch.get_rng_state().double()
    rng = (state * torch.arange(1, state.numel() + 1)).sum() if has_dropout(model) else \
        torch.zeros((), dtype=torch.float64)
    # on the group's device (a GPU under NCCL, which takes no CPU tensors), whatever device
    # the model is on
    device = device_for(group)
    sums = torch.stack([p.detach().double().sum().to(device) for n, p in model.named_parameters()
                        if not p.is_meta] + [rng.to(device)])
    every = [torch.empty_like(sums) for _ in range(tp_size(group))]
    dist.all_gather(every, sums, group=group)
    differ = [names[i] for i in range(len(names))
              if any(not torch.equal(e[i], every[0][i]) for e in every)]
    if differ[:1] == ["<global RNG state>"]:
        raise ValueError("the ranks' global random generators differ and the model has dropout: "
                         "call torch.manual_seed with the same seed on every rank before "
                         "parallelize(), so the ranks draw the same masks outside TP regions")
    if differ:
        raise ValueError(f"the ranks hold different dense weights ({', '.join(differ[:3])}"
                         f"{', ...' if len(differ) > 3 else ''}): build the model from the same "
                         "seed or checkpoint on every rank before parallelize()")


def parallelize(model: nn.Module, plan: dict[str, str] | None = None,
                group: ProcessGroup | None = None, sequence_parallel: bool = False,
                cp_group: ProcessGroup | None = None,
                ep_group: ProcessGroup | None = None) -> nn.Module:
    """Convert a dense model in place to tensor parallelism over ``group`` and return it.

    Every rank must hold the same dense model (same seed or the same checkpoint); this is
    checked. ``plan`` defaults to the built-in plan of the model's family (module docstring).
    sequence_parallel: the residual stream between the blocks holds this rank's sequence shard
    (Llama family; for training and scoring, not ``generate()``: ``sequence.py``).
    cp_group: context parallelism over this group (Llama family, ``context.py``): every CP rank
    calls the model on the same whole rows and gets its load-balanced chunks' logits; pass the
    TP group as ``group`` (None would be the whole world).
    ep_group: the ranks the routed experts of MoE blocks are cut across (default ``group``;
    another folding: a TP group's ranks all in it, or each in another EP group).
    """
    plan = plan or plan_for(model)
    cp = cp_group is not None and tp_size(cp_group) > 1
    ep = tp_size(group if ep_group is None else ep_group)
    check_plan_fits(model, plan, tp_size(group), sequence_parallel, cp,
                    ep=ep)  # before any collective
    check_same_weights(model, group)
    return apply_plan(model, plan, group, tied=tied_heads(model),
                      sequence_parallel=sequence_parallel, cp_group=cp_group, ep_group=ep_group)
