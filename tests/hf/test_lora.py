"""LoRA on converted Hugging Face models (``parallel/lora.py``, ``hf/lora.py``): at every TP size
the loss and every adapter's gradient equal PEFT's on the dense model with the same factors, the
base gets no gradient, and LoRA makes no collective beyond the base model's: its products ride
the base's (counted at TP=2)."""

import pytest
import torch

from tensorpar.hf.lora import add_lora
from tensorpar.hf.pretrained import from_pretrained
from tensorpar.parallel.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.parallel.lora import lora_parameters
from tensorpar.runtime.groups import tp_rank

RANK, ALPHA = 4, 8.0
TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
           "gpt2": ["c_attn", "c_proj", "c_fc"], "llama-mqa": None}


def _factors(model_dir, family):
    """Dense random factors (B too, so that every gradient is non-zero) for each target, by the
    names the converted model gives them."""
    import transformers

    dense = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(3)
    out = {}
    targets = TARGETS[family] or TARGETS["llama"]
    for name, m in dense.named_modules():
        in_block = ".layers." in name or ".h." in name
        if in_block and name.rsplit(".", 1)[-1] in targets:
            w = m.weight
            in_f, out_f = (w.shape[0], w.shape[1]) if family == "gpt2" else (w.shape[1], w.shape[0])
            out[f"{name}.lora_A.weight"] = torch.randn(RANK, in_f, generator=gen) * 0.1
            out[f"{name}.lora_B.weight"] = torch.randn(out_f, RANK, generator=gen) * 0.1
    return out


def _tp_loss_and_grads(model_dir, factors, ids, targets_, group=None, dropout=0.0,
                       sequence_parallel=False):
    model = from_pretrained(model_dir, group, sequence_parallel=sequence_parallel).train()
    add_lora(model, RANK, ALPHA, targets_, init=factors, dropout=dropout)
    logits = model(input_ids=ids[:, :-1], use_cache=False).logits
    vocab = model.config.vocab_size
    if logits.shape[-1] == vocab:  # the head gathered them
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    else:
        loss = vocab_parallel_cross_entropy(logits, ids[:, 1:], group=group, vocab_size=vocab)
    loss.backward()
    frozen_grads = [n for n, p in model.named_parameters() if p.grad is not None
                    and not n.endswith(("lora_A.weight", "lora_B.weight"))]
    grads = {n: (p.grad.clone(), p.tp_shard) for n, p in lora_parameters(model)}
    held = sum(p.numel() for _, p in lora_parameters(model))
    return loss.item(), grads, frozen_grads, tp_rank(group), held


def _dense(grads_by_rank, name):
    """A factor's dense gradient from the ranks' pieces (each at its place)."""
    pieces = [g[name] for g in grads_by_rank]
    g0, spec = pieces[0]
    if spec.dim is None:
        return g0
    shape = list(g0.shape)
    shape[spec.dim] = spec.full_size
    out = torch.zeros(shape)
    for g, s in pieces:
        for (a, b), part in zip(s.ranges(), g.split(s.stop - s.start, dim=s.dim), strict=True):
            out.narrow(s.dim, a, b - a).copy_(part)
    return out


class _SameMasks(torch.nn.Module):
    """PEFT's ``lora_dropout`` drawing tensorpar's dense mask of one adapter (its site)."""

    def __init__(self, p, key, site):
        super().__init__()
        self.p, self.key, self.site = p, key, site

    def forward(self, x):
        from tensorpar.parallel.dropout import dropout_mask

        mask = dropout_mask(list(x.shape), self.p, self.key, self.site, x.device)
        return x.masked_fill(mask, 0.0) * (1.0 / (1.0 - self.p))


def _peft_reference(path, family, factors, ids, targets, dropout=0.0):
    """PEFT's loss and factor gradients on the dense model (with ``dropout``: tensorpar's masks
    of the first forward, each adapter's by its place in the sorted names)."""
    import peft
    import transformers

    from tensorpar.parallel.lora import LoRADropout

    dense = transformers.AutoModelForCausalLM.from_pretrained(path)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets or TARGETS["llama"],
                             lora_dropout=dropout, fan_in_fan_out=family == "gpt2")
    model = peft.get_peft_model(dense, config)
    state = {f"base_model.model.{k}": v for k, v in factors.items()}
    missing = peft.set_peft_model_state_dict(model, state).unexpected_keys
    assert not missing, missing
    if dropout:
        stream = LoRADropout(dropout, 0)
        stream.next_forward()
        names = sorted(n.removesuffix(".lora_A.weight") for n in factors if "lora_A" in n)
        for site, name in enumerate(names):
            layer = model.get_submodule(f"base_model.model.{name}")
            layer.lora_dropout["default"] = _SameMasks(dropout, stream.key, site)
    model.train()
    logits = model(input_ids=ids[:, :-1]).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    want.backward()
    ref = {n.removeprefix("base_model.model.").replace(".default", ""): p.grad
           for n, p in model.named_parameters() if "lora_" in n}
    return want, ref, dense


