"""A GPT with MoE blocks (6 experts, top-2, 2 layers) trained at (tp 2, dp 2, ep 4) and stopped
after step 3's checkpoint resumes at (tp 1, ep 1), at (tp 4, ep 4) and under context parallelism
at (cp 2, ep 2) equal to the uninterrupted run (weights and AdamW moments resharded, experts
included); its checkpoint holds every expert
once; its export (``export --hf-out``) is a MixtralForCausalLM that transformers loads with no
missing or unexpected key, whose greedy text is ``tensorpar generate``'s on the run.

One run of 4 steps serves every test; the resumes take one step each."""

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tensorpar.checkpoint.load import CheckpointReader
from tensorpar.gpt.model import GPTConfig
from tensorpar.hf.export import export_hf
from tensorpar.train.config import TrainConfig
from tensorpar.train.loop import train_rank

from tests_common import tensorpar_here

MODEL = {"n_layer": 2, "dim": 16, "n_head": 4, "n_kv_head": 2, "hidden_dim": 16,
         "moe_experts": 6, "moe_top_k": 2}
STEPS, STOP = 4, 3
# loss and gradient norm, relative: ~10x the largest difference measured, 1.1e-7 (the gradient
# norm at step 4, resumed at tp 4, ep 4; torch 2.13 CPU)
TOL = 2e-6
PROMPTS = ["The with statement", "def main():"]


def _train(out, tp, dp, ep, resume_from=None, cp=1):
    cfg = TrainConfig(tp=tp, dp=dp, ep=ep, cp=cp, dp_mode="fsdp", steps=STEPS, batch_size=4,
                      seq_len=16, warmup_steps=2, out=out, save_every=STOP, seed=1)
    return train_rank(cfg, GPTConfig(**MODEL), resume_from).get("rows")


@pytest.fixture(scope="module")
def run(ranks, tmp_path_factory):
    """(run directory, metrics rows) of the uninterrupted run at (tp 2, dp 2, ep 4)."""
    out = tmp_path_factory.mktemp("moe") / "full"
    return out, ranks(4).run(_train, str(out), 2, 2, 4)[0]


@pytest.mark.parametrize("tp,ep,cp", [(1, 1, 1), (4, 4, 1), (1, 2, 2)])
def test_resume_at_another_tp_and_ep(ranks, run, tmp_path, tp, ep, cp):
    """Stopped after step 3 and resumed at another (tp, ep), or with the sequence split over 2
    CP ranks: every step's loss and gradient norm equal the uninterrupted run's."""
    full, rows = run
    out = tmp_path / "resumed"
    shutil.copytree(full, out)
    shutil.rmtree(out / f"step-{STEPS:08d}")
    resumed = ranks(tp * cp).run(_train, str(out), tp, 1, ep, str(out / f"step-{STOP:08d}"),
                                 cp)[0]
    assert [r["step"] for r in resumed] == [r["step"] for r in rows] == list(range(1, 5))
    for mine, theirs in zip(resumed, rows, strict=True):
        for key in ("loss", "grad_norm"):
            err = abs(mine[key] - theirs[key]) / abs(theirs[key])
            assert err <= TOL, (tp, ep, cp, mine["step"], key, mine[key], theirs[key])


def test_checkpoint_holds_every_expert_once(run):
    """The four ranks' files (every data rank writes the experts it holds) hold each element of
    every weight and AdamW moment once: as many as the dense model's."""
    ckpt = run[0] / f"step-{STOP:08d}"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert (manifest["version"], manifest["tp_size"], manifest["dp_size"]) == (4, 2, 2)
    stored: dict[str, int] = {}
    for f in sorted(ckpt.glob("rank*.safetensors")):
        for key, t in load_file(f).items():
            stored[key] = stored.get(key, 0) + t.numel()
    want = {key: torch.Size(e["shape"]).numel() for key, e in manifest["tensors"].items()}
    assert stored == want
    assert manifest["tensors"]["blocks.0.mlp.experts.gate_up_proj"]["pieces"] == [
        {"rank": r, "start": a, "stop": b} for r, (a, b) in enumerate([(0, 2), (2, 4), (4, 5),
                                                                       (5, 6)])]


def test_export_is_a_mixtral_whose_greedy_text_is_generates(run, tmp_path):
    """``export --hf-out`` writes a MixtralForCausalLM (transformers loads it with no missing,
    unexpected or mismatched key) whose greedy text equals ``tensorpar generate --temperature
    0`` on the run, at TP 2 (the experts split over the TP ranks)."""
    folder = export_hf(run[0], tmp_path / "hf")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder,
                                                                    output_loading_info=True)
    assert type(model).__name__ == "MixtralForCausalLM"
    assert all(not v for v in info.values()), info
    config, gpt = model.config, GPTConfig(**CheckpointReader(run[0]).manifest["config"])
    assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == \
        (gpt.moe_experts, gpt.moe_top_k, gpt.hidden_dim)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    texts = []
    for prompt in PROMPTS:
        with torch.no_grad():
            ids = model.eval().generate(**tok(prompt, return_tensors="pt"), do_sample=False,
                                        max_new_tokens=12)
        texts.append(tok.decode(ids[0]))
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    out = tensorpar_here("generate", "--ckpt", run[0], "--tp", 2, "--temperature", 0,
                         "--max-new-tokens", 12, *prompts)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{texts[0]}\n--- 2\n{texts[1]}\n"
