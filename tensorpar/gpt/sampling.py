"""The next token from vocab-split logits, never gathering them: greedy, Gumbel-max sampling,
top-k and top-p (nucleus).

Each rank holds the logits of its vocabulary slice [v0, v1) for B sequences. What crosses the
ranks per token (TP > 1)::

    pick (greedy, sampled)  one all-gather of each rank's best (score, id): B x 2 numbers per rank
    top-k                   one all-gather of each rank's k best scores; the k-th largest of all
                            of them is the threshold, and a token is kept when it reaches it
    top-p                   one all-reduce of the max and one of the sum of exp (the softmax
                            normalizer, as in the vocab-parallel cross-entropy), then 4 all-reduces
                            of B x 255 partial sums that pin down the threshold exactly: a search
                            over float32's ordered bit patterns, 8 bits a round

Sampling is the Gumbel-max trick: every rank draws the same noise for the whole vocabulary from
a seeded generator and adds its slice; tokens outside the kept set score -inf; the argmax of
logits/T + noise is then an exact sample from softmax(logits/T) renormalized over the kept set,
and the same token at every TP size.

The order is transformers': temperature, then top-k, then top-p on the distribution top-k left.
Ties: top-k keeps every token tied with the k-th (as transformers' ``TopKLogitsWarper``); top-p
keeps a token when the probability of the tokens strictly more likely is below p (the smallest
set of most likely tokens whose probabilities reach p; tied tokens stay or go together). With
temperature 0 (greedy) top-k and top-p change nothing: the most likely token is always kept.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tensorpar.runtime.groups import tp_size

_ROUND = 256  # top-p search: each round splits the interval left into this many parts


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError, naming the flag and the value, for settings that cannot sample."""
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"need --temperature {temperature} >= 0 and finite (0: greedy)")
    if isinstance(top_k, bool) or int(top_k) != top_k or top_k < 0:
        raise ValueError(f"--top-k {top_k} must be a whole number >= 0 (0: no limit)")
    if not 0 < top_p <= 1:
        raise ValueError(f"--top-p {top_p} must be in (0, 1] (1: no limit)")


