"""Tensor-parallel transformer blocks built from the core layers: attention split by heads (GQA
and MQA, with rotary positions and a KV cache split like the heads) and the MLP as column then
row; the dense reference they are checked against (``reference``) and ``tensorpar verify``.

Part of the core: imports ``tensorpar.runtime`` and ``tensorpar.parallel`` only.
"""
