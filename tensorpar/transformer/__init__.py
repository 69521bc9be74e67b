"""Tensor-parallel transformer blocks built from the core layers: attention split by heads (GQA
and MQA, with rotary positions and a KV cache split like the heads), the MLP as column then row,
the Mixture of Experts with its routed experts split across expert-parallel ranks (``moe``),
context-parallel attention's mask and K/V exchange (``context_parallel``) and its mask-free
causal path (``cp_causal``), and
the dense references they are checked against (``reference``).

Part of the core: imports ``tensorpar.runtime`` and ``tensorpar.parallel`` only.
"""
