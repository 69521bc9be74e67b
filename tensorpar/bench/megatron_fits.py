"""What megatron-core's GPT can be asked to split, decided without importing megatron: the
benchmark's parent asks before it spawns the contender's ranks (``contenders.py``), and each rank
again before its first collective (``megatron_core.py``)."""

from __future__ import annotations


def check_megatron_fits(cfg, tp: int, sequence_parallel: bool = False) -> None:
    """Raise ValueError, naming the numbers, for a model megatron-core cannot split over ``tp``:
    it splits heads, KV heads, the hidden width and the vocabulary evenly, without padding."""
    if sequence_parallel:
        raise ValueError("megatron-core without Apex or Transformer Engine has no sequence "
                         "parallel norm (its WrappedTorchNorm asserts not sequence_parallel)")
    if cfg.dropout:
        raise ValueError(f"--dropout {cfg.dropout}: the CPU run replaces megatron's CUDA RNG "
                         "tracker with its no-op one, exact only without dropout")
    if cfg.tie_embeddings:
        raise ValueError("the megatron contender is built untied (lm_head separate from embed)")
    for flag, size in (("--n-head", cfg.n_head), ("--n-kv-head", cfg.n_kv_head),
                       ("--hidden-dim", cfg.hidden_dim), ("--vocab-size", cfg.vocab_size)):
        if size % tp:
            raise ValueError(f"megatron-core splits evenly, without padding: {flag} {size} does "
                             f"not divide by --tp {tp}")
