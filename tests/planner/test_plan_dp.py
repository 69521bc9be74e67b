"""The data-parallel planner against measurement: TP x DP with FSDP2 and DDP on real gloo ranks
(``tensorpar.mesh``), the predicted per-rank peak within 10% of MemoryMeter's and the collectives
on the dp group and on the tp group equal to CollectiveCounter's, exactly."""

import gc

import pytest
import torch
import torch.distributed as dist

from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.mesh.data_parallel import data_parallel, dp_groups, inner
from tensorpar.mesh.mesh import init_parallel
from tensorpar.parallel.ownership import ShardOwnership, clip_grad_norm_
from tensorpar.planner.comm import predicted_comm
from tensorpar.planner.data_parallel import ddp_buckets, dp_comm, dp_memory, fsdp_elements
from tensorpar.planner.memory import tensorpar_memory
from tensorpar.planner.meter import MemoryMeter
from tensorpar.planner.shapes import preset
from tensorpar.planner.step import Step
from tensorpar.planner.tp_plan import plan_memory
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.train.optim import adamw
from tensorpar.train.shape import gpt_shape

SMALL = {"vocab_size": 256, "n_layer": 2, "dim": 64, "n_head": 4, "n_kv_head": 2}
# uneven everywhere: the vocabulary over TP and each dim 0 over dp (FSDP2 pads), and at TP=2
# rank 1 holds a KV head of rank 0's and one of its own (the gradient norm gathers it over dp)
ODD = {"vocab_size": 97, "n_layer": 2, "dim": 48, "n_head": 6, "n_kv_head": 3, "hidden_dim": 80,
       "tie_embeddings": False}
# over 1 MiB of gradients per rank: DDP's first bucket closes at 1 MiB, a second takes the rest
WIDE = {"vocab_size": 2000, "n_layer": 2, "dim": 128, "n_head": 4, "n_kv_head": 2,
        "tie_embeddings": False}
# (config, mode, sequences per dp rank, seq, bf16 autocast, sequence parallel, full recompute)
CASES = {
    (2, 2): [(SMALL, "fsdp", 2, 16, False, False, False),
             (SMALL, "ddp", 2, 16, False, False, False),
             (ODD, "fsdp", 2, 25, True, True, True),
             (WIDE, "ddp", 1, 16, True, False, False)],
    (1, 4): [(ODD, "fsdp", 1, 25, True, False, False),
             (WIDE, "ddp", 1, 16, False, False, False)],
}


def _measure(tp, dp, cases):
    """Each case's steady step on this rank: the trainer's step (the dp rank's slice of the
    batch, forward, backward, the gradient norm, the loss all-reduced over dp, AdamW made
    after wrapping), measured at steps 2 and 3."""
    mesh = init_parallel(tp=tp, dp=dp)
    tp_group, dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
    dp_rank = mesh["dp"].get_local_rank()
    out = []
    for cfg_d, mode, B, T, bf16, sp, recompute in cases:
        gc.collect()
        with MemoryMeter() as before:  # what earlier cases and tests left: not ours
            pass
        model = GPT(GPTConfig(**cfg_d), tp_group, sp, seed=0, recompute=recompute)
        ownership = ShardOwnership.gather(model, tp_group)
        # the trainer's: under bf16 FSDP2 gathers bf16 weights (its MixedPrecisionPolicy)
        wrapped = data_parallel(model, mesh, mode, param_dtype=torch.bfloat16 if bf16 else None)
        opt = adamw(wrapped.parameters())
        batch = torch.randint(0, cfg_d["vocab_size"], (B * dp, T),
                              generator=torch.Generator().manual_seed(0))
        ids = batch[dp_rank * B:(dp_rank + 1) * B]
        peaks = []
        for _ in range(3):
            with MemoryMeter() as mem, \
                    CollectiveCounter({"tp": tp_group, "dp": dp_groups(wrapped, mesh)}) as comm:
                with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                    loss = wrapped(ids, ids)
                loss.backward()
                clip_grad_norm_(inner(wrapped), ownership, 1.0, tp_group,
                                dp_group if mode == "fsdp" else None)
                reported = loss.detach().clone()
                dist.all_reduce(reported, group=dp_group)
                opt.step()
                opt.zero_grad(set_to_none=True)
            peaks.append(mem.peak_bytes - before.entry_bytes)
        buckets = None
        if mode == "ddp":
            buckets = [b.buffer().numel() * b.buffer().element_size()
                       for b in wrapped.reducer._get_zeros_like_grad_buckets()]
        out.append({"peak": min(peaks[1:]), "entry": mem.entry_bytes - before.entry_bytes,
                    "comm": {group: {k: dict(v) for k, v in counted.items()}
                             for group, counted in comm.by_group.items()},
                    "buckets": buckets})
        del wrapped, model, opt, ownership, loss, reported  # the loss's graph holds the model
    return out


