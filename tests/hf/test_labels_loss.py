"""``model(input_ids, labels=labels).loss`` on a converted model (``hf/labels_loss.py``), as a
user's own loop (or transformers' Trainer, TRL) calls it: the loss and the gradients equal the
dense model's, ignored labels and ``num_items_in_batch`` included, and the logits are never
gathered for it (no all-gather of the vocabulary's size); without labels they come whole."""

import pytest
import torch
import transformers

from tensorpar.hf.pretrained import from_pretrained  # noqa: E402
from tensorpar.parallel.sharding import ShardSpec  # noqa: E402
from tensorpar.runtime.counting import CollectiveCounter  # noqa: E402

VOCAB = 96


def _batch():
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt's tokens, not trained on
    return ids, labels


def _rank(path, items, group=None):
    model = from_pretrained(path, group).train()
    ids, labels = _batch()
    kwargs = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    with CollectiveCounter() as counter:
        out = model(ids, labels=labels, **kwargs)
        out.loss.backward()
    grads = {n: (p.grad.clone(), p.tp_shard) for n, p in model.named_parameters()
             if n.endswith(("q_proj.weight", "down_proj.weight", "embed_tokens.weight"))}
    with torch.no_grad():
        whole = model(ids).logits
        model.gather_logits = True
        asked = model(ids, labels=labels, **kwargs)
    return {"loss": out.loss.item(), "local": out.logits.shape[-1], "whole": whole,
            "asked": (asked.loss.item(), asked.logits.shape[-1]), "grads": grads,
            "gathers": dict(counter.bytes).get("all_gather", 0)}


def _dense_grad(pieces):
    g, spec = pieces[0]
    if spec.dim is None:
        return g
    return torch.cat([p for p, _ in pieces], dim=spec.dim)


@pytest.mark.parametrize("items", [None, 40])
def test_labels_loss_is_the_dense_models_without_gathering(ranks, hf_dirs, items):
    """TP=2 Llama: the loss (mean over the targets not ignored, or summed over
    ``num_items_in_batch``) and the gradients equal transformers' dense model's (1e-5
    relative); the logits returned with labels are this rank's half of the vocabulary and no
    all-gather moves logits; without labels, or with gather_logits, they come whole."""
    path = hf_dirs / "llama"
    results = ranks(2).run(_rank, path, items)
    dense = transformers.AutoModelForCausalLM.from_pretrained(path).train()
    ids, labels = _batch()
    kwargs = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    out = dense(ids, labels=labels, **kwargs)
    out.loss.backward()
    for r in results:
        assert abs(r["loss"] - out.loss.item()) <= 1e-5 * out.loss.item(), (r["loss"], out.loss)
        assert r["local"] == VOCAB // 2 and r["asked"][1] == VOCAB
        assert abs(r["asked"][0] - out.loss.item()) <= 1e-5 * out.loss.item()
        assert r["gathers"] < 2 * 12 * VOCAB * 4  # logits (B, T, V) fp32 never gathered
        with torch.no_grad():
            assert torch.allclose(r["whole"], dense.eval()(ids).logits, atol=1e-5)
        dense.train()
    params = dict(dense.named_parameters())
    for name in results[0]["grads"]:
        mine = _dense_grad([r["grads"][name] for r in results])
        want = params[name].grad
        assert (mine - want).abs().max() <= 1e-5 * want.abs().max(), name
    assert isinstance(results[0]["grads"][name][1], ShardSpec)
