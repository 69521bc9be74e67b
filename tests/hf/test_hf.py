"""Hugging Face models converted with ``parallelize`` or loaded with ``from_pretrained``: logits,
loss, greedy generation and one fine-tuning step equal the dense model's at TP=1-4, for GPT-2,
Llama (also MQA: fewer KV heads than ranks), Qwen2 (GQA, biases, tied embeddings) and Qwen3.
Equal logits do not show a split (a layer left whole computes them too), so each family also
checks that every layer is split, each rank holding exactly its share, and counts the
collectives that split implies (``hf_split.py``). The models: ``conftest.py``."""


import accelerate  # noqa: F401  (a dev dependency: missing, this file fails, not skips)
import pytest
import torch
import torch.distributed as dist
import transformers
from hf_split import assert_split, planned_collectives  # noqa: E402

from tensorpar.cli.compare import dense_shard, max_rel_error  # noqa: E402
from tensorpar.hf.parallelize import parallelize  # noqa: E402
from tensorpar.hf.plans import LLAMA_PLAN, plan_for, translate_hf_plan  # noqa: E402
from tensorpar.hf.pretrained import from_pretrained  # noqa: E402
from tensorpar.hf.styles import is_conv1d  # noqa: E402
from tensorpar.runtime.counting import CollectiveCounter  # noqa: E402

from tests_common import tensorpar_here  # noqa: E402

# the largest relative error (max |a - b| / max |b|) of each kind, ~10x the largest measured
# over every case of this file (2026-11-27, torch 2.13 CPU): the split only reorders fp32 sums
TOL = {"logits": 4e-6,  # measured 3.9e-7 (Qwen3 at TP=2)
       "loss": 1e-6,  # measured 1.0e-7 (Qwen3 at TP=2): one fp32 ulp of the loss
       "grad": 1e-5,  # measured 8.9e-7 (Qwen2 at TP=4)
       "updated": 1e-5}  # measured 8.9e-7: the gradients' error, after an SGD step
# a dense gradient below this is exactly zero but for rounding (a key bias without rotary
# shifts a whole softmax row): both sides are noise, held to it absolutely; measured 1.4e-10
ZERO_GRAD = 1.5e-9

OPT_PLAN = {  # a plan written by hand: OPT declares none
    "model.decoder.embed_tokens": "vocab",
    "model.decoder.layers.*.self_attn": "attention",
    "model.decoder.layers.*.fc1": "column",
    "model.decoder.layers.*.fc2": "row",
    "lm_head": "column_gather",
}


def _dense(path):
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _parity_body(path, how, plan=None):
    """Both models: the split (``hf_split.assert_split``), logits and loss, greedy tokens,
    gradients, one SGD step; the collectives counted and those the split implies; the largest
    error of each kind (``TOL``)."""
    torch.manual_seed(0)
    ids = torch.randint(1, 96, (2, 10))
    dense = _dense(path)
    model = from_pretrained(path, plan=plan) if how == "load" else \
        parallelize(_dense(path), plan)
    model.gather_logits = True  # whole logits with labels too (the split loss: test_labels_loss)
    held = assert_split(model, dense)
    errors = dict.fromkeys([*TOL, "zero grad"], 0.0)

    def close(kind, name, actual, expected):
        err = max_rel_error(actual, expected)
        errors[kind] = max(errors[kind], err)
        assert err <= TOL[kind], f"{name}: max relative error {err:.3e} > {TOL[kind]:.0e}"

    ref = dense(ids, labels=ids)
    with CollectiveCounter() as fwd:
        out = model(ids, labels=ids)
    close("logits", "logits", out.logits, ref.logits)
    close("loss", "loss", out.loss, ref.loss)
    greedy = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(ids, **greedy), dense.generate(ids, **greedy))
    # one fine-tuning step: the same gradients and the same updated weights, shard by shard
    for m in (dense, model):
        m.train()
        loss = m(ids, labels=ids).loss
        with CollectiveCounter() as bwd:
            loss.backward()
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    dense_params = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        ref_p, ref_g = dense_params[name], dense_params[name].grad
        if name.endswith("weight") and is_conv1d(dense.get_submodule(name.rpartition(".")[0])):
            ref_p, ref_g = ref_p.t(), ref_g.t()  # GPT-2's Conv1D is (in, out); shards are (out, in)
        if ref_g.abs().max() < ZERO_GRAD:  # OPT's key bias: exactly zero, noise only
            errors["zero grad"] = max(errors["zero grad"], p.grad.abs().max().item(),
                                      ref_g.abs().max().item())
            assert p.grad.abs().max() < ZERO_GRAD, name
            continue
        close("grad", f"grad {name}", p.grad, dense_shard(ref_g, p.tp_shard))
        close("updated", f"updated {name}", p, dense_shard(ref_p, p.tp_shard))
    return {"forward": dict(fwd.counts), "backward": dict(bwd.counts), "errors": errors,
            "planned": planned_collectives(dense, dist_size()), **held}


