"""The ``tensorpar`` command line: ``main`` (the parser, global flags, errors and exit
statuses) and one module per command: ``train``, ``generate`` (``hf`` for ``--hf``), ``verify``,
``export``, ``plan``, ``bench``.

On top of every package; nothing imports it but ``python -m tensorpar``.
"""