@pytest.mark.parametrize("tp,dp", list(CASES))
def test_dp_predictions_match_measurements(ranks, tp, dp):
    """On every rank of TP x DP: the entry bytes (sharded or replicated weights and AdamW
    states, DDP's buckets) within 2% and the step's peak within 10% of the prediction; the dp
    group's collectives equal ``dp_comm``'s and the tp group's ``predicted_comm``'s, exactly;
    DDP's buckets are the predicted ones; nothing runs on another group."""
    results = ranks(tp * dp).run(_measure, tp, dp, CASES[tp, dp])
    for rank, per_case in enumerate(results):
        tp_rank, dp_rank = rank % tp, rank // tp
        for (cfg_d, mode, B, T, bf16, sp, recompute), got in zip(CASES[tp, dp], per_case,
                                                                   strict=True):
            shape = gpt_shape(GPTConfig(**cfg_d))
            what = f"rank {rank} (tp {tp_rank}, dp {dp_rank}) {mode} {cfg_d} bf16={bf16} sp={sp}"
            step = Step(shape, tp, B * dp, T, "bf16-autocast" if bf16 else "fp32", sp,
                        "full" if recompute else "none", dp=dp, dp_mode=mode)
            plan = dp_memory(step, tensorpar_memory(step, tp_rank), tp_rank, dp_rank)
            entry = plan.weights + plan.optimizer + (plan.dp_buffers if mode == "ddp" else 0)
            # measured (2026-11-28, torch 2.13 CPU): entry at most 0.68% off (FSDP2, TP=1 x
            # DP=4), the peak 2.0% (FSDP2, fp32, TP=2 x DP=2; bf16 with FSDP2's bf16 gathered
            # weights 0.8%, TP=1 x DP=4)
            assert got["entry"] == pytest.approx(entry, rel=0.02), (what, got["entry"], entry)
            assert got["peak"] == pytest.approx(plan.total, rel=0.10), \
                (what, got["peak"], plan.total, plan.peak_at)
            mixed = bf16 and mode == "fsdp"  # FSDP2's bf16 gathered weights
            expected = dp_comm(shape, tp, dp, mode, rank=tp_rank, bf16_params=mixed)
            assert got["comm"].pop("dp") == {k: expected[k] for k in
                                             ("counts", "bytes", "ring_bytes")}, what
            if tp > 1:
                tp_comm = predicted_comm(shape, B, T, tp, sp, "bf16" if bf16 else "fp32",
                                         "full" if recompute else "none", bf16_params=mixed)
                assert got["comm"].pop("tp") == {k: tp_comm[k] for k in
                                                 ("counts", "bytes", "ring_bytes")}, what
            assert got["comm"] == {}, what
            if mode == "ddp":
                assert got["buckets"] == ddp_buckets(shape, tp, tp_rank), what
                assert len(got["buckets"]) == (2 if cfg_d is WIDE else 1), what


