"""The tensor-parallel core, after Megatron-LM (Shoeybi et al. 2019) and sequence parallelism
(Korthikanti et al. 2022).

- ``mappings``: the conjugate collectives f / g and the sequence pairs, one autograd Function each,
  and the gradient sums for parameters several ranks hold;
  ``collectives``: the plain out-of-place collectives under them (uneven shards padded, trimmed)
- ``linear``: column- and row-parallel linear layers; ``embedding``: vocab-parallel embedding
- ``cross_entropy``: the vocab-parallel loss (logits never gathered)
- ``norm``, ``dropout``: LayerNorm/RMSNorm and dropout on sequence shards, the RNG streams
- ``fused``: the overlapped column op and the in-place row reduction (opt-in performance)
- ``context``: the sequence split over context-parallel ranks (load-balanced chunks) and its
  pairs: K/V all-gathered (reduce-scattered back), the sequence gathered back in order
- ``expert_dispatch``: tokens to their experts and back (the all-to-all pair), split and
  gathered over TP
- ``sharding``: ``tensor_split`` arithmetic, ``ShardSpec`` and the rule for EP ranks borrowed
  from the dp x tp ranks; ``stages``: the same over layers (pipeline stages) and
  ``check_pipeline``; ``ownership``: who owns which slice, the global gradient norm

Part of the core: imports ``tensorpar.runtime`` only.
"""
