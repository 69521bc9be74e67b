"""Sharded checkpoints that load at any TP size: one safetensors file per rank and a JSON manifest.

``format.py`` (names, constants, finding a run's checkpoints), ``save.py``, ``load.py`` (any TP
size: resharding), ``export.py`` (one dense file). Works for any model whose parameters carry a
``ShardSpec`` (``tp_shard``); imports the core packages only.
"""
