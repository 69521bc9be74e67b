"""Hugging Face Mixture-of-Experts models split by ``parallelize`` and ``from_pretrained`` (the
plan style ``moe``, ``tensorpar/hf/moe.py``): Qwen3-MoE (a dense layer among the MoE ones),
Mixtral (sliding window), OLMoE (q/k norms over all heads), Qwen2-MoE (a shared expert with
its sigmoid gate), GPT-OSS (expert biases, clamped SwiGLU, attention sinks, sliding window).

Each model asks for its router logits, so its loss with labels includes its own
load-balancing loss (``router_aux_loss_coef``). In place and loaded, at 2 and 4 ranks (6
experts: 3 and 3, then 2, 2, 1, 1), the logits, that loss, the aux loss and greedy tokens equal
the dense model's, and so does every gradient, shard by shard; a rank holds at most 1/world +
0.15 of the parameters. One run per world size covers every family (the session's rank pool);
the dense model's results are computed once per family, in this process, and handed to the ranks.
"""

import re

import pytest
import torch
import transformers

from tensorpar.cli.compare import dense_shard, max_rel_error
from tensorpar.hf.parallelize import parallelize
from tensorpar.hf.pretrained import from_pretrained

from tests_common import char_tokenizer

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss")
FAST = FAMILIES[:2]  # the fast tier's (loaded at 2 ranks); the others in the slow tier
# the largest relative error of each kind, ~10x the largest measured over every case here
# (torch 2.13 CPU): the split only reorders fp32 sums
TOL = {"logits": 4e-6,  # measured 3.1e-7 (OLMoE at 4 ranks)
       "loss": 1e-6,  # measured 1.0e-7 (Mixtral at 4 ranks): one fp32 ulp
       "grad": 1e-5}  # measured 2.2e-6 (Qwen2-MoE at 4 ranks)
SPARE = 0.15  # a rank holds at most 1/world + SPARE of the parameters (norms, routers whole)


def moe_configs() -> dict:
    """Width 32, 2 layers, 4 heads (2 KV heads), 6 experts of width 24, top-2, vocabulary 96;
    router logits asked for, aux coefficient 0.1."""
    sizes = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
             "num_experts_per_tok": 2, "output_router_logits": True,
             "router_aux_loss_coef": 0.1, "pad_token_id": 0}
    T = transformers
    return {
        "qwen3_moe": T.Qwen3MoeConfig(**sizes, head_dim=8, num_experts=6, moe_intermediate_size=24,
                                      intermediate_size=40, mlp_only_layers=[0],
                                      norm_topk_prob=True),
        "mixtral": T.MixtralConfig(**sizes, num_local_experts=6, intermediate_size=24,
                                   sliding_window=4),
        # multi-head, as OLMoE is: its k norm spans the KV heads, which no two ranks share
        "olmoe": T.OlmoeConfig(**(sizes | {"num_key_value_heads": 4}), num_experts=6,
                               intermediate_size=24),
        "qwen2_moe": T.Qwen2MoeConfig(**sizes, num_experts=6, moe_intermediate_size=24,
                                      shared_expert_intermediate_size=40, intermediate_size=40),
        "gpt_oss": T.GptOssConfig(**sizes, head_dim=8, num_local_experts=6, intermediate_size=24,
                                  sliding_window=4),
    }


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """The families' tiny random models, saved with save_pretrained (experts one by one, as
    transformers writes them; GPT-OSS's fused), and ``data.txt``, the runs' training text: 8,000
    characters of Python's help text (every rank of a run tokenizes all of its ``--data``: the
    whole help text takes 0.6 s a rank with the character tokenizer)."""
    from tensorpar.data.text import default_corpus

    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("hf-moe")
    (root / "data.txt").write_text(default_corpus()[:8_000])
    for family, config in moe_configs().items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        if family == "gpt_oss":  # sinks and expert biases away from their zero init
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "sinks" in name or "bias" in name:
                        p.normal_(std=0.5)
        model.save_pretrained(root / family)
        char_tokenizer().save_pretrained(root / family)  # for train --hf
    return root


GREEDY = {"max_new_tokens": 6, "do_sample": False}


