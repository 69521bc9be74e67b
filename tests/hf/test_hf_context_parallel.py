"""Hugging Face Llama-family models under context parallelism (``hf/context.py``) against the
dense model on the whole rows in one process: each rank's logits are the dense logits of its
load-balanced chunks, the ``labels=`` loss is the dense loss on every rank, and each weight's
gradient summed over the CP ranks is the dense gradient (this rank's TP shard of it).

Layouts on n = tp x cp ranks, rank = c * tp + t (TP groups consecutive, CP groups strided), as in
``tests/core/test_context_parallel.py``. One shared run per layout: every case below reads it.
Rows of 29 tokens (4 chunks of 8, 7, 7, 7 at cp 2), the first row's first labels ignored; packed
rows hold examples of 7, 11 and 11 tokens (boundaries inside chunks and across ranks) and one
whole row.
"""

import pytest
import test_chat
import torch
import torch.distributed as dist
import transformers

from tensorpar.cli.compare import dense_shard, max_rel_error
from tensorpar.hf.parallelize import check_plan_fits, parallelize
from tensorpar.hf.plans import plan_for
from tensorpar.hf.pretrained import from_pretrained
from tensorpar.parallel.context import split_to_cp

T = 29
PACKED = [[7, 11, 11], [29]]
# the largest relative error of the logits, the loss and every gradient, ~10x the largest
# measured over every case here (torch 2.13 CPU)
TOL = 6e-6  # measured 5.8e-7 (a gradient at tp 2, cp 2)
# a Mixtral whose sliding window (5 tokens) cuts into every example
MOE = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
       "num_experts_per_tok": 2, "sliding_window": 5}
_GROUPS: dict = {}


def _groups(tp: int, cp: int):
    """(tp_group, cp_group) of this rank, made once per process and layout."""
    n = dist.get_world_size()
    if (tp, cp) not in _GROUPS:
        tp_group = dist.new_subgroups_by_enumeration(
            [list(range(c * tp, c * tp + tp)) for c in range(cp)])[0]
        cp_group = dist.new_subgroups_by_enumeration(
            [list(range(t, n, tp)) for t in range(tp)])[0]
        _GROUPS[tp, cp] = tp_group, cp_group
    return _GROUPS[tp, cp]


def _batch(packed: bool) -> dict:
    ids = torch.randint(1, 96, (2, T), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        batch["position_ids"] = torch.stack(
            [torch.cat([torch.arange(n) for n in row]) for row in PACKED])
    return batch


def _errors(dense, model, batch: dict, cp_group) -> dict[str, float]:
    """The largest relative error of this rank's logits, its loss and every gradient summed
    over the CP group, against the dense model on the whole rows."""
    ref = dense(**batch, use_cache=False)  # no cache: transformers keeps packed examples apart
    ref.loss.backward()
    out = model(**batch)
    out.loss.backward()
    dense_grads = {name: p.grad for name, p in dense.named_parameters()}
    grad = 0.0
    for name, p in model.named_parameters():
        summed = p.grad.clone()
        dist.all_reduce(summed, group=cp_group)  # the trainer's sum over dp x cp
        grad = max(grad, max_rel_error(summed, dense_shard(dense_grads[name], p.tp_shard)))
    return {"logits": max_rel_error(out.logits, split_to_cp(ref.logits, cp_group)),
            "loss": abs(out.loss.item() - ref.loss.item()) / ref.loss.item(), "grad": grad}


def _llama_case(path: str, tp: int, cp: int, packed: bool, recompute: bool = False) -> dict:
    tp_group, cp_group = _groups(tp, cp)
    dense = transformers.AutoModelForCausalLM.from_pretrained(path)
    model = from_pretrained(path, tp_group, cp_group=cp_group).train()
    model.gather_logits = True  # the whole vocabulary, as the dense logits
    if recompute:
        model.activation_checkpointing_enable({"use_reentrant": False})
    return _errors(dense, model, _batch(packed), cp_group)


def _moe_case(cp: int) -> tuple[dict, list[str]]:
    """Mixtral: its attention is Llama's (with a sliding window), converted alone (the experts
    stay whole); the errors, and what its forward says when asked for router logits (by the
    call, then by the config)."""
    tp_group, cp_group = _groups(1, cp)
    torch.manual_seed(0)
    dense = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**MOE))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(dense.config)
    model.load_state_dict(dense.state_dict())
    parallelize(model, {"model.layers.*.self_attn": "attention"}, tp_group, cp_group=cp_group)
    errors = _errors(dense, model, _batch(packed=True), cp_group)
    batch, said = _batch(packed=False), []
    for how in ("call", "config"):
        kwargs = {"output_router_logits": True} if how == "call" else {}
        model.config.output_router_logits = how == "config"
        try:
            model(**batch, **kwargs)
        except ValueError as e:
            said.append(f"{how}: {e}")
    return errors, said


