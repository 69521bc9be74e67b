"""How each style of a plan converts one dense module (see ``parallelize.py`` for plans).

A ``Converter`` reads dense weights from a *source*, slice by slice, and builds the tensorpar
version of one module: ``column``, ``row`` and ``vocab`` for single layers; ``attention`` and
``mlp`` for whole blocks, whose column projections run as one fused op (``fused_blocks.py``: f, or
the sequence all-gather, once; the backward collective overlapped with the weight-gradient
matmuls), whose row layer reduces its product in place, and whose head-count attributes become
local. Sources: the dense model itself (``ModuleSource``) or safetensors files
(``hf.SafetensorsSource``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.hf.fused_blocks import FusedColumnLinear, InRegionColumn, Region
from tensorpar.hf.moe import SHARED, convert_experts
from tensorpar.hf.norms import HeadsRMSNorm
from tensorpar.hf.plans import OUT_PROJ, attention_heads, check_split, is_conv1d
from tensorpar.hf.sequence import SequenceLength
from tensorpar.parallel.embedding import VocabParallelEmbedding
from tensorpar.parallel.linear import RowParallelLinear
from tensorpar.parallel.mappings import reduce_from_tp
from tensorpar.parallel.sharding import REPLICATED, ShardSpec, local_parameter, shard_range
from tensorpar.runtime.groups import tp_rank, tp_size
from tensorpar.transformer.attention import head_shards


class ModuleSource:
    """Dense tensors read from the model being converted (by parameter name)."""

    def __init__(self, model: nn.Module):
        self.model = model  # lets the converter check a module's surroundings (check_split)
        self.tensors = dict(model.named_parameters(remove_duplicate=False))

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None):
        t = self.tensors[key].detach()
        if dim is not None:
            t = t.narrow(dim, start, (t.shape[dim] if stop is None else stop) - start)
        return t.clone()


def _features(m: nn.Module) -> tuple[int, int]:
    if isinstance(m, nn.Linear):
        return m.in_features, m.out_features
    if is_conv1d(m):
        return m.weight.shape[0], m.nf
    raise TypeError(f"{type(m).__name__} is not an nn.Linear or Conv1D")


class _Reader:
    """Reads this rank's slices of a linear layer's weight in nn.Linear (out, in) layout."""

    def __init__(self, source, name: str, module: nn.Module, dtype):
        self.source, self.name, self.conv = source, name, is_conv1d(module)
        self.dtype = dtype or module.weight.dtype  # default: the layer keeps its own dtype

    def rows(self, key: str, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """Output rows (or bias entries) from each range, concatenated."""
        dim = 1 if self.conv and key == "weight" else 0
        parts = [self.source.read(f"{self.name}.{key}", dim, a, b) for a, b in ranges]
        t = torch.cat(parts, dim=dim)
        return (t.t() if self.conv and key == "weight" else t).to(self.dtype)

    def cols(self, a: int, b: int) -> torch.Tensor:
        t = self.source.read(f"{self.name}.weight", 0 if self.conv else 1, a, b)
        return (t.t() if self.conv else t).to(self.dtype)

    def whole(self, key: str) -> torch.Tensor:
        t = self.source.read(f"{self.name}.{key}")
        return (t.t() if self.conv and key == "weight" else t).to(self.dtype)


class Converter:
    """seq: under sequence parallelism, the model's ``SequenceLength`` (None: off).
    ep_group: the ranks MoE blocks cut their routed experts across (None: the TP group)."""

    def __init__(self, source, group: ProcessGroup | None, dtype,
                 seq: SequenceLength | None = None, ep_group: ProcessGroup | None = None):
        self.source, self.group, self.dtype, self.seq = source, group, dtype, seq
        self.ep_group = group if ep_group is None else ep_group
        self.n, self.rank = tp_size(group), tp_rank(group)
        self.model = getattr(source, "model", None)  # None: from_pretrained checked up front
        self.grad_sum: list[str] = []  # replicated parameters whose gradients are partial

    def column(self, name, m, ranges=None, parts=1, gather=False, cls=FusedColumnLinear,
               weight=None):
        """ranges: output rows to hold, one range per block of a fused (``parts``) weight; their
        positions within a block are the same. weight: an existing shard to use (tied head).
        cls: ``FusedColumnLinear`` for a layer of its own (under SP: the head, gathering the
        sequence), ``InRegionColumn`` for a block's projection."""
        in_f, out_f = _features(m)
        if ranges is None:  # an even split of the features (a plan's column style, an MLP's)
            if self.model is not None:
                check_split(self.model, name, "column", self.n)
            ranges = [shard_range(out_f, self.n, self.rank)]
        a, b = ranges[0]  # block 0 starts at 0, so its range is the in-block range
        layer = cls(in_f, out_f, m.bias is not None, gather_output=gather, group=self.group,
                    device="meta", out_range=(a, b) if parts == 1 else None)
        read = _Reader(self.source, name, m, self.dtype)
        spec = ShardSpec(0, a, b, out_f, parts)
        layer.weight = weight if weight is not None else \
            local_parameter(read.rows("weight", ranges), spec, m.weight.requires_grad)
        layer.bias = None if m.bias is None else \
            local_parameter(read.rows("bias", ranges), spec, m.bias.requires_grad)
        layer.shard_start, layer.shard_stop, layer.shard_spec = a, b, spec
        if cls is FusedColumnLinear:
            layer.seq, layer.sequence_parallel = self.seq, self.seq is not None
        return layer

    def row(self, name, m, in_range=None, sequence_parallel=False):
        """The product reduced in place (``fused_row``), or reduce-scattered onto sequence
        shards (a block's row layer under SP)."""
        in_f, out_f = _features(m)
        if in_range is None and self.model is not None:
            check_split(self.model, name, "row", self.n)
        a, b = in_range or shard_range(in_f, self.n, self.rank)
        layer = RowParallelLinear(in_f, out_f, m.bias is not None, input_is_parallel=True,
                                  sequence_parallel=sequence_parallel, group=self.group,
                                  device="meta", in_range=(a, b), fused=True)
        read = _Reader(self.source, name, m, self.dtype)
        layer.weight = local_parameter(read.cols(a, b), ShardSpec(1, a, b, in_f),
                                       m.weight.requires_grad)
        layer.bias = None if m.bias is None else \
            local_parameter(read.whole("bias"), REPLICATED, m.bias.requires_grad)
        return layer

    def vocab(self, name, m: nn.Embedding):
        if type(m) is not nn.Embedding:
            return self.vocab_in_place(name, m)
        layer = VocabParallelEmbedding(m.num_embeddings, m.embedding_dim, m.padding_idx,
                                       group=self.group, device="meta")
        a, b = layer.vocab_start, layer.vocab_stop
        layer.weight = local_parameter(self.source.read(f"{name}.weight", 0, a, b)
                                       .to(self.dtype or m.weight.dtype),
                                       ShardSpec(0, a, b, m.num_embeddings),
                                       m.weight.requires_grad)
        return layer

    def vocab_in_place(self, name, m: nn.Embedding):
        """An ``nn.Embedding`` subclass (Gemma's scaled embedding) keeps its own forward, run on
        this rank's rows: ids elsewhere are looked up as row 0 and their outputs zeroed, then
        summed over the group. Exact when the subclass only scales the lookup."""
        V, group = m.num_embeddings, self.group
        a, b = shard_range(V, self.n, self.rank)
        m.weight = local_parameter(self.source.read(f"{name}.weight", 0, a, b)
                                   .to(self.dtype or m.weight.dtype),
                                   ShardSpec(0, a, b, V), m.weight.requires_grad)
        m.vocab_start, m.vocab_stop = a, b
        if m.padding_idx is not None:
            m.padding_idx = m.padding_idx - a if a <= m.padding_idx < b else None

        def to_local(mod, args):
            ids = args[0]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
                raise ValueError(f"{name}: ids outside the vocabulary [0, {V})")
            mod._tp_mine = (ids >= a) & (ids < b)
            return (torch.where(mod._tp_mine, ids - a, 0), *args[1:])

        def sum_over_group(mod, args, out):
            mine = mod.__dict__.pop("_tp_mine")
            return reduce_from_tp(out * mine.unsqueeze(-1).to(out.dtype), group)

        m.register_forward_pre_hook(to_local)
        m.register_forward_hook(sum_over_group)
        return m

    def attention(self, name, m):
        """q, k and v split by heads (``head_shards``: GQA and MQA with fewer KV heads than
        ranks too), the output projection by its input; the module's own head counts made
        local, so that its forward reshapes to this rank's heads. Two layouts: separate
        q/k/v projections (Llama and most families) and GPT-2's packed q|k|v Conv1D."""
        if self.model is not None:
            check_split(self.model, name, "attention", self.n)
        heads = attention_heads(m, getattr(m, "config", None))[0]  # before they become local
        if hasattr(m, "c_attn"):
            columns, converted, hd = self._packed_qkv(name, m)
        elif all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj")) and \
                any(hasattr(m, p) for p in OUT_PROJ):
            columns, converted, hd = self._separate_qkv(name, m)
        else:
            raise ValueError(f"{name}: style 'attention' needs q_proj/k_proj/v_proj and one of "
                             f"{OUT_PROJ}, or c_attn/c_proj; "
                             f"{type(m).__name__} has "
                             f"{[c for c, _ in m.named_children()]}")
        self._other_parameters(name, m, converted, hd, heads)
        Region(m, columns, self.group, self.seq)
        return m

    def _packed_qkv(self, name, m) -> tuple[list, set[str], int]:
        """GPT-2: one Conv1D packing q|k|v (multi-head only), each third split by heads."""
        H, hd = m.num_heads, m.head_dim
        (h0, h1), _, _ = head_shards(H, H, self.n, self.rank)
        E = H * hd
        if not is_conv1d(m.c_attn) or _features(m.c_attn)[1] != 3 * E or \
                getattr(m, "is_cross_attention", False):
            raise ValueError(f"{name}.c_attn is not GPT-2's Conv1D packing q|k|v of "
                             f"{H} heads each ({_features(m.c_attn)} features): style "
                             "'attention' does not know this layout")
        m.c_attn = self.column(f"{name}.c_attn", m.c_attn, parts=3, cls=InRegionColumn,
                               ranges=[(i * E + h0 * hd, i * E + h1 * hd) for i in range(3)])
        m.c_proj = self.row(f"{name}.c_proj", m.c_proj, (h0 * hd, h1 * hd), self.seq is not None)
        m.num_heads, m.split_size, m.embed_dim = h1 - h0, (h1 - h0) * hd, (h1 - h0) * hd
        return [m.c_attn], {"c_attn", "c_proj"}, hd

    def _separate_qkv(self, name, m) -> tuple[list, set[str], int]:
        """q_proj by query heads, k_proj and v_proj by KV heads (a KV head several ranks share
        is held by each; a rank whose query heads do not map evenly onto its KV heads expands
        them by ``kv_index``), the output projection by its input."""
        out = next(p for p in OUT_PROJ if hasattr(m, p))
        (H, K), hd = attention_heads(m, getattr(m, "config", None)), m.head_dim
        (h0, h1), (k0, k1), shared = head_shards(H, K, self.n, self.rank)
        m.q_proj = self.column(f"{name}.q_proj", m.q_proj, [(h0 * hd, h1 * hd)],
                               cls=InRegionColumn)
        kv_index = torch.arange(h0, h1) // (H // K) - k0  # local KV head of each query head
        h_local, k_local = h1 - h0, k1 - k0
        uniform = h_local % k_local == 0 and torch.equal(
            kv_index, torch.arange(h_local) // (h_local // k_local))
        for proj in ("k_proj", "v_proj"):
            layer = self.column(f"{name}.{proj}", getattr(m, proj), [(k0 * hd, k1 * hd)],
                                cls=InRegionColumn)
            layer.shared, layer.head_dim = shared, hd
            if not uniform:
                layer.expand = kv_index
            setattr(m, proj, layer)
        setattr(m, out, self.row(f"{name}.{out}", getattr(m, out), (h0 * hd, h1 * hd),
                                 self.seq is not None))
        _local_head_counts(m, h_local, k_local if uniform else h_local, hd,
                           h_local // k_local if uniform else 1)
        return [m.q_proj, m.k_proj, m.v_proj], {"q_proj", "k_proj", "v_proj", out}, hd

    def _other_parameters(self, name, m, converted: set[str], hd: int, heads: int) -> None:
        """Other parameters of the attention (Qwen3's per-head q/k norms) stay whole but see
        only this rank's heads: their gradients are partial sums, completed over the group in
        backward. Ones that mix heads, or the module's own, are refused, but for per-head
        attention sinks (GPT-OSS), split with the query heads."""
        own = [p for p, _ in m.named_parameters(recurse=False)]
        if own == ["sinks"] and m.sinks.shape == (heads,):  # GPT-OSS: one per query head
            h0, h1 = head_shards(heads, heads, self.n, self.rank)[0]
            m.sinks = local_parameter(self.source.read(f"{name}.sinks", 0, h0, h1)
                                      .to(self.dtype or m.sinks.dtype),
                                      ShardSpec(0, h0, h1, heads), m.sinks.requires_grad)
        elif own:  # parameters that mix heads or that nothing here knows how to split
            raise ValueError(f"{name} has parameters of its own ({own}): style 'attention' "
                             "splits only its projections and per-head attention sinks")
        for c, child in list(m.named_children()):
            if c not in converted and _norm_over_heads(child, hd):
                setattr(m, c, self._heads_norm(f"{name}.{c}", child, hd, heads,
                                               attention_heads(m, getattr(m, "config", None))))
                converted = converted | {c}
        others = [(f"{name}.{c}.{p}", t) for c, child in m.named_children()
                  if c not in converted for p, t in child.named_parameters()]
        for pname, t in others:
            if t.numel() > hd:  # a parameter over all heads that is not such a norm
                raise ValueError(f"{pname} has {t.numel()} elements, more than one head "
                                 f"({hd}): it mixes heads, so it cannot run on a rank's heads "
                                 "alone; this attention is not supported by style 'attention'")
        self.grad_sum += [pname for pname, _ in others]

    def moe(self, name, m) -> list[str]:
        """An MoE block (``moe.py``): the routed experts cut across the EP group, the shared
        expert(s) split like the MLP, the router and the shared expert's gate whole; a block
        without experts (a dense layer of an MoE model) is an MLP. Returns the TP regions."""
        if not hasattr(m, "experts"):
            self.mlp(name, m)
            return [name]
        m.experts = convert_experts(self.source, f"{name}.experts", m.experts, self.group,
                                    self.ep_group, self.dtype, self.seq is not None)
        regions = []
        for child in SHARED:
            if isinstance(getattr(m, child, None), nn.Module):
                self.mlp(f"{name}.{child}", getattr(m, child))
                regions.append(f"{name}.{child}")
        return regions

    def _heads_norm(self, name, norm, hd: int, heads: int, counts) -> HeadsRMSNorm:
        """An RMSNorm over all query heads or all KV heads (OLMoE's q/k norms), split with them
        (``HeadsRMSNorm``); refused when ranks share KV heads (their squares would count
        twice)."""
        H, K = heads, counts[1]
        (h0, h1), (k0, k1), shared = head_shards(H, K, self.n, self.rank)
        width = norm.weight.numel()
        a, b = (h0, h1) if width == H * hd else (k0, k1)
        if width != H * hd and shared:
            raise ValueError(f"{name}: a norm over all {K} KV heads cannot be split over "
                             f"{self.n} ranks that share KV heads; use a TP size of at most {K}")
        weight = local_parameter(self.source.read(f"{name}.weight", 0, a * hd, b * hd)
                                 .to(self.dtype or norm.weight.dtype),
                                 ShardSpec(0, a * hd, b * hd, width), norm.weight.requires_grad)
        return HeadsRMSNorm(weight, width, norm.variance_epsilon, self.group)

    def mlp(self, name, m):
        linears = [(c, sub) for c, sub in m.named_children()
                   if isinstance(sub, nn.Linear) or is_conv1d(sub)]
        shapes = {c: _features(sub) for c, sub in linears}
        rows = [c for c, (i, o) in shapes.items()
                if any(shapes[d] == (o, i) for d in shapes if d != c)]
        if len(linears) < 2 or not rows:
            raise ValueError(f"{name}: style 'mlp' needs linear children D -> H and H -> D; "
                             f"found {shapes}")
        row = rows[-1]  # the down projection: registered last in every family
        columns = []
        for c, sub in linears:
            if c == row:
                setattr(m, c, self.row(f"{name}.{c}", sub, sequence_parallel=self.seq is not None))
            elif shapes[c][0] == shapes[row][1]:
                columns.append(self.column(f"{name}.{c}", sub, cls=InRegionColumn))
                setattr(m, c, columns[-1])
        Region(m, columns, self.group, self.seq)
        return m


def _norm_over_heads(m: nn.Module, hd: int) -> bool:
    """An RMSNorm (a weight and ``variance_epsilon``) wider than one head: over all heads."""
    w = getattr(m, "weight", None)
    return isinstance(w, nn.Parameter) and w.dim() == 1 and w.numel() > hd and \
        w.numel() % hd == 0 and hasattr(m, "variance_epsilon") and \
        [n for n, _ in m.named_parameters()] == ["weight"] and "RMSNorm" in type(m).__name__


# the names transformers' attention modules give their head counts, across families and
# releases: each that the module has is set to this rank's count
_HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_head")
_KV_HEAD_COUNTS = ("num_key_value_heads", "num_kv_heads")


def _local_head_counts(m, heads: int, kv_heads: int, head_dim: int, groups: int) -> None:
    """The attention module's own head counts (those it has) set to this rank's."""
    m.num_key_value_groups = groups
    for attr, value in ([(a, heads) for a in _HEAD_COUNTS]
                        + [(a, kv_heads) for a in _KV_HEAD_COUNTS]):
        if isinstance(getattr(m, attr, None), int):
            setattr(m, attr, value)
    if isinstance(getattr(m, "embed_dim", None), int):
        m.embed_dim = heads * head_dim