def _dense_reference(path) -> dict:
    """The dense model's logits, loss with labels, aux loss, greedy tokens and gradients on the
    checks' batch, and its parameter count: computed once per family, here, with one thread as
    a rank runs, and handed to every rank (each rank once ran it again for every way)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ids = torch.randint(1, 96, (2, 10), generator=torch.Generator().manual_seed(0))
        dense = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        ref = dense(ids, labels=ids)
        tokens = dense.generate(ids, **GREEDY)
        ref.loss.backward()
    finally:
        torch.set_num_threads(threads)
    return {"ids": ids, "logits": ref.logits.detach(), "loss": ref.loss.detach(),
            "aux": ref.aux_loss.detach(), "tokens": tokens,
            "grads": {name: p.grad for name, p in dense.named_parameters()},
            "numel": sum(p.numel() for p in dense.parameters())}


def _one(path, how: str, ref: dict) -> dict:
    """One family, converted in place or loaded: the largest error of each kind against the
    dense model's ``ref``, whether the greedy tokens agree, and the share of the parameters
    this rank holds."""
    torch.manual_seed(0)
    ids = ref["ids"]
    model = from_pretrained(path) if how == "load" else \
        parallelize(transformers.AutoModelForCausalLM.from_pretrained(path).eval())
    model.gather_logits = True
    errors = {}

    def close(kind, actual, expected):
        errors[kind] = max(errors.get(kind, 0.0), max_rel_error(actual, expected))

    out = model(ids, labels=ids)
    close("logits", out.logits, ref["logits"])
    close("loss", out.loss, ref["loss"])
    close("loss", out.aux_loss, ref["aux"])
    same_tokens = torch.equal(model.generate(ids, **GREEDY), ref["tokens"])
    out.loss.backward()
    for name, p in model.named_parameters():
        close("grad", p.grad, dense_shard(ref["grads"][name], p.tp_shard))
    held = sum(p.numel() for p in model.parameters())
    return {"errors": errors, "same tokens": same_tokens, "aux": out.aux_loss.item(),
            "share": held / ref["numel"]}


def _every_family(root, hows: tuple[str, ...], refs: dict) -> dict:
    transformers.logging.set_verbosity_error()
    return {(family, how): _one(root / family, how, ref) for family, ref in refs.items()
            for how in hows}


@pytest.fixture(scope="module")
def runs(ranks, moe_dirs):
    """``runs(n, hows, families)``: each rank's results, each (world size, ways, families) run
    once, when first asked for, against each family's dense reference (computed once)."""
    done, refs = {}, {}

    def get(n, hows, families=FAMILIES):
        if (n, hows, families) not in done:
            for family in families:
                if family not in refs:
                    refs[family] = _dense_reference(moe_dirs / family)
            done[n, hows, families] = ranks(n).run(_every_family, moe_dirs, hows,
                                                   {f: refs[f] for f in families})
        return done[n, hows, families]

    return get


def _check(results, family, n):
    for rank, r in enumerate(results):
        for (fam, how), got in r.items():
            if fam != family:
                continue
            for kind, err in got["errors"].items():
                assert err <= TOL[kind], f"{family} {how}, rank {rank}/{n}: {kind} {err:.2e}"
            assert got["same tokens"], f"{family} {how}, rank {rank}/{n}: greedy tokens differ"
            assert got["aux"] > 0
            assert got["share"] <= 1 / n + SPARE, (family, how, rank, got["share"])


@pytest.mark.parametrize("family", FAST)
def test_loaded_at_two_ranks_equals_the_dense_model(runs, family):
    """from_pretrained at 2 ranks: heads 2 and 2, experts 3 and 3, as the dense model."""
    _check(runs(2, ("load",), FAST), family, 2)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES[2:])
def test_others_loaded_at_two_ranks_equal_the_dense_model(runs, family):
    """As the fast tier's two, for OLMoE, Qwen2-MoE and GPT-OSS."""
    _check(runs(2, ("load",), FAMILIES[2:]), family, 2)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_in_place_at_two_ranks_equals_the_dense_model(runs, family):
    """parallelize on the dense model at 2 ranks: as loaded."""
    _check(runs(2, ("convert",)), family, 2)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_four_ranks_equal_the_dense_model(runs, family):
    """4 ranks: one query head each (KV heads shared by two ranks, but OLMoE's), experts 2, 2,
    1, 1."""
    _check(runs(4, ("convert", "load")), family, 4)


def test_deepseek_v3_refused_in_one_line():
    """DeepSeek-V3's latent attention has no style: one line naming what is missing."""
    config = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=40, moe_intermediate_size=24, n_routed_experts=6, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"^no tensor-parallel plan for DeepseekV3ForCausalLM: "
                                         r"its multi-head latent attention [^\n]*$"):
        parallelize(model)


@pytest.mark.slow
def test_verify_hf_on_qwen3_moe(ranks, moe_dirs, capsys):
    """``verify --hf`` (``run_verify_hf``) on the Qwen3-MoE at 2 ranks passes: every layer's
    output and gradients, the logits, the loss with its aux loss and greedy tokens as the
    dense model's; the experts' all-to-alls among its collectives."""
    from tensorpar.cli.verify_hf import run_verify_hf

    ok = run_verify_hf(str(moe_dirs / "qwen3_moe"), 2,
                       run=lambda fn, k, *args: ranks(k).run(fn, *args))
    out = capsys.readouterr().out
    assert ok, out
    assert "all outputs, gradients and greedy tokens match" in out and "'all_to_all': 3" in out


