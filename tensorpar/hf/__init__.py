"""The Hugging Face bridge: plans (module-name patterns to styles), what each style does to a
module, ``parallelize`` for a dense model in hand, ``from_pretrained`` for a model directory,
``tensorpar verify|generate --hf`` (``cli``), and ``export``: a checkpoint written as a model
folder that transformers loads (``tensorpar export --hf-out``).

``train`` is the recipe of ``tensorpar train --hf`` (fine-tuning in the GPT's training loop) and
``export_original`` writes such a run back as its source model.

Imports the core, ``checkpoint``, ``plan``, ``scale`` and, for the trainer, ``gpt``
(transformers lazily, inside the functions that need it). ``cli`` is a command-line module and
sits on top.
"""
