"""The fused, overlapped path of converted Llama-family blocks
(``tensorpar/hf/fused_blocks.py``) and sequence parallelism on their norms
(``tensorpar/hf/sequence.py``): loss, logits and every gradient equal the dense model's (fp32,
``TOL``), with the collectives of tensorpar's GPT. Without
SP the fused path runs in every test of ``test_hf.py`` (the default); here: SP at TP=1-4
(uneven heads and sequences at 3, KV heads shared between ranks at 3 and 4), and its refusals."""

import copy

import accelerate  # noqa: F401  (a dev dependency: missing, this file fails, not skips)
import pytest
import torch
import transformers
from hf_split import assert_split  # noqa: E402

from tensorpar.cli.compare import dense_shard  # noqa: E402
from tensorpar.hf.fused_blocks import InRegionColumn  # noqa: E402
from tensorpar.hf.parallelize import parallelize  # noqa: E402
from tensorpar.hf.pretrained import from_pretrained  # noqa: E402
from tensorpar.runtime.counting import CollectiveCounter  # noqa: E402
from tensorpar.runtime.groups import tp_size  # noqa: E402

from tp_check import assert_close  # noqa: E402

T = 10  # tokens: uneven over 3 (4, 3, 3) and 4 (3, 3, 2, 2)
# the largest relative error of each kind, ~10x the largest measured over the cases of
# test_sequence_parallel_matches_dense (2026-11-27, torch 2.13 CPU)
TOL = {"logits": 3e-6,  # measured 3.0e-7 (Llama at TP=2)
       "loss": 1e-6,  # measured 1.0e-7 (Qwen2 at TP=3): one fp32 ulp
       "grad": 1e-5,  # measured 9.1e-7 (Qwen2 at TP=3)
       "loss after a step": 1.5e-6}  # measured 1.4e-7 (Qwen2 at TP=3)


def _sp_body(path, how):
    """Loss, logits and every gradient shard of the SP model against the dense one, and one SGD
    step; the collectives of forward and backward."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    ids = torch.randint(1, 96, (2, T))
    dense = transformers.AutoModelForCausalLM.from_pretrained(path).train()
    model = from_pretrained(path, sequence_parallel=True).train() if how == "load" else \
        parallelize(transformers.AutoModelForCausalLM.from_pretrained(path),
                    sequence_parallel=True).train()
    model.gather_logits = True  # whole logits with labels too (the split loss: test_labels_loss)
    assert_split(model, dense)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, InRegionColumn) and attn.o_proj.sequence_parallel
    ref = dense(ids, labels=ids)
    with CollectiveCounter() as fwd:
        out = model(ids, labels=ids)
    assert_close("logits", out.logits, ref.logits, TOL["logits"])
    assert_close("loss", out.loss, ref.loss, TOL["loss"])
    ref.loss.backward()
    with CollectiveCounter() as bwd:
        out.loss.backward()
    dense_params = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        assert_close(f"grad {name}", p.grad, dense_shard(dense_params[name].grad, p.tp_shard),
                     TOL["grad"])
    for m in (dense, model):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    after, ref_after = model(ids, labels=ids).loss, dense(ids, labels=ids).loss
    assert_close("loss after a step", after, ref_after, TOL["loss after a step"])
    if tp_size() > 1:  # one token (a generation step) over several ranks: one clear error
        with pytest.raises(ValueError, match="1 token.* cannot be split over .* without"):
            model(ids[:, :1])
    return dict(fwd.counts), dict(bwd.counts), tp_size()


@pytest.mark.parametrize(("family", "n", "how"), [
    ("llama", 1, "load"), ("llama", 2, "load"), ("qwen2-tied", 3, "convert"),
    ("llama", 4, "load")])
def test_sequence_parallel_matches_dense(ranks, hf_dirs, family, n, how):
    """Llama (GQA) at TP=1, 2 and 4 (2 KV heads over 4 ranks: shared), Qwen2 at 3 (4 heads dealt
    2, 1, 1, biases, head tied to the embedding; 10 tokens dealt 4, 3, 3), both loaded from
    safetensors and converted in place. Collectives per step, L=2 layers: forward, the embedding's
    all-reduce, per block 2 all-gathers and 2 reduce-scatters, the head's all-gathers (sequence,
    then vocabulary); backward, per block 4 all-gathers (2 conjugates of the reduce-scatters, 2
    shards gathered again) and 2 reduce-scatters, one all-reduce per norm (2L + 1), one for the
    shared K/V of each block, and the head's and the first layer's all-gathers."""
    results = ranks(n).run(_sp_body, str(hf_dirs / family), how)
    if n == 1:
        return
    L = 2
    shared_kv = L if (family, n) != ("llama", 2) else 0
    fwd, bwd, _ = results[0]
    assert fwd == {"all_reduce": 1, "all_gather": 2 * L + 2, "reduce_scatter": 2 * L}, fwd
    assert bwd == {"all_gather": 4 * L + 2, "reduce_scatter": 2 * L + 1,
                   "all_reduce": 2 * L + 1 + shared_kv}, bwd


def test_sequence_parallel_refused(hf_configs):
    """What SP cannot run is refused up front, naming why: another family (GPT-2 adds its
    position table to the embedding output), a plan leaving a layer's MLP whole, dropout. (A
    forward with fewer tokens than ranks, as generation's, is refused in ``_sp_body``.)"""
    gpt2 = transformers.AutoModelForCausalLM.from_config(hf_configs["gpt2"])
    with pytest.raises(ValueError, match="Llama family .* not model_type='gpt2'"):
        parallelize(gpt2, sequence_parallel=True)
    llama = transformers.AutoModelForCausalLM.from_config(hf_configs["llama"])
    plan = {"model.layers.*.self_attn": "attention", "lm_head": "column"}
    with pytest.raises(ValueError, match="model.layers.0.mlp must have the style 'mlp'"):
        parallelize(llama, plan, sequence_parallel=True)
    cfg = hf_configs["llama"]
    cfg.attention_dropout = 0.1
    dropout = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match="has dropout"):
        parallelize(dropout, sequence_parallel=True)


def test_projection_called_on_another_input(hf_configs):
    """A block's projection called on a tensor other than its block's input (here from outside
    the block, or on a flattened (N, D) input through the block) computes its own product: the
    dense layer's. Under SP that is refused: the block's forward holds no values to compute on."""
    torch.manual_seed(0)
    dense = transformers.AutoModelForCausalLM.from_config(hf_configs["llama"])
    mlp = copy.deepcopy(dense.model.layers[0].mlp)
    model = parallelize(copy.deepcopy(dense))
    x = torch.randn(2, 3, 64)
    tp_mlp = model.model.layers[0].mlp
    # measured 0 (the same matmuls, one rank); the floor: a few fp32 ulps
    assert_close("gate_proj", tp_mlp.gate_proj(x), mlp.gate_proj(x), 1e-6)
    assert_close("mlp on (N, D)", tp_mlp(x.flatten(0, 1)), mlp(x.flatten(0, 1)), 1e-6)
    sp = parallelize(dense, sequence_parallel=True)
    with pytest.raises(RuntimeError, match="must be called on its block's input"):
        sp.model.layers[0].mlp.gate_proj(x)