# 2 steps: the first at the initial weights, the second after an update (AdamW's moments, the
# clipped norm), each equal to one rank's
TRAIN = {"batch_size": 4, "seq_len": 16, "warmup_steps": 1, "lr": 3e-3, "seed": 1, "steps": 2}


@pytest.fixture(scope="module")
def trained(ranks, moe_dirs, tmp_path_factory):
    """``train --hf`` on the Qwen3-MoE (in-process, the pool's ranks), all weights and LoRA
    (rank 4: the attention's and the dense layer's projections; the experts frozen), at TP 1
    and 2: {(tp, lora): (the run's folder, its metrics rows)}."""
    from hf_runs import train

    root = tmp_path_factory.mktemp("hf-moe-train")
    runs = {}
    for tp in (1, 2):
        for lora in (False, True):
            out = root / f"tp{tp}{'-lora' if lora else ''}"
            runs[tp, lora] = out, train(ranks, moe_dirs / "qwen3_moe", out, tp, **TRAIN,
                                        data=str(moe_dirs / "data.txt"),
                                        **({"lora_rank": 4} if lora else {}))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_train_hf_at_tp2_equals_one_rank(trained, lora):
    """Each step's loss (the model's aux loss included: it moves the loss) and gradient norm at
    TP 2, the experts cut across the 2 ranks, equal TP 1's (1e-5 relative)."""
    (_, one), (_, two) = trained[1, lora], trained[2, lora]
    assert len(one) == len(two) == TRAIN["steps"]
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (a["step"], key, a[key], b[key])


# train --hf at layouts folding EP from the dp x tp ranks, against one rank: (family, tp, dp, ep,
# sequence parallelism, the dp engine, --micro-batch-size); Qwen3-MoE at (tp 2, ep 2) is the
# ``trained`` fixture's TP-2 run. A layout of dp ranks taking passes of M sequences is compared
# with one rank taking passes of dp x M, the same sequences (a pass's balancing loss counts its
# tokens on every dp rank).
LAYOUTS = [("qwen3_moe", 1, 2, 2, False, "fsdp", None),
           ("qwen3_moe", 2, 2, 4, False, "ddp", None),
           ("qwen3_moe", 2, 2, 4, True, "fsdp", None),
           ("mixtral", 2, None, 2, False, "fsdp", None),
           ("gpt_oss", 2, None, 2, False, "fsdp", None),
           ("qwen2_moe", 2, 2, 4, False, "fsdp", None),
           ("qwen3_moe", 1, 2, 2, False, "ddp", 1)]
LAYOUT_IDS = ["{}-tp{}-dp{}-ep{}{}{}".format(*layout[:4], "-sp" if layout[4] else "",
                                             f"-micro{layout[6]}" if layout[6] else "")
              for layout in LAYOUTS]


@pytest.fixture(scope="module")
def layouts(ranks, moe_dirs, trained, tmp_path_factory):
    """The metrics rows of each layout's run and of its family's run on one rank:
    {layout id: (one rank's rows, the layout's rows)}."""
    from hf_runs import train

    root = tmp_path_factory.mktemp("hf-moe-layouts")
    one = {("qwen3_moe", None): trained[1, False][1]}
    flags = TRAIN | {"data": str(moe_dirs / "data.txt")}
    runs = {}
    for name, (family, tp, dp, ep, sp, mode, micro) in zip(LAYOUT_IDS, LAYOUTS, strict=True):
        ref = family, None if micro is None else micro * (dp or 1)
        if ref not in one:
            one[ref] = train(ranks, moe_dirs / family, root / f"{family}-one-{ref[1]}", 1,
                             micro_batch_size=ref[1], **flags)
        runs[name] = one[ref], train(ranks, moe_dirs / family, root / name, tp, dp, ep=ep,
                                     sequence_parallel=sp, dp_mode=mode, micro_batch_size=micro,
                                     **flags)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUT_IDS)
