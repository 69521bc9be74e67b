"""Planning and measurement: the step planned as one typed value (``step``: ``Step``, and the
``Budget`` the estimate returns), model shapes (``shapes``: ``ModelShape`` and presets), per-rank
memory (``memory``, ``activations``) and communication (``comm``) predicted before training, with
data parallelism over FSDP2 or DDP (``data_parallel``), one model's row at a TP size and whether
it fits (``tp_plan``), pipeline stages (``pipeline``, the schedule's replay in ``schedule``), the
search for a layout of ranks that fits (``search``), a training run's expected numbers
(``expected``), the measured peak (``meter``) and the tables (``report``). ``tensorpar plan`` is
``tensorpar/cli/plan.py``.

Imports the core only: it reasons about a ``ModelShape``, never a model class (the trainer
describes tensorpar's GPT in ``tensorpar/train/shape.py``).
"""
