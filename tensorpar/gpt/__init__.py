"""tensorpar's GPT: the model (``model``), its pipeline stages (``stages``), generation
(``generate``, ``sampling``) and its description for the planner (``shape``); its tokenizers are
``tensorpar.data.tokenizer``.

Imports the core, ``data``, ``checkpoint`` and ``planner`` (the CLI starts generation's ranks);
its trainer is ``tensorpar.train``.
"""