def _assert_split_and_sent(results):
    """Each rank holds its share of every layer (checked on the rank: less than the dense
    model once split) and issued exactly the collectives that split implies, forward and
    backward: none at TP=1."""
    for rank, r in enumerate(results):
        assert r["held"] < r["dense"] or len(results) == 1, r
        assert (r["forward"], r["backward"]) == r["planned"], (
            f"rank {rank}: forward {r['forward']}, backward {r['backward']}; the split implies "
            f"{r['planned']} (errors {r['errors']})")


@pytest.mark.parametrize("family", ["gpt2", "llama", "llama-mqa", "qwen2-tied", "qwen3"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_from_pretrained_matches_dense(ranks, hf_dirs, family, n):
    """Logits and loss equal, identical greedy tokens, and after one SGD step every weight shard
    equal to its slice of the dense model's; every layer split, each rank holding its share; the
    blocks run the fused ops (``hf/fused_blocks.py``), with the collectives of tensorpar's GPT
    (``planned_collectives``: L=2 layers; forward 1 + 2L all-reduces and the head's all-gather;
    backward 2L + 1 all-reduces, L more where KV heads are shared (Llama at 4 ranks, the MQA at 2
    and 4), 2L more for Qwen3's q/k norms)."""
    results = ranks(n).run(_parity_body, str(hf_dirs / family), "load")
    _assert_split_and_sent(results)


@pytest.mark.parametrize("family", ["gpt2", "qwen2-tied"])
def test_parallelize_in_place_uneven(ranks, hf_dirs, family):
    """parallelize() on a loaded dense model, 3 ranks: 4 heads dealt 2, 1, 1 (KV heads shared),
    vocab 96 and hidden 80 uneven; every layer split, the shares uneven."""
    _assert_split_and_sent(ranks(3).run(_parity_body, str(hf_dirs / family), "convert"))


@pytest.mark.parametrize("family", ["gemma", "gpt_neox", "opt"])
def test_families_without_builtin_plan(ranks, hf_dirs, family):
    """Gemma and GPT-NeoX through their own base_model_tp_plan (Gemma's scaled embedding
    subclass, GPT-NeoX's fused per-head QKV and renamed checkpoint keys), OPT through a plan
    written by hand: all exact at TP=2, every layer split, with the collectives of the others
    (GPT-NeoX's per-head q|k|v is one column layer of its own: still one input gradient)."""
    plan = OPT_PLAN if family == "opt" else None
    _assert_split_and_sent(ranks(2).run(_parity_body, str(hf_dirs / family), "load", plan))


def _different_weights_body(path):
    torch.manual_seed(dist_rank())  # forgot to seed alike
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(path))
    with pytest.raises(ValueError, match="the ranks hold different dense weights"):
        parallelize(model)


def dist_rank():
    return dist.get_rank()


def dist_size():
    return dist.get_world_size()


def test_parallelize_refuses_different_weights(ranks, hf_dirs):
    """Ranks whose dense models differ (a random init without a shared seed) are refused on
    every rank, instead of silently mixing shards of different models."""
    ranks(2).run(_different_weights_body, str(hf_dirs / "llama"))


def test_unsupported_layouts_refused(hf_configs):
    """A plan that would silently give wrong results is refused: a tied head without its
    embedding, and a c_attn that is not GPT-2's q|k|v packing (GPT-BigCode's multi-query)."""
    model = transformers.AutoModelForCausalLM.from_config(hf_configs["qwen2-tied"])
    with pytest.raises(ValueError, match="lm_head shares its weight with model.embed_tokens"):
        parallelize(model, {"model.layers.*.mlp": "mlp", "lm_head": "column_gather"})
    bigcode = transformers.AutoModelForCausalLM.from_config(transformers.GPTBigCodeConfig(
        vocab_size=96, n_embd=48, n_layer=1, n_head=6))
    with pytest.raises(ValueError, match="is not GPT-2's Conv1D packing q|k|v"):
        parallelize(bigcode, {"transformer.h.*.attn": "attention"})


def test_plans():
    """The built-in Llama-family plan is what transformers' own base_model_tp_plan translates to
    (Qwen3's q/k norms stay replicated)."""
    for cls in (transformers.LlamaConfig, transformers.Qwen2Config, transformers.Qwen3Config):
        assert translate_hf_plan(cls.base_model_tp_plan, "model") == {
            k: v for k, v in LLAMA_PLAN.items() if k.startswith("model.layers")}


def test_no_plan_is_a_clear_error():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"no tensor-parallel plan for Sequential(.|\n)*0\n  2"
                                         r"(.|\n)*Pass plan="):
        plan_for(model)
    with pytest.raises(ValueError, match="unknown style 'colwise'"):
        parallelize(model, {"0": "colwise"})
    with pytest.raises(ValueError, match="'layers.*.mlp' matches no module"):
        parallelize(model, {"layers.*.mlp": "mlp"})


