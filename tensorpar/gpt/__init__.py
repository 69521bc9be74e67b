"""tensorpar's GPT: the model (``model``), its byte tokenizer (``tokenizer``), generation
(``generate``, ``sampling``) and its description for the planner (``shape``).

Imports the core, ``ranks``, ``checkpoint`` and ``planner``; its trainer is ``tensorpar.train``.
"""
