"""Planning and measurement: model shapes (``shapes``: ``ModelShape`` and presets), per-rank
memory (``memory``, ``activations``) and communication (``comm``) predicted before training, with
data parallelism over FSDP2 or DDP (``data_parallel``), a layout's row and whether it fits
(``layouts``), the measured peak (``meter``) and the tables (``report``). ``tensorpar plan`` is
``tensorpar/cli/plan.py``.

Imports the core only: it reasons about a ``ModelShape``, never a model class (the trainer
describes tensorpar's GPT in ``tensorpar/train/shape.py``).
"""
