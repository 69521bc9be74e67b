"""tensorpar's GPT and its training: the model (``model``), data, AdamW, the trainer, the run's
report, generation, and the model's description for the planner (``spec``).

Imports the core, ``tensorpar.checkpoint`` and ``tensorpar.plan``; nothing imports it but the
benchmark and the CLI.
"""