def _refusals(path: str, cp: int) -> list[str]:
    """What a CP model refuses at its forward, each in one line on every rank."""
    tp_group, cp_group = _groups(1, cp)
    model = from_pretrained(path, tp_group, cp_group=cp_group)
    ids = _batch(False)["input_ids"]
    calls = {"a cache": {"input_ids": ids, "use_cache": True,
                             "cache": transformers.DynamicCache(config=model.config)},
             "padding": {"input_ids": ids, "attention_mask": (ids > 10).long()},
             "too short": {"input_ids": ids[:, :2 * cp - 1]}}
    said = []
    for what, kwargs in calls.items():
        try:
            model(**kwargs)
        except ValueError as e:
            said.append(f"{what}: {e}")
    return said


def _cp2_body(path: str) -> dict:
    transformers.logging.set_verbosity_error()
    mixtral, router = _moe_case(2)
    return {"plain": _llama_case(path, 1, 2, packed=False),
            "packed": _llama_case(path, 1, 2, packed=True),
            "recompute": _llama_case(path, 1, 2, packed=True, recompute=True),
            "mixtral": mixtral, "refused": _refusals(path, 2), "router refused": router}


def _tp2cp2_body(path: str) -> dict:
    transformers.logging.set_verbosity_error()
    return {"plain": _llama_case(path, 2, 2, packed=False),
            "packed": _llama_case(path, 2, 2, packed=True)}


@pytest.fixture(scope="module")
def cp2(ranks, hf_dirs):
    return ranks(2).run(_cp2_body, str(hf_dirs / "llama"))


@pytest.fixture(scope="module")
def tp2cp2(ranks, hf_dirs):
    return ranks(4).run(_tp2cp2_body, str(hf_dirs / "llama"))


def _assert_exact(results: list[dict], case: str) -> None:
    for rank, r in enumerate(results):
        for kind, err in r[case].items():
            assert err <= TOL, f"{case}, rank {rank}: {kind} off by {err:.2e} > {TOL:.0e}"


@pytest.mark.parametrize("case", ["plain", "packed", "recompute", "mixtral"])
def test_cp2_equals_the_dense_model(cp2, case):
    """cp 2 on 29 tokens (uneven chunks), GQA: logits, loss and summed gradients equal the dense
    model's on the whole rows; packed examples stay apart on both ranks (the dense model runs
    them with transformers' own packed mask); gradient checkpointing recomputes the same; a
    Mixtral, whose attention is Llama's, packed, with a sliding window of 5 tokens, the same."""
    _assert_exact(cp2, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["plain", "packed"])
def test_tp2_cp2_equals_the_dense_model(tp2cp2, case):
    """(tp 2, cp 2): heads split over TP, the sequence over CP, packed or not: exact as above."""
    _assert_exact(tp2cp2, case)


def test_forward_refusals(cp2):
    """A KV cache, a padding mask and rows shorter than 2 x cp chunks are refused in one line,
    the same on both ranks, before any collective."""
    said = cp2[0]["refused"]
    assert said == cp2[1]["refused"]
    assert [s.split(":")[0] for s in said] == ["a cache", "padding", "too short"], said
    assert all("\n" not in s for s in said)
    assert "KV cache" in said[0] and "labels -100" in said[1] and "cannot be cut into 4" in said[2]


def test_router_logits_refused(cp2):
    """An MoE model's router logits (``output_router_logits``, asked by the call or by the
    config) are refused in one line on both ranks before any collective: transformers would add
    each rank's load-balancing loss, from its chunks alone, to the loss summed over CP."""
    said = cp2[0]["router refused"]
    assert said == cp2[1]["router refused"]
    assert [s.split(":")[0] for s in said] == ["call", "config"], said
    assert all("\n" not in s and "output_router_logits" in s for s in said), said


