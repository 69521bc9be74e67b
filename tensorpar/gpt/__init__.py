"""tensorpar's GPT and its training: the model (``model``), data, AdamW, the trainer (its loop
knows models by a ``recipe``), the run's report, generation, and the model's description for the
planner (``spec``).

Imports the core, ``tensorpar.checkpoint``, ``tensorpar.plan`` and ``tensorpar.scale``; nothing
imports it but ``tensorpar.hf`` (whose trainer runs this loop), the benchmark and the CLI.
"""