# (n, family); the MQA Llama's 4 heads over 3 ranks left out: the plain Llama covers uneven heads
@pytest.mark.parametrize("n,family", [(n, f) for n in (1, 2, 3) for f in TARGETS
                                      if (n, f) != (3, "llama-mqa")])
def test_lora_matches_peft_at_every_tp_size(ranks, hf_dirs, family, n):
    """Loss and every factor's gradient equal PEFT's dense model's (relative 1e-5); no base
    parameter has a gradient."""
    path = hf_dirs / family
    factors = _factors(path, family)
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    targets = TARGETS[family]
    results = ranks(n).run(_tp_loss_and_grads, path, factors, ids, targets)
    want, ref, dense = _peft_reference(path, family, factors, ids, targets)
    by_rank = [r[1] for r in results]
    assert all(not r[2] for r in results), results[0][2]
    assert {r[0] for r in results} == {results[0][0]}
    assert abs(results[0][0] - want.item()) <= 1e-5 * want.item()
    assert sorted(by_rank[0]) == sorted(ref)
    if family == "llama":  # what each rank holds is what the planner counts (lora_params)
        from tensorpar.planner.memory import lora_params
        from tensorpar.planner.shapes import shape_from_hf_config

        shape = shape_from_hf_config(dense.config.to_dict(), "llama")
        for r in results:
            assert r[4] == lora_params(shape, n, r[3], RANK)["total"], (r[3], r[4])
    for name, g in ref.items():
        err = (_dense(by_rank, name) - g).abs().max().item()
        assert err <= 1e-5 * g.abs().max().item(), (name, err, g.abs().max().item())


def _counted_step(path, lora, group=None):
    """The collectives (counts, bytes) of one forward and backward of the model at this TP size:
    with adapters on every projection and the base frozen, or without them, every weight
    trained."""
    from tensorpar.runtime.counting import CollectiveCounter

    model = from_pretrained(path, group).train()
    if lora:
        add_lora(model, RANK, ALPHA, None)
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    with CollectiveCounter({"tp": group}) as counted:
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits  # gathered by the head
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    return dict(counted.counts), dict(counted.bytes)


def test_lora_collectives_are_the_bases_with_the_factors_products(ranks, hf_dirs):
    """At TP=2 without SP a LoRA step makes the fully trained model's collectives, no more:
    each row layer's forward all-reduce carries its z (r values a token), each column op's
    input-gradient all-reduce its dz (r a token and adapted projection); the first block's
    attention, whose input needs no gradient (the embedding is frozen), makes no input-gradient
    all-reduce and sums its A's gradients (q, k, v: r x D each) instead."""
    import transformers

    base, base_bytes = ranks(2).run(_counted_step, hf_dirs / "llama", False)[0]
    mine, mine_bytes = ranks(2).run(_counted_step, hf_dirs / "llama", True)[0]
    config = transformers.AutoConfig.from_pretrained(hf_dirs / "llama")
    blocks, tokens, dim, f32 = config.num_hidden_layers, 2 * 16, config.hidden_size, 4
    rows = 2 * blocks * tokens * RANK  # o_proj, down_proj: z
    columns = (blocks * (3 + 2) - 3) * tokens * RANK  # q|k|v, gate|up: dz, but the first q|k|v
    first = 3 * RANK * dim - tokens * dim  # its A's gradients, not its input's
    assert mine == base, (mine, base)
    assert mine_bytes == base_bytes | {
        "all_reduce": base_bytes["all_reduce"] + f32 * (rows + columns + first)}


@pytest.mark.parametrize("family,n,sp", [("llama", 1, False), ("llama", 3, False),
                                         ("llama", 2, True), ("gpt2", 3, False)])
def test_lora_dropout_matches_peft_with_the_same_masks(ranks, hf_dirs, family, n, sp):
    """``dropout=0.3``: the masks are drawn dense and each rank keeps its part, so the loss and
    every factor's gradient equal PEFT's with those masks (relative 1e-5) at every TP size, with
    sequence parallelism too; and they are not the loss without dropout."""
    path = hf_dirs / family
    factors = _factors(path, family)
    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    targets = TARGETS[family]
    results = ranks(n).run(_tp_loss_and_grads, path, factors, ids, targets, dropout=0.3,
                           sequence_parallel=sp)
    want, ref, _ = _peft_reference(path, family, factors, ids, targets, dropout=0.3)
    plain, _, _ = _peft_reference(path, family, factors, ids, targets)
    assert abs(want.item() - plain.item()) > 1e-3, (want.item(), plain.item())
    assert {r[0] for r in results} == {results[0][0]}
    assert abs(results[0][0] - want.item()) <= 1e-5 * want.item(), (results[0][0], want.item())
    by_rank = [r[1] for r in results]
    for name, g in ref.items():
        err = (_dense(by_rank, name) - g).abs().max().item()
        assert err <= 1e-5 * g.abs().max().item(), (name, err, g.abs().max().item())
