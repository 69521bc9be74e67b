"""The Hugging Face bridge: plans (module-name patterns to styles), what each style does to a
module, ``parallelize`` for a dense model in hand, ``from_pretrained`` for a model directory,
and ``export``: a checkpoint written as a model folder that transformers loads (``tensorpar
export --hf-out``; ``export_finetuned`` writes a ``train --hf`` run back as its source model).

Imports the core, ``ranks``, ``checkpoint``, ``planner`` and ``dp`` (transformers lazily,
inside the functions that need it). Its trainer recipe is ``tensorpar/train/hf_recipe.py``.
"""
