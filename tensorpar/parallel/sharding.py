"""How a dimension is split across the ranks of a tensor-parallel group.

Every split in tensorpar follows ``torch.tensor_split(x, tp_size, dim)``: shard sizes differ by at
most one, larger shards first. A dimension of 10 over 4 ranks is split 3, 3, 2, 2, so sizes that do
not divide by the TP size still work.

Each sharded parameter carries a :class:`ShardSpec` (``param.tp_shard``) naming the dense dimension
it was cut from and which slice it holds; replicated parameters carry ``dim=None``. Routed experts
carry theirs as ``param.ep_shard`` instead (dim 0: the experts, cut across the expert-parallel
ranks). Checkpoints and gradient-norm code read them (``param_shard``) instead of guessing from
names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def shard_sizes(size: int, parts: int) -> list[int]:
    """Sizes of the ``parts`` shards of a dimension of ``size``, as ``torch.tensor_split`` cuts."""
    base, extra = divmod(size, parts)
    return [base + 1 if r < extra else base for r in range(parts)]


def shard_range(size: int, parts: int, rank: int) -> tuple[int, int]:
    """The half-open range ``[start, stop)`` of shard ``rank`` of a dimension of ``size``."""
    base, extra = divmod(size, parts)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class ShardSpec:
    """Which slice of the dense tensor a parameter holds.

    dim: the dense dimension that is split, or None for a replicated parameter.
    start, stop: the slice ``[start, stop)`` of that dimension held by this rank.
    full_size: the size of that dimension in the dense tensor.
    parts: for a fused dimension made of ``parts`` equal blocks (GPT-2's c_attn packs q, k, v),
        the rank holds ``[start, stop)`` of every block (start/stop count within one block).
    """

    dim: int | None
    start: int = 0
    stop: int = 0
    full_size: int = 0
    parts: int = 1  # a fused dim (GPT-2's q|k|v): ``parts`` equal blocks, each split alike

    def __post_init__(self):
        if self.dim is None:
            return
        block, rest = divmod(self.full_size, max(self.parts, 1))
        if self.parts < 1 or rest or not 0 <= self.start <= self.stop <= block:
            raise ValueError(f"ShardSpec: [{self.start}, {self.stop}) of each of {self.parts} "
                             f"blocks does not fit a dimension of {self.full_size}")

    def ranges(self) -> list[tuple[int, int]]:
        """The dense ranges of the split dim this rank holds, in the order its local tensor
        stacks them: with block size B = full_size / parts, block i contributes
        [i·B + start, i·B + stop), so the local size along ``dim`` is parts · (stop - start)."""
        block = self.full_size // self.parts
        return [(i * block + self.start, i * block + self.stop) for i in range(self.parts)]

    def take(self, dense: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the dense tensor (the blocks' slices, concatenated)."""
        if self.dim is None:
            return dense
        pieces = [dense.narrow(self.dim, a, b - a) for a, b in self.ranges()]
        return pieces[0] if self.parts == 1 else torch.cat(pieces, dim=self.dim)


REPLICATED = ShardSpec(dim=None)


def is_expert_split(p: torch.Tensor) -> bool:
    """Whether ``p`` holds part of its MoE layer's experts (an ``ep_shard`` short of all of
    them): data parallelism leaves such a tensor out, the gradient norm counts it over the EP
    group."""
    spec = getattr(p, "ep_shard", None)
    return spec is not None and spec.stop - spec.start != spec.full_size


def slice_dense(t: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """A contiguous copy of ``t[start:stop]`` along ``dim`` (never a view of the dense tensor)."""
    return t.detach().narrow(dim, start, stop - start).clone(memory_format=torch.contiguous_format)


def sharded_parameter(dense: torch.Tensor, dim: int, start: int, stop: int) -> torch.nn.Parameter:
    """A parameter holding ``dense[start:stop]`` along ``dim``, tagged with its ShardSpec.

    It requires grad exactly when ``dense`` does, so frozen weights stay frozen.
    """
    p = torch.nn.Parameter(slice_dense(dense, dim, start, stop),
                           requires_grad=dense.requires_grad)
    p.tp_shard = ShardSpec(dim, start, stop, dense.shape[dim])
    return p


def replicated_parameter(dense: torch.Tensor) -> torch.nn.Parameter:
    """A parameter holding a full copy of ``dense`` on every rank (requires grad as it does)."""
    p = torch.nn.Parameter(dense.detach().clone(), requires_grad=dense.requires_grad)
    p.tp_shard = REPLICATED
    return p


def param_shard(p: torch.Tensor) -> ShardSpec:
    """The split of parameter ``p``: its experts' (``ep_shard``: dim 0, the routed experts cut
    across the EP ranks) if it has one, else its TP split (``tp_shard``), else replicated (a
    ``tp_shard`` beside an ``ep_shard`` is the same split, or none). The expert dim is a shard
    dim like TP's: checkpoints store and load it as one."""
    tp, ep = getattr(p, "tp_shard", REPLICATED), getattr(p, "ep_shard", None)
    if ep is None:
        return tp
    if tp.dim is not None and tp != ep:  # no layer makes one: a bug, not a user's input
        raise ValueError(f"a parameter of shape {tuple(p.shape)} is split both by TP (dim "
                         f"{tp.dim}) and across experts (dim {ep.dim})")
    return ep


def dense_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape of the dense tensor that parameter ``p`` is cut from (``param_shard``)."""
    spec = param_shard(p)
    shape = list(p.shape)
    if spec.dim is not None:
        shape[spec.dim] = spec.full_size
    return tuple(shape)


def local_parameter(local: torch.Tensor, spec: ShardSpec, requires_grad: bool = True):
    """A parameter holding ``local``, already this rank's piece, tagged with ``spec``."""
    p = torch.nn.Parameter(local.contiguous(), requires_grad=requires_grad)
    p.tp_shard = spec
    return p


def check_expert_parallel(ep: int, tp: int, dp: int | None, experts: int | None,
                          cp: int = 1) -> None:
    """Parallel folding (Megatron-core's name): the expert-parallel ranks of an MoE model are
    taken from the dp x cp x tp ranks of a pipeline stage (``cp`` 1: dp x tp), so attention
    keeps its TP, CP and DP while the routed experts are split over ``ep`` ranks as
    ``tensor_split`` splits them (6 over 4: 2, 2, 1, 1). The one rule for the trainer, the
    planner, the mesh and ``verify``: ValueError, naming ``--ep`` and the numbers, unless ``ep``
    ranks fold into the ranks of a stage (``ep`` divides dp·cp·tp), an EP group holds whole TP
    groups (``ep`` 1 or a multiple of ``tp``), and every EP rank holds at least one of the
    ``experts`` routed experts (0: a dense model, which takes only ``ep`` 1). ``dp`` or
    ``experts`` None: not known to this caller (dp under torchrun until the mesh is built; the
    experts where only the layout is), not checked."""
    if ep < 1:
        raise ValueError(f"--ep {ep} must be >= 1")
    if ep == 1:
        return
    if experts == 0:
        raise ValueError(f"--ep {ep}: the model has no experts; expert parallelism needs an "
                         "MoE model")
    if dp is not None and (dp * cp * tp) % ep:
        layout = f"--dp {dp}" + (f" x --cp {cp}" if cp > 1 else "") + f" x --tp {tp}"
        raise ValueError(f"--ep {ep} does not divide the {dp * cp * tp} ranks of a stage "
                         f"({layout})")
    if ep % tp:
        raise ValueError(f"--ep {ep} with --tp {tp}: an EP group holds whole TP groups, so --ep "
                         "must be 1 or a multiple of --tp")
    if experts is not None and ep > experts:
        raise ValueError(f"--ep {ep} is more than the {experts} routed experts: every EP rank "
                         "needs at least one")