def _all_gather_cat(t: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """(B, m) on each rank -> (B, n*m), rank order."""
    every = [torch.empty_like(t) for _ in range(tp_size(group))]
    dist.all_gather(every, t.contiguous(), group=group)
    return torch.cat(every, dim=-1)


def _all_reduce(t: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM):
    if tp_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def top_k_threshold(scores_BV_local: torch.Tensor, k: int,
                    group: ProcessGroup | None = None) -> torch.Tensor:
    """(B, 1): the k-th largest score of each row over the whole vocabulary (k <= vocab)."""
    k_local = min(k, scores_BV_local.shape[-1])
    best = scores_BV_local.topk(k_local, dim=-1).values  # (B, k_local), descending
    if tp_size(group) == 1:
        return best[:, k - 1:k]
    # pad to k so every rank sends the same shape; -inf never reaches the k-th place
    best = torch.nn.functional.pad(best, (0, k - k_local), value=-math.inf)
    return _all_gather_cat(best, group).topk(k, dim=-1).values[:, -1:]  # (B, n*k) -> (B, 1)


def _ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 keys with the order of the floats (-inf lowest; -0.0 taken as 0.0)."""
    bits = (x.float() + 0.0).view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negatives: larger magnitude, lower


def top_p_threshold(scores_BV_local: torch.Tensor, top_p: float,
                    group: ProcessGroup | None = None) -> torch.Tensor:
    """(B, 1) int64 keys (``_ordered_bits``): a token is kept when its key reaches the threshold.

    The threshold is the lowest score s whose "mass above", the probability of the tokens scoring
    more than s, is below p. Mass above is non-increasing in s, so it is found by splitting the
    interval of keys [lo, hi] (lo: mass above >= p, hi: < p) into 256 parts each round: every
    rank sums its own tokens' probabilities above each cut (a sort and a search), one all-reduce
    adds the ranks' sums, and the interval shrinks to one part. Four rounds cover 2^32 keys.
    """
    B = scores_BV_local.shape[0]
    top = _all_reduce(scores_BV_local.float().amax(-1, keepdim=True), group,
                      dist.ReduceOp.MAX)  # (B, 1)
    weights = (scores_BV_local.float() - top).double().exp()  # (B, V_local); -inf -> 0
    total = _all_reduce(weights.sum(-1, keepdim=True), group)  # (B, 1): the normalizer
    keys, order = _ordered_bits(scores_BV_local).sort(dim=-1)  # ascending
    suffix = weights.gather(-1, order).flip(-1).cumsum(-1).flip(-1)  # mass from index i up
    suffix = torch.cat([suffix, suffix.new_zeros(B, 1)], dim=-1)  # (B, V_local + 1)
    lo = torch.full((B, 1), -(2 ** 31) - 1, dtype=torch.int64, device=keys.device)
    hi = _ordered_bits(top)  # the most likely token: nothing above it, so kept
    parts = torch.arange(1, _ROUND, device=keys.device)  # (255,)
    while bool((hi - lo > 1).any()):  # the same on every rank: lo, hi come from reduced sums
        cuts = lo + (hi - lo) * parts // _ROUND  # (B, 255), inside [lo, hi)
        above = suffix.gather(-1, torch.searchsorted(keys, cuts, right=True))
        below_p = _all_reduce(above, group) < top_p * total  # (B, 255)
        hi = torch.where(below_p, cuts, hi).amin(-1, keepdim=True)
        lo = torch.where(below_p, lo, cuts).amax(-1, keepdim=True)
    return hi


def kept_tokens(scores_BV_local: torch.Tensor, vocab_size: int, top_k: int = 0,
                top_p: float = 1.0, group: ProcessGroup | None = None) -> torch.Tensor | None:
    """(B, V_local) bool: this rank's tokens that top-k, then top-p, keep from scores
    (logits / temperature); None when both keep everything."""
    keep = None
    scores = scores_BV_local.float()
    if 0 < top_k < vocab_size:
        keep = scores >= top_k_threshold(scores, int(top_k), group)
        scores = scores.masked_fill(~keep, -math.inf)
    if top_p < 1:
        keep_p = _ordered_bits(scores) >= top_p_threshold(scores, top_p, group)
        keep = keep_p if keep is None else keep & keep_p
    return keep


def pick_token(logits_BV_local: torch.Tensor, vocab_start: int, vocab_size: int,
               temperature: float, generator: torch.Generator | None,
               group: ProcessGroup | None = None, top_k: int = 0,
               top_p: float = 1.0) -> torch.Tensor:
    """The next token id (B,) from vocab-split logits: the argmax (temperature 0) or a sample of
    softmax(logits / temperature) over the tokens top-k and top-p keep."""
    scores = logits_BV_local.float()
    if temperature > 0:
        B, v_local = scores.shape
        scores = scores / temperature
        keep = kept_tokens(scores, vocab_size, top_k, top_p, group)
        noise = torch.empty(B, vocab_size, device=scores.device).exponential_(generator=generator)
        gumbel = -noise.log()[:, vocab_start:vocab_start + v_local]  # this rank's columns
        scores = scores + gumbel
        if keep is not None:
            scores = scores.masked_fill(~keep, -math.inf)
    best, idx = scores.max(dim=-1)  # (B,) each
    if tp_size(group) == 1:
        return idx
    # (score, global id) of every rank; float64 holds ids exactly
    mine = torch.stack([best.double(), (idx + vocab_start).double()], dim=-1)  # (B, 2)
    every = [torch.empty_like(mine) for _ in range(tp_size(group))]
    dist.all_gather(every, mine, group=group)
    every = torch.stack(every, dim=1)  # (B, n, 2)
    # the highest score wins; on a tie the lower rank, which holds the lower token id
    winner = every[..., 0].argmax(dim=1)  # first maximum
    return every[torch.arange(len(winner)), winner, 1].long()
