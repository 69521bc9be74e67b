"""A local Hugging Face model directory as ``verify --hf PATH`` and ``generate --hf PATH`` take it:
checked before any rank starts, transformers' logging quieted, and ranks whose refusal of the
model (a ``ValueError`` on every rank) is the command's one line."""

from __future__ import annotations

from pathlib import Path

from tensorpar.ranks.local import RankError, run_ranks


def quiet_transformers():
    """transformers, its warnings and progress bars off (ImportError when it is missing)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def check_hf_dir(path: str) -> None:
    """ValueError unless ``path`` holds a model's config.json and transformers is installed."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ValueError(f"--hf {path}: not a Hugging Face model directory (no config.json)")
    try:
        quiet_transformers()
    except ImportError:
        raise ValueError("--hf needs transformers: pip install tensorpar[hf]") from None


def run_hf_ranks(fn, n: int, *args, run=run_ranks):
    """``run(fn, n, *args)``; ranks that all refused the model with a ValueError are one
    ValueError here."""
    try:
        return run(fn, n, *args)
    except RankError as e:  # the ranks refused the model (unsupported, ...): a bad request (2)
        if e.expected and all(f.kind == "ValueError" for f in e.failures):
            raise ValueError(e.failures[-1].message) from None
        raise  # a full disk, a bug, ...: cli.main tells them apart