def test_meter_sees_storages_resized_in_place():
    """FSDP2 frees and re-allocates its gathered weights with ``untyped_storage().resize_``,
    which no dispatched op shows, inside ``record_function`` regions: the meter reads the sizes
    again there, so a storage freed in place stops counting and one grown in place counts."""
    gathered, resharded = torch.ones(10_000), torch.empty(0)
    with MemoryMeter() as mem:
        with torch.autograd.profiler.record_function("reshard"):
            gathered.untyped_storage().resize_(0)
        other = torch.ones(10_000)  # takes the 40,000 bytes just freed
        assert mem.peak_bytes == mem.entry_bytes
        with torch.autograd.profiler.record_function("unshard"):
            resharded.untyped_storage().resize_(80_000)
    assert mem.peak_bytes - mem.entry_bytes == 80_000
    del other


def test_fsdp_chunks_pad_and_ddp_buckets():
    """FSDP2 cuts dim 0 into dp chunks of ceil(d0/dp) rows (torch.chunk), stores them padded and
    gathers dp of them; the last ranks' chunks are shorter or empty. DDP's first bucket closes
    once it reaches 1 MiB, the next at 25 MiB, each taking whole tensors."""
    five = [("w", 5, 3)]
    assert [fsdp_elements(five, 4, r)["local"] for r in range(4)] == [6, 6, 3, 0]
    assert fsdp_elements(five, 4)["unsharded"] == 24 and fsdp_elements(five, 4)["sharded"] == 6
    buckets = ddp_buckets(preset("llama-2-7b"), 1)
    assert buckets[0] >= 2**20 and all(b >= 25 * 2**20 for b in buckets[1:-1])
    assert sum(buckets) == 4 * preset("llama-2-7b").params()


def test_without_dp_the_plan_is_unchanged():
    """dp=1 is the plan without data parallelism: the same row, no dp collective."""
    shape = preset("llama-2-7b")
    for dtype in ("fp32", "bf16", "bf16-autocast"):
        row = plan_memory(Step(shape, 2, 1, 4096, dtype, device="cuda"))
        mem = tensorpar_memory(Step(shape, 2, 1, 4096, "fp32" if dtype == "fp32" else
                                    "bf16-autocast", device="cuda"))
        if dtype != "bf16":
            assert row["total"] == mem.total and row["peak_at"] == mem.peak_at
        assert row["dp"] == 1 and row["dp_mode"] is None and row["dp_buffers"] == 0
    assert dp_comm(shape, 2, 1, "fsdp")["counts"] == {}
    with pytest.raises(ValueError, match="--dp 0 must be >= 1"):
        plan_memory(Step(shape, 1, 1, 4096, dp=0))
    with pytest.raises(ValueError, match="--batch 3 does not split over --dp 2"):
        plan_memory(Step(shape, 1, 3, 4096, dp=2))


def test_llama_on_8_and_64_devices():
    """The README's answer (80 GB devices, 4096 tokens, the world's size in sequences per step,
    CUDA kernels): llama-2-7b on 8 devices fits FSDP2 at TP=1 (DDP's replicas do not), and sends
    1.5 times DDP's bytes; llama-2-70b on 64 fits only with full recomputation and FSDP2."""
    def row(name, tp, world, dtype, mode, recompute="none"):
        return plan_memory(Step(preset(name), tp, world, 4096, dtype, False, recompute,
                                dp=world // tp, dp_mode=mode, device="cuda"), 80e9)

    assert row("llama-2-7b", 1, 8, "bf16", "fsdp")["fits"]
    assert not row("llama-2-7b", 1, 8, "fp32", "ddp")["fits"]
    assert not any(row("llama-2-70b", tp, 64, dtype, mode)["fits"] for tp in (1, 2, 4, 8)
                   for dtype in ("fp32", "bf16") for mode in ("fsdp", "ddp"))
    assert row("llama-2-70b", 4, 64, "bf16", "fsdp", "full")["fits"]
    assert not row("llama-2-70b", 1, 64, "bf16", "ddp", "full")["fits"]
    fsdp, ddp = (dp_comm(preset("llama-2-7b"), 1, 8, mode) for mode in ("fsdp", "ddp"))
    ratio = sum(fsdp["ring_bytes"].values()) / sum(ddp["ring_bytes"].values())
    assert ratio == pytest.approx(1.5, rel=0.02)  # 1.48
