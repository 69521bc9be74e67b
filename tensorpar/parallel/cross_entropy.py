"""Cross-entropy on vocab-sharded logits, without ever gathering the logits.

Rank i holds the logits of its vocabulary slice, z_i of shape (..., V_i). Per token::

    loss = logsumexp(z) - z[target]                         (no smoothing)
    loss = (1 - e) (logsumexp(z) - z[target]) + e (logsumexp(z) - mean(z))   (label smoothing e)

Every term is a sum or a logsumexp over the vocabulary, so each rank reduces its own slice first and
only per-token statistics cross the wire:

1. one all-gather of logsumexp z_i and z_i[target] per token (and sum z_i, with label
   smoothing): every rank then knows the global logsumexp, the sum of all logits and z[target],
   which only the owning rank could pick out (the others send 0, so the sum over ranks is exact).
   That is the whole forward's communication when the caller passes the vocabulary size;
2. without it, the ranks first learn V = sum V_i and where their slices start from V_i, sent
   along with the statistics, and then all-reduce z[target]: one collective more.

Backward needs no communication: d loss / d z_i = softmax(z)_i - (1 - e) onehot_i - e / V, computed
in place in the one buffer of the logits' size that forward filled with exp(z_i - max z_i) and saved
instead of the logits: one exp over the slice a step, not two. That buffer is the float32 copy of
bf16 logits, or, with ``reuse_logits``, float32 logits' own: then the loss holds no second buffer of
the logits' size, in forward or backward. Statistics are computed in float32 whatever the
logits' dtype, as Megatron does. With one rank this is ``F.cross_entropy`` on float32 logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from tensorpar.parallel.collectives import all_gather, start_all_reduce
from tensorpar.parallel.sharding import shard_sizes
from tensorpar.runtime.asserts import assert_in_range, checks_on_host
from tensorpar.runtime.groups import tp_rank, tp_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """forward: one all-gather of token statistics (+ an all-reduce of the target logits when
    the vocabulary size is not given); backward: local."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, smoothing, vocab, reuse_logits):
        n, rank = tp_size(group), tp_rank(group)
        z = logits.float()
        valid = target != ignore_index
        # what only z can tell, taken before z's buffer may be reused
        z_sum = z.sum(-1) if smoothing > 0 else None
        known = vocab is not None  # then the target logits travel with the statistics
        if known:
            picked, local_t, mine = _pick_targets(z, target, valid, shard_sizes(vocab, n), rank)
        # logsumexp by hand, keeping exp(z - m) for backward, which builds the gradient in that
        # buffer: one buffer of the logits' size and one exp a step (m: the local max, 0 where it
        # is infinite, as torch.logsumexp does). z's own buffer is used where z is a private
        # float32 copy, or where the caller gave the logits up (reuse_logits)
        m = z.amax(-1, keepdim=True)
        m.masked_fill_(m.abs() == float("inf"), 0.0)
        in_place = vocab is not None and (
            z is not logits or (reuse_logits and not torch.compiler.is_compiling()))
        exp_shifted = (z.sub_(m) if in_place else torch.sub(z, m)).exp_()
        lse_local = exp_shifted.sum(-1).log_().add_(m.squeeze(-1))
        columns = [lse_local, z_sum] if smoothing > 0 else [lse_local]
        if known:
            columns.append(picked)
        stats = torch.stack(columns, dim=-1).reshape(-1)
        if not known:  # the shard sizes travel with the statistics, read back on the host
            stats = torch.cat([stats, stats.new_tensor([float(z.shape[-1])])])
        gathered = all_gather(stats, 0, [stats.numel()] * n, group).view(n, -1)
        if not known:
            sizes = gathered[:, -1].round().long().tolist()
            gathered = gathered[:, :-1]
            vocab = sum(sizes)
            if sizes != shard_sizes(vocab, n):  # the same sizes on every rank: all raise
                raise ValueError(f"vocab_parallel_cross_entropy: the ranks hold {sizes} logits "
                                 f"each, not the tensor_split shards {shard_sizes(vocab, n)} of "
                                 f"{vocab}")
            _check_targets_on_host(target, ignore_index, vocab, sizes)
            picked, local_t, mine = _pick_targets(z, target, valid, sizes, rank)
        per_rank = gathered.view(n, *lse_local.shape, len(columns))
        lse = torch.logsumexp(per_rank[..., 0], dim=0)
        if known:  # one rank's z[target] and the others' zeros: their sum is exact
            picked = per_rank[..., -1].sum(0)
        else:
            picked = start_all_reduce(picked, group)()  # in place (eager)
        loss = lse - picked
        if smoothing > 0:
            loss = (1 - smoothing) * loss + smoothing * (lse - per_rank[..., 1].sum(0) / vocab)
        loss = torch.where(valid, loss, 0.0)
        ctx.save_for_backward(exp_shifted, m, lse, local_t, mine, valid)
        ctx.smoothing, ctx.vocab, ctx.dtype, ctx.consumed = smoothing, vocab, logits.dtype, False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.consumed:  # its buffer became the first backward's gradient
            raise RuntimeError("vocab_parallel_cross_entropy: backward through the same loss a "
                               "second time (retain_graph=True) is not supported; compute the "
                               "loss again")
        ctx.consumed = True
        exp_shifted, m, lse, local_t, mine, valid = ctx.saved_tensors
        e = ctx.smoothing
        # in place in the buffer saved by forward: softmax over the whole vocabulary
        # (exp(z - m) exp(m - lse)), minus the one-hot of the target where this rank owns it,
        # times the incoming gradient
        grad = exp_shifted.mul_(torch.sub(m, lse.unsqueeze(-1)).exp_())
        if e > 0:
            grad.sub_(e / ctx.vocab)
        grad.scatter_add_(-1, torch.where(mine, local_t, 0).unsqueeze(-1),
                          mine.unsqueeze(-1).to(grad.dtype) * -(1 - e))
        # where, not a product: with every token ignored, "mean" divides by 0 and grad_loss is inf
        grad.mul_(torch.where(valid, grad_loss, 0.0).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None, None, None


def _pick_targets(z, target, valid, sizes, rank):
    """This rank's logit of each target it owns (0 elsewhere), the targets as indices into its
    slice, and where it owns them."""
    start, v_local = sum(sizes[:rank]), sizes[rank]
    local_t = target - start
    mine = valid & (local_t >= 0) & (local_t < v_local)
    picked = z.gather(-1, torch.where(mine, local_t, 0).unsqueeze(-1)).squeeze(-1)
    return torch.where(mine, picked, 0.0), local_t, mine  # not picked * mine: -inf * 0 is NaN


def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor,
    target: torch.Tensor,
    group: ProcessGroup | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    vocab_size: int | None = None,
    reuse_logits: bool = False,
) -> torch.Tensor:
    """``F.cross_entropy`` over logits split on their last (vocabulary) dim across the group.

    logits_local: (..., V_i), this rank's ``tensor_split`` slice of the vocabulary
        (e.g. a ``ColumnParallelLinear`` LM head's output).
    target: (...) class indices in [0, V), or ``ignore_index``.
    reduction: "mean" (over non-ignored tokens, as torch), "sum" or "none".
    vocab_size: V, when the caller knows it (the GPT does): each rank's slice is then checked
        against its ``tensor_split`` size here, nothing is read back from the devices (no
        host sync on a GPU, no graph break under ``torch.compile``; targets are checked on the
        host for CPU tensors, else by a device-side assert), and forward makes one collective.
        None: the ranks send their slice sizes along with the statistics and check them, and
        the targets, on the host; then an all-reduce of the target logits follows.
    Loss and gradient equal ``F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), ...)``.
    """
    if target.shape != logits_local.shape[:-1]:
        raise ValueError(f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} does "
                         f"not match logits shape {tuple(logits_local.shape)} without its last dim")
    if target.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"vocab_parallel_cross_entropy: target must be integer, got {target.dtype}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1]")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction={reduction!r} must be 'mean', 'sum' or 'none'")
    n, v_local = tp_size(group), logits_local.shape[-1]
    vocab = v_local if n == 1 else vocab_size
    if vocab_size is not None and v_local != shard_sizes(vocab_size, n)[tp_rank(group)]:
        raise ValueError(f"vocab_parallel_cross_entropy: rank {tp_rank(group)} holds {v_local} "
                         f"logits, not its tensor_split shard of vocab_size={vocab_size} over "
                         f"{n} ranks {shard_sizes(vocab_size, n)}")
    if vocab is not None and not checks_on_host(target):
        assert_in_range(target, vocab, "vocab_parallel_cross_entropy: target", ignore_index)
    else:  # the vocabulary is checked in the collective's forward when it is not known yet
        sizes = [v_local] if n == 1 else vocab_size and shard_sizes(vocab_size, n)
        _check_targets_on_host(target, ignore_index, vocab, sizes)
    if n == 1:  # the whole vocabulary is here: torch's own fused kernel
        loss = F.cross_entropy(logits_local.float().flatten(0, -2), target.long().flatten(),
                               ignore_index=ignore_index, label_smoothing=label_smoothing,
                               reduction=reduction)
        return loss.view(target.shape) if reduction == "none" else loss
    loss = _VocabParallelCrossEntropy.apply(logits_local, target.long(), group, ignore_index,
                                            float(label_smoothing), vocab_size, reuse_logits)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()


def _check_targets_on_host(target, ignore_index, vocab, sizes) -> None:
    """No negative target other than ``ignore_index``; with ``vocab`` known, none >= vocab
    (sizes: the shards' sizes, for the message; None when not known yet)."""
    bad = (target < 0) & (target != ignore_index)
    if bad.any():
        raise ValueError(f"vocab_parallel_cross_entropy: negative target {int(target[bad][0])} "
                         f"(ignore_index is {ignore_index})")
    if vocab is None:
        return
    outside = (target >= vocab) & (target != ignore_index)
    if outside.any():
        raise ValueError(f"vocab_parallel_cross_entropy: target {int(target[outside].max())} "
                         f"is outside the vocabulary of {vocab} (sum of the shards {sizes})")