def test_layouts_refused_before_any_rank(hf_configs):
    """What cannot run context-parallel is refused by ``check_plan_fits``, on every rank alike:
    a family whose attention is not Llama's, sequence parallelism, dropout."""
    from accelerate import init_empty_weights

    def model(name, **changes):
        cfg = hf_configs[name]
        for k, v in changes.items():
            setattr(cfg, k, v)
        with init_empty_weights(include_buffers=False):
            return transformers.AutoModelForCausalLM.from_config(cfg)

    cases = [(model("gpt2"), False, "not model_type='gpt2'"),
             (model("llama"), True, "sequence parallelism"),
             (model("llama", attention_dropout=0.1), False, "dropout")]
    for m, sp, says in cases:
        with pytest.raises(ValueError, match=says):
            check_plan_fits(m, plan_for(m), 1, sp, context_parallel=True)


# ``train --hf --cp``: runs of the trainer on the pools, against one rank


def _train_rows(ranks, path, out, tp: int, cp: int, **flags) -> list[dict]:
    from hf_runs import train

    return train(ranks, path, out, tp, cp=cp, **flags)


def _assert_same_steps(rows: list[dict], ref: list[dict], tol: float) -> None:
    assert len(rows) == len(ref) == STEPS, (rows, ref)
    for mine, want in zip(rows, ref, strict=True):
        for key in ("loss", "grad_norm"):
            err = abs(mine[key] - want[key]) / abs(want[key])
            assert err <= tol, f"step {want['step']}: {key} {mine[key]} vs {want[key]} ({err:.1e})"


STEPS = 3
chat = test_chat.chat  # the fixture: the tiny Llama with a chat template, and conversations
TRAIN_TOL = 1e-5  # measured: see the tests


@pytest.mark.slow
def test_train_text_at_cp2_equals_one_rank(ranks, models, tmp_path):
    """``train --hf`` on text at cp 2, rows of 30 tokens (chunks 8, 8, 7, 7): each step's loss
    and gradient norm equal the one-rank run's (measured 2e-7)."""
    flags = {"steps": STEPS, "batch_size": 4, "seq_len": 30, "seed": 1, "lr": 3e-3,
             "warmup_steps": 1, "data": str(models["data"])}
    ref = _train_rows(ranks, models["llama"], tmp_path / "one", 1, 1, **flags)
    _assert_same_steps(_train_rows(ranks, models["llama"], tmp_path / "cp2", 1, 2, **flags),
                       ref, TRAIN_TOL)


@pytest.mark.slow
def test_train_packed_chat_at_tp2_cp2_equals_one_rank(ranks, chat, tmp_path):
    """``train --hf --pack`` on chat data at (tp 2, cp 2): rows of several examples each
    (positions restarting, nothing read across an example on any CP rank), each step's loss and
    gradient norm equal the one-rank packed run's (measured 2e-7)."""
    flags = {"steps": STEPS, "batch_size": 2, "seq_len": 96, "seed": 3, "lr": 1e-3,
             "warmup_steps": 1, "data": str(chat / "chat.jsonl"), "pack": True}
    ref = _train_rows(ranks, chat / "marked", tmp_path / "one", 1, 1, **flags)
    _assert_same_steps(_train_rows(ranks, chat / "marked", tmp_path / "tp2cp2", 2, 2, **flags),
                       ref, TRAIN_TOL)


def test_train_refusals_before_any_rank(models):
    """``train --hf --cp``: a family whose attention is not Llama's, and LoRA dropout, are
    refused in one line before any rank starts."""
    from hf_runs import resolve

    cases = [(models["gpt2"], {}, "--hf .*gpt2 at --tp 2 --cp 2: context parallelism runs the "
                                  "families whose attention is Llama's"),
             (models["llama"], {"lora_rank": 4, "lora_dropout": 0.1}, "--lora-dropout 0.1 with "
                                                                     "--cp 2")]
    for path, flags, says in cases:
        with pytest.raises(ValueError, match=says):
            resolve(path, cp=2, seq_len=16, **flags)