def test_cli_refusals(hf_dirs):
    """Clear errors without a tokenizer or a config (the runs are below, under torchrun; ``generate
    --hf`` of a Llama with a character tokenizer at TP=2, prompt and continuation, is the README's
    line, run by tests/test_readme.py)."""
    gen = tensorpar_here("generate", "--hf", hf_dirs / "gpt2", "--tp", 2, "--prompt", "Hi")
    assert gen.returncode == 2 and "has no tokenizer: pass --prompt-ids" in gen.stderr
    bad = tensorpar_here("verify", "--hf", hf_dirs, "--tp", 2)
    assert bad.returncode == 2 and "not a Hugging Face model directory" in bad.stderr


def test_cli_generate_under_torchrun(hf_dirs, tmp_path):
    """``generate --hf`` as torchrun's 2 ranks: each rank loads its shard of the model from the
    folder and exits alike, and rank 0 alone prints the token ids. (``verify --hf`` takes the
    same path, ``run_ranks`` and rank 0's ``say``, which ``tests/test_cli.py`` runs under
    torchrun for ``verify``.) The ranks are forked from the session's fork server with
    torchrun's environment (``docs_torchrun.torchrun_here``): each new interpreter of a real
    torchrun imports torch and transformers again; torchrun itself is tested with training
    (tests/train/test_torchrun_train.py)."""
    from docs_torchrun import torchrun_here

    from tests_common import cli_env

    out = torchrun_here(2, ["-m", "tensorpar", "generate", "--hf", str(hf_dirs / "gpt2"), "--tp",
                            "2", "--prompt-ids", "5,6,7", "--max-new-tokens", "4"], tmp_path,
                        cli_env())
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("5 6 7 ") == 1 and out.stdout.startswith("5 6 7 "), out.stdout
