"""Planning and measurement: model shapes (``zoo``), per-rank memory (``memory``) and
communication (``comm``) predicted before training, with data parallelism over FSDP2 or DDP
(``data_parallel``), the measured peak (``meter``), and ``tensorpar plan`` (``cli``).

Imports the core only: it reasons about a ``ModelSpec``, never a model class (tensorpar's GPT
describes itself in ``tensorpar/gpt/spec.py``). ``cli`` is a command-line module and sits on top.
"""
