"""The trainer, above every model: how to train (``config``: ``TrainConfig``, the flags), the
run's settings (``resume``: the flags merged with the run being resumed, checked before any
rank), the run's start (``run``: the recipe of its kind, the ranks started, how it ended), the
loop (``loop``: one rank's steps, read top to bottom) and what it measures and writes around the
loop (``measure``, ``report``), AdamW (``optim``), how the step's math runs (``compute``:
``torch.compile``, TF32), older runs (``history``), and the recipes that tell it a model:
tensorpar's GPT (``gpt_recipe``; ``shape`` describes it to the planner) and a Hugging Face
causal LM (``hf_recipe``).

Imports every package below the CLI and the benchmark.
"""
