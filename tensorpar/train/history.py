"""Runs written by earlier versions of tensorpar, in one place: what a resumed run of theirs
keeps, what it cannot repeat, and what is filled in.

- Random streams: checkpoints record the scheme their streams were seeded by (``RNG_SCHEME``,
  in the manifest's "rng"). Under "hashed" a step's dropout masks were drawn one after another
  from one generator per stream; "hashed-keys" seeds each mask on its own from (stream seed,
  key, site). A run resumed from an older scheme continues with the same batches when only its
  dropout differs, and says so; any other scheme gets other batches too, and says so.
- ``--lr-decay-steps``: runs saved before it existed decayed over their ``--steps``.
"""

from __future__ import annotations

from pathlib import Path

# how every random stream's seed is derived (runtime/seeds.py); recorded in the manifest
RNG_SCHEME = "hashed-keys"


def resume_notes(manifest: dict, ckpt: Path) -> list[str]:
    """What a run resumed from ``ckpt`` will not repeat of the original, in lines for the user."""
    scheme = manifest.get("rng", {}).get("scheme")
    if scheme == RNG_SCHEME:
        return []
    if scheme == "hashed":
        drops = manifest.get("model_kind") != "hf" and \
            manifest.get("config", {}).get("dropout", 0) > 0
        return [f"{ckpt} was written when the dropout masks of a step were drawn one after "
                "another from one generator; this version seeds each mask on its own, so the "
                "resumed run draws other dropout masks than the original would have (the same "
                "batches)"] if drops else []
    return [f"{ckpt} was written with random streams seeded by the {scheme!r} scheme, this "
            "version hashes them; the resumed run draws other batches and dropout masks than "
            "the original would have"]


def saved_settings(manifest: dict) -> dict:
    """The training settings a checkpoint's run was started with, as this version reads them."""
    saved = {k: v for k, v in manifest["train"].items() if k not in ("resume", "out")}
    saved["lr_decay_steps"] = saved.get("lr_decay_steps") or saved["steps"]
    return saved
