"""How ``tensorpar train`` picks and builds a Hugging Face run's recipe before any rank starts:
the kind by ``--hf`` or by the run resumed (``run.RECIPES``), the meta model built once for
every check (plan, layout, LoRA targets), and a recipe that reaches the ranks without it."""

import pickle

import pytest

pytest.importorskip("transformers")

from hf_runs import resolve  # noqa: E402

from tensorpar.train import hf_recipe  # noqa: E402
from tensorpar.train.resume import RunFlags  # noqa: E402
from tensorpar.train.run import RECIPES, run_kind  # noqa: E402


def test_the_meta_model_is_built_once(models, tmp_path, monkeypatch):
    """A LoRA run at --tp 2 with --sequence-parallel and named targets: the plan, the layout
    check and the targets' check read one meta model."""
    built = []
    real = hf_recipe._meta_model
    monkeypatch.setattr(hf_recipe, "_meta_model", lambda path: built.append(path) or real(path))
    cfg, recipe, _ = resolve(models["llama"], out=str(tmp_path / "run"), tp=2,
                             sequence_parallel=True, lora_rank=4, lora_targets="q_proj,v_proj")
    assert len(built) == 1, built
    assert (cfg.tp, cfg.lora_rank) == (2, 4)


def test_the_recipe_travels_without_its_meta_model(models, tmp_path):
    _, recipe, _ = resolve(models["llama"], out=str(tmp_path / "run"), tp=2)
    assert recipe.meta is not None
    theirs = pickle.loads(pickle.dumps(recipe))
    assert theirs.meta is None and theirs == recipe and recipe.meta is not None


def test_the_kind_of_run_is_one_lookup(models, tmp_path):
    """--hf: the HF recipe; a new run without it: the GPT's; --resume of a fine-tune before its
    first checkpoint (only its copy of the model's files): the HF recipe, without --hf."""
    out = tmp_path / "run"
    flags = {"out": str(out), "resume": True}
    assert set(RECIPES) == {"gpt", "hf"}
    assert run_kind(RunFlags({"out": str(out)}, {}, hf=str(models["llama"]))) == "hf"
    assert run_kind(RunFlags({"out": str(out)}, {})) == "gpt"
    assert run_kind(RunFlags(flags, {})) == "gpt"
    _, recipe, _ = resolve(models["llama"], out=str(out))
    out.mkdir()
    recipe.write_run_files(out)
    assert run_kind(RunFlags(flags, {})) == "hf"
