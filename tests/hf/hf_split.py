"""What a tensor-parallel Hugging Face model must hold on each rank and send per step, derived
from the dense model alone, never from the plan that split it: a plan that leaves a layer whole
gives the dense logits (every rank computes the whole layer), and fails here.

The layout every family of ``conftest.py`` must get::

    every nn.Linear / GPT-2 Conv1D  split: the row layers (``ROW``: attention's output
                                    projection, the MLP's down projection) by input features,
                                    every other one (q/k/v, gate/up, the head) by output features
    the input embedding             split by vocabulary rows
    everything else                 whole: norms, position tables, the row layers' biases

Shares are ``torch.tensor_split``'s; inside attention the features are dealt by whole heads
(``tensor_split`` of the query heads; a rank's K and V rows are the KV heads its query heads read,
so with fewer KV heads than ranks several ranks hold the same ones).
"""

import torch
import torch.distributed as dist
from torch import nn
from transformers.pytorch_utils import Conv1D

# the layers reducing their partial products: attention's output projection, the MLP's down one
ROW = ("o_proj", "out_proj", "dense", "c_proj", "down_proj", "fc2", "dense_4h_to_h")
QKV = ("q_proj", "c_attn", "query_key_value")  # a module holding one of these is an attention


def _features(m: nn.Module) -> tuple[int, int]:
    """(in, out) features; Conv1D stores its weight as (in, out)."""
    return (m.weight.shape[0], m.nf) if isinstance(m, Conv1D) else (m.in_features, m.out_features)


def _linears(dense: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in dense.named_modules() if isinstance(m, (nn.Linear, Conv1D))}


def _heads(heads: torch.Tensor, width: int) -> torch.Tensor:
    """The feature indices of ``heads``, each ``width`` features wide."""
    return (heads[:, None] * width + torch.arange(width)).flatten()


def _kv_heads(config, n: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(query heads, KV heads) of ``rank`` and the head counts (H, K)."""
    H = config.num_attention_heads
    K = getattr(config, "num_key_value_heads", None) or H
    q = torch.tensor_split(torch.arange(H), n)[rank]
    return q, torch.unique(q // (H // K)), H, K


def shares(dense: nn.Module, n: int, rank: int) -> dict[str, tuple[int, torch.Tensor]]:
    """{parameter name: (dim, indices)}: ``rank``'s slice of each split parameter, in
    nn.Linear's (out, in) layout; a parameter not named is held whole."""
    q, kv, H, K = _kv_heads(dense.config, n, rank)
    split = lambda size: torch.tensor_split(torch.arange(size), n)[rank]  # noqa: E731
    emb = dense.get_input_embeddings()
    out = {f"{name}.weight": (0, split(m.num_embeddings))
           for name, m in dense.named_modules() if m is emb}
    for name, m in _linears(dense).items():
        parent_name, _, child = name.rpartition(".")
        attention = any(hasattr(dense.get_submodule(parent_name), a) for a in QKV)
        in_f, out_f = _features(m)
        if child in ROW:  # bias whole: added once, after the reduction
            out[f"{name}.weight"] = (1, _heads(q, in_f // H) if attention else split(in_f))
            continue
        if child in ("k_proj", "v_proj"):
            rows = _heads(kv, out_f // K)
        elif child == "c_attn":  # GPT-2: q | k | v blocks, each dealt by the query heads
            E = out_f // 3
            rows = torch.cat([b * E + _heads(q, E // H) for b in range(3)])
        elif attention:  # q_proj; GPT-NeoX's query_key_value, q|k|v per head: 3 head dims
            rows = _heads(q, out_f // H)
        else:
            rows = split(out_f)
        out[f"{name}.weight"] = out[f"{name}.bias"] = (0, rows)
    return out


def assert_split(model: nn.Module, dense: nn.Module, group=None) -> dict:
    """Every parameter of the converted ``model`` is exactly this rank's slice of the dense
    one's (``shares``), before any training step: a layer left whole fails on its shape.
    Returns the bytes this rank holds ("held") and the dense model's ("dense")."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    expected = shares(dense, n, rank)
    dense_params = dict(dense.named_parameters())
    names = [name for name, _ in model.named_parameters()]
    assert sorted(names) == sorted(dense_params), f"{names} vs {list(dense_params)}"
    held = 0
    for name, p in model.named_parameters():
        ref = dense_params[name].detach()
        owner = dense.get_submodule(name.rpartition(".")[0])
        if isinstance(owner, Conv1D) and name.endswith(".weight"):
            ref = ref.t()  # the shards are nn.Linear's (out, in)
        whole = tuple(ref.shape)
        if name in expected:
            ref = ref.index_select(*expected[name])
        assert p.shape == ref.shape, (
            f"rank {rank}: {name} holds {tuple(p.shape)}, its share of {whole} over {n} ranks is "
            f"{tuple(ref.shape)}{' (left whole)' if tuple(p.shape) == whole else ''}")
        assert torch.equal(p.detach(), ref), f"rank {rank}: {name} is not its dense slice"
        held += p.numel() * p.element_size()
    return {"held": held, "dense": sum(p.numel() * p.element_size() for p in dense_params.values())}


def planned_collectives(dense: nn.Module, n: int, gather: bool = True) -> tuple[dict, dict]:
    """The collectives of one forward and one backward of the model split as ``shares`` says,
    its head gathering the logits (``column_gather``; gather=False: ``column``); none at TP=1.

    forward: the embedding's all-reduce (each rank looked up its vocabulary rows), one per row
    layer (its partial products summed), the head's all-gather of the vocab-split logits.
    backward: one all-reduce per set of column layers reading one input (a block's are one fused
    op: q|k|v, gate|up; the head alone) for its input gradient; per attention, one more when
    several ranks hold a KV head (its K/V gradients summed) and one per parameter it holds whole
    besides its projections (Qwen3's q/k norms: each rank's gradient covers its heads only).
    The row layers and the embedding send nothing in backward, nor does the gather.
    """
    if n == 1:
        return {}, {}
    linears = _linears(dense)
    rows = [name for name in linears if name.rpartition(".")[2] in ROW]
    inputs = {name.rpartition(".")[0] for name in linears if name.rpartition(".")[2] not in ROW}
    attentions = [m for m in dense.modules() if any(hasattr(m, a) for a in QKV)]
    kv = [set(_kv_heads(dense.config, n, r)[1].tolist()) for r in range(n)]
    shared = sum(len(s) for s in kv) > len(set().union(*kv))
    whole = sum(1 for a in attentions for c in a.children()
                if not isinstance(c, (nn.Linear, Conv1D)) for _ in c.parameters())
    forward = {"all_reduce": 1 + len(rows)} | ({"all_gather": 1} if gather else {})
    backward = {"all_reduce": len(inputs) + shared * len(attentions) + whole}
    return forward, backward
