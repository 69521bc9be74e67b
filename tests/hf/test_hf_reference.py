"""``train --hf`` against training written with transformers, PEFT and torch alone: full
fine-tuning at TP=2 takes the steps of the dense transformers model under torch's AdamW,
``LambdaLR`` and ``clip_grad_norm_`` (``torch_loop.py``); LoRA fine-tuning at TP=1 and 2 those of
PEFT's adapters on the dense model, started from the same factors (``--lora-init``): the same
learning rate, loss and gradient norm each step, and the same weights at the end."""

import peft
import pytest
import torch
import transformers
from hf_runs import TRAIN, resolve, train
from torch_loop import compare_rows, torch_loop

from tensorpar.checkpoint.format import find_checkpoint
from tensorpar.checkpoint.load import CheckpointReader
from tensorpar.data.packing import TokenBatches
from tensorpar.data.text import read_corpus

# 6 steps; clip 0.2: the first step's norm is above it (checked), so clipping acts
STEPS = 6
FLAGS = TRAIN | {"steps": STEPS, "save_every": STEPS, "grad_clip": 0.2}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# relative; measured at most 3.2e-7 (losses and gradient norms), and as ||a - b|| / ||b|| of a
# weight tensor after the 6 steps 1.0e-5 (full: AdamW's steps of elements with gradients near
# zero carry the rounding) and 4.0e-6 (the adapters: down_proj's A at TP 1, 2.3e-6 at TP 2, the
# others at most 1.1e-6; A's first gradients are near zero, as B starts at zero, and AdamW
# scales them up with their rounding; the products held (r, tokens) sum in another order than
# the 9.7e-7 measured before)
TOL, FULL_TOL, LORA_TOL = 1e-6, 3e-5, 1e-5


def _batches(path, **flags):
    cfg, recipe, _ = resolve(path, out="/nonexistent-unused", **FLAGS, **flags)
    data = read_corpus(cfg.data, recipe.tokenizer())
    return cfg, TokenBatches(data.tokens, cfg.seq_len, cfg.batch_size, cfg.seed, data.digest)


def _loss(model, x, y):
    logits = model(input_ids=x, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _same_weights(mine: dict, theirs: dict, tol: float):
    assert mine and sorted(mine) == sorted(theirs)
    for name, w in mine.items():
        err = ((w - theirs[name]).norm() / theirs[name].norm()).item()
        assert err <= tol, f"{name} differs by {err:.2e} (relative)"


def test_full_fine_tune_equals_a_transformers_torch_loop(ranks, models, tmp_path):
    """TP=2's steps and final weights (exported with ``export --hf-out``) are the dense
    transformers model's under torch's optimizer, scheduler and clipping."""
    rows = train(ranks, models["llama"], tmp_path / "run", 2, **FLAGS, data=str(models["data"]))
    cfg, batches = _batches(models["llama"], data=str(models["data"]))
    dense = transformers.AutoModelForCausalLM.from_pretrained(models["llama"]).train()
    want = torch_loop(cfg, dense, batches, _loss)
    assert want[0][2] > cfg.grad_clip, want
    compare_rows(rows, want, TOL, "full")
    from hf_runs import exported_logits

    exported_logits(tmp_path / "run", tmp_path / "hf", torch.zeros(1, 2, dtype=torch.long))
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    _same_weights(exported.state_dict(), dense.state_dict(), FULL_TOL)


def _peft_model(path):
    """PEFT's adapters (rank 4, alpha 8) on the dense model, B drawn non-zero too so that every
    factor moves from the first step."""
    dense = transformers.AutoModelForCausalLM.from_pretrained(path)
    model = peft.get_peft_model(dense, peft.LoraConfig(r=4, lora_alpha=8.0,
                                                       target_modules=LORA_TARGETS))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


@pytest.fixture(scope="module")
def peft_start(models, tmp_path_factory):
    """A PEFT folder of starting adapters, and PEFT's (lr, loss, norm) rows and final factors
    (by tensorpar's names) from training them with torch's loop."""
    folder = tmp_path_factory.mktemp("peft-start")
    model = _peft_model(models["llama"])
    model.save_pretrained(folder)
    cfg, batches = _batches(models["llama"], lora_init=str(folder), data=str(models["data"]))
    want = torch_loop(cfg, model.train(), batches, _loss)
    factors = {n.removeprefix("base_model.model.").replace(".default", ""): p.detach()
               for n, p in model.named_parameters() if "lora_" in n}
    return folder, want, factors


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_equals_peft_under_torchs_loop(ranks, models, peft_start, tmp_path, tp):
    """``--lora-init`` from PEFT's adapters: each step's loss and gradient norm, and the factors
    after 6 steps, are PEFT's under torch's optimizer, scheduler and clipping; the base is the
    file's (the checkpoint holds the adapters alone)."""
    folder, want, factors = peft_start
    rows = train(ranks, models["llama"], tmp_path, tp, **FLAGS, lora_init=str(folder),
                 data=str(models["data"]))
    assert want[0][2] > FLAGS["grad_clip"], want
    compare_rows(rows, want, TOL, f"LoRA TP={tp}")
    reader = CheckpointReader(find_checkpoint(tmp_path))
    mine = {n: reader.read(n) for n in reader.tensors if not n.startswith("optimizer.")}
    _same_weights(mine, factors, LORA_TOL)