def test_train_hf_moe_layouts_equal_one_rank(layouts, layout):
    """``train --hf --tp T --dp D --ep N`` (and ``--micro-batch-size``): the experts cut across
    EP groups folded from the dp x tp ranks (their gradients summed over the expert-data ranks,
    left out of FSDP2 and DDP, counted once in the norm), the model's balancing loss over each
    pass's tokens on every dp rank (and TP rank, under sequence parallelism, where each routes
    its shard): each step's loss (that aux loss included) and gradient norm equal one rank's
    taking the same passes (1e-5 relative; with the one-rank run in one pass instead, the
    micro-batched layout's loss differs by 2e-4)."""
    one, other = layouts[layout]
    assert len(one) == len(other) == TRAIN["steps"]
    for a, b in zip(one, other, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (a["step"], key, a[key], b[key])


@pytest.mark.slow
def test_export_of_a_tp2_run_loads_in_transformers(trained, tmp_path):
    """``export --hf-out`` of the TP-2 run: transformers loads it with no missing or unexpected
    key (the experts written whole, fused) and computes the checkpoint's logits."""
    from hf_runs import checkpoint_logits, exported_logits

    run = trained[2, False][0]
    ids = torch.randint(1, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    expected = checkpoint_logits(run, ids)
    assert max_rel_error(exported_logits(run, tmp_path / "hf", ids), expected) <= TOL["logits"]


FOLDED_BATCHES = torch.randint(1, 96, (2, 2, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def folded_reference(moe_dirs) -> list[dict]:
    """The dense Qwen3-MoE on each replica's batch: its logits, loss and gradients, computed
    once here (with one thread, as a rank computes them) for every rank of both foldings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dense = transformers.AutoModelForCausalLM.from_pretrained(moe_dirs / "qwen3_moe")
        refs = []
        for ids in FOLDED_BATCHES:
            dense.zero_grad()
            ref = dense(ids, labels=ids)
            ref.loss.backward()
            refs.append({"logits": ref.logits.detach(), "loss": ref.loss.detach(),
                         "grads": {n: p.grad.clone() for n, p in dense.named_parameters()}})
    finally:
        torch.set_num_threads(threads)
    return refs


def _folded_body(path, folding: str, refs: list[dict]) -> dict:
    """4 ranks as 2 data replicas (rank // 2) of TP 2, each on a batch of its own; the experts
    cut across ``ep_group``: "ep2" the ranks with the same TP rank ({0, 2}, {1, 3}: TP peers
    hold the same experts), "ep4" all four. Largest errors against the dense model (``refs``,
    one per replica's batch): each replica's logits and loss on its batch, every gradient but
    the experts' as its replica's dense one, the experts' as the sum of both replicas' (their
    tokens share the experts)."""
    import torch.distributed as dist

    transformers.logging.set_verbosity_error()
    rank, d = dist.get_rank(), dist.get_rank() // 2
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])] if folding == "ep2" else \
        [dist.new_group([0, 1, 2, 3])]
    ep_group = ep_groups[rank % 2] if folding == "ep2" else ep_groups[0]
    model = parallelize(transformers.AutoModelForCausalLM.from_pretrained(path),
                        group=tp_groups[d], ep_group=ep_group)
    model.gather_logits = True
    out = model(FOLDED_BATCHES[d], labels=FOLDED_BATCHES[d])
    out.loss.backward()
    errors = {"logits": max_rel_error(out.logits, refs[d]["logits"]),
              "loss": max_rel_error(out.loss, refs[d]["loss"]), "grad": 0.0}
    for name, p in model.named_parameters():
        spec = getattr(p, "ep_shard", None)
        expected = spec.take(refs[0]["grads"][name] + refs[1]["grads"][name]) \
            if spec is not None else dense_shard(refs[d]["grads"][name], p.tp_shard)
        errors["grad"] = max(errors["grad"], max_rel_error(p.grad, expected))
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("folding", ["ep2", "ep4"])
def test_ep_group_folded_across_data_replicas(ranks, moe_dirs, folded_reference, folding):
    """``parallelize(..., ep_group=)``: the experts cut across ranks of two data replicas,
    TP 2 x EP 2 (TP peers hold the same experts, their gradients summed over TP) and TP 2 in
    EP 4; each replica's logits and loss are its dense model's, the experts' gradients the
    sum over both replicas' tokens."""
    for rank, errors in enumerate(ranks(4).run(_folded_body, moe_dirs / "qwen3_moe", folding,
                                               folded_reference)):
        for kind, err in errors.items():
            assert err <= TOL[kind], f"rank {rank}: {kind} {err:.2e}"


@pytest.mark.parametrize("flags, says", [
    ({"tp": 1, "dp": 2, "ep": 4}, "--ep 4 does not divide the 2 ranks of a stage"),
    ({"tp": 2, "dp": 2, "ep": 3}, "--ep 3 does not divide the 4 ranks"),
    ({"tp": 1, "dp": 8, "ep": 8}, "--ep 8 is more than the 6 routed experts"),
    ({"tp": 1, "dp": 1, "cp": 2, "ep": 4}, "--ep 4 does not divide the 2 ranks of a stage "
                                           "(--dp 1 x --cp 2 x --tp 1)"),
], ids=["ep-over-ranks", "ep-not-dividing", "ep-over-experts", "ep-over-cp-ranks"])
def test_train_hf_moe_layout_refused_in_one_line(moe_dirs, flags, says):
    """A layout the MoE model cannot take is refused before any rank starts, in one line."""
    from hf_runs import resolve

    with pytest.raises(ValueError, match=re.escape(says)) as e:
        resolve(moe_dirs / "qwen3_moe", **flags)
    assert "\n" not in str(e.value)
