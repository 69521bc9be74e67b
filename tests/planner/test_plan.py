"""The planner against measurements: predicted per-rank peak memory within 10% of MemoryMeter's
and predicted collectives equal to CollectiveCounter's, on real gloo ranks; published numbers;
the MLP split; the CLI."""

import argparse
import json

import pytest
import torch

from tensorpar.cli import plan as plan_cli
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.parallel.ownership import ShardOwnership, clip_grad_norm_
from tensorpar.planner.comm import mlp_split_comparison, predicted_comm
from tensorpar.planner.memory import tensorpar_memory
from tensorpar.planner.meter import MemoryMeter
from tensorpar.planner.shapes import preset, shape_from_hf_config
from tensorpar.planner.step import Step
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.train.optim import implementation
from tensorpar.train.shape import gpt_shape

from tests_common import ADAMW_OPTIONS

# (config, sequence_parallel, bf16 autocast, full recompute, AdamW implementation);
# B=2, T=25: the SP cases split the sequence unevenly over 2, 3 and 4 ranks
CASES = [
    ({"vocab_size": 256, "n_layer": 2, "dim": 64, "n_head": 4, "n_kv_head": 2}, False, False,
     False, "fused"),
    ({"vocab_size": 256, "n_layer": 2, "dim": 64, "n_head": 4, "n_kv_head": 1}, True, True,
     False, "foreach"),
    ({"vocab_size": 97, "n_layer": 2, "dim": 48, "n_head": 4, "n_kv_head": 4,
      "tie_embeddings": False, "hidden_dim": 80}, False, True, True, "fused"),
    ({"vocab_size": 200, "n_layer": 3, "dim": 64, "n_head": 4, "n_kv_head": 2}, True, False,
     True, "for-loop"),
]
B, T = 2, 25
# the cases each world size measures: every case at two sizes, 1 and 2 the dense and the even
# split, 3 and 4 the uneven ones (the SP cases' 25 tokens over 3 and 4 ranks)
AT = {1: [0, 2], 2: [0, 1], 3: [2, 3], 4: [1, 3]}


def _measure(cases):
    out = []
    with MemoryMeter() as before:  # what this pool's rank holds from earlier tests: not ours
        pass
    for cfg_d, sp, bf16, recompute, optimizer in cases:
        model = GPT(GPTConfig(**cfg_d), None, sp, seed=0, recompute=recompute)
        ownership = ShardOwnership.gather(model)
        opt = torch.optim.AdamW(model.parameters(), **ADAMW_OPTIONS[optimizer])
        assert implementation(opt) == optimizer
        ids = torch.randint(0, cfg_d["vocab_size"], (B, T))
        peaks = []
        for _ in range(3):  # steps 2 and 3: AdamW states exist, as in steady training
            with MemoryMeter() as mem, CollectiveCounter() as comm:
                with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
                    loss = model(ids, ids)
                loss.backward()
                clip_grad_norm_(model, ownership, 1.0)
                counted = {k: dict(getattr(comm, k)) for k in ("counts", "bytes", "ring_bytes")}
                opt.step()
                opt.zero_grad(set_to_none=True)
            peaks.append(mem.peak_bytes - before.entry_bytes)
        # the lower of two steady steps: an overlapped all-reduce that a loaded machine finishes
        # late keeps its buffers a little longer now and then (+10.2% once in a full CI run)
        out.append({"peak": min(peaks[1:]), "entry": mem.entry_bytes - before.entry_bytes,
                    "comm": counted})
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_predictions_match_measurements(ranks, n):
    """On every rank: the predicted peak of a training step (forward, backward, grad norm, AdamW)
    is within 10% of the measured one, and the predicted collectives equal the counted ones
    exactly (calls, payload and ring bytes per kind). Each case at two world sizes (``AT``)."""
    cases = [CASES[i] for i in AT[n]]
    results = ranks(n).run(_measure, cases)
    for rank, per_case in enumerate(results):
        for (cfg_d, sp, bf16, recompute, optimizer), got in zip(cases, per_case, strict=True):
            shape = gpt_shape(GPTConfig(**cfg_d))
            what = (f"rank {rank}/{n} {cfg_d} sp={sp} bf16={bf16} recompute={recompute} "
                    f"AdamW {optimizer}")
            mem = tensorpar_memory(Step(shape, n, B, T, "bf16-autocast" if bf16 else "fp32", sp,
                                        "full" if recompute else "none",
                                        optimizer=optimizer), rank)
            # measured (3 runs, 2026-11-27, torch 2.13 CPU): entry at most 0.24% off, the peak
            # 4.9% (vocab 97, TP=3); 1.7% at most at TP=1, 2 and 4
            assert got["entry"] == pytest.approx(mem.weights + mem.optimizer, rel=0.02), what
            assert got["peak"] == pytest.approx(mem.total, rel=0.10), (what, got, mem)
            comm = predicted_comm(shape, B, T, n, sp, "bf16" if bf16 else "fp32",
                                  "full" if recompute else "none")
            assert got["comm"] == {k: comm[k] for k in ("counts", "bytes", "ring_bytes")}, what


def test_published_numbers():
    """Llama-2-7B has 6.74B parameters (28 GB of fp32 weights, 14 GB in 16-bit); the other
    presets have their published sizes."""
    sizes = {"gpt2": 124.4e6, "gpt2-xl": 1557.6e6, "llama-2-7b": 6.738e9,
             "llama-2-13b": 13.016e9, "llama-2-70b": 68.977e9, "llama-3-8b": 8.030e9,
             "llama-3-70b": 70.554e9}
    for name, params in sizes.items():  # measured 3e-4 off at most (gpt2: 124.4 of 124.44M)
        assert preset(name).params() == pytest.approx(params, rel=1e-3), name
    p = preset("llama-2-7b").params()
    assert round(4 * p / 1e9) == 27 and round(2 * p / 1e9, 1) == 13.5  # "28 GB" is 7e9 x 4


def test_hf_config_and_split():
    """An HF Llama config.json gives the Llama shape; column-then-row moves the fewest bytes."""
    hf = {"model_type": "llama", "vocab_size": 32000, "num_hidden_layers": 32,
          "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32,
          "intermediate_size": 11008}
    assert shape_from_hf_config(hf, "x").params() == preset("llama-2-7b").params()
    rows = mlp_split_comparison(1, 1024, 1024, 4096, 4)
    assert rows[0]["split"].startswith("column-then-row")
    assert rows[0]["ring_bytes"] * 2 < rows[1]["ring_bytes"]


def _cli(*argv):
    ap = argparse.ArgumentParser()
    plan_cli.add_parser(ap.add_subparsers())
    args = ap.parse_args(["plan", *argv])
    return args.func(args)


def test_cli(capsys, tmp_path):
    """--json parses and names the smallest fitting TP size; the table prints; a PNG is written;
    bad input gets one line."""
    png = tmp_path / "plan.png"
    assert _cli("--model", "llama-2-7b", "--tp", "1,2,4,8", "--dtype", "bf16", "--seq", "4096",
                "--device-memory", "80GB", "--json", "--split", "--png", str(png)) == 0
    data = json.loads(capsys.readouterr().out)
    fits = [r["tp"] for r in data["rows"] if r["fits"]]
    assert fits and str(min(fits)) in data["verdict"]["bf16"] and png.stat().st_size > 0
    assert data["split"][0]["split"].startswith("column-then-row")
    assert _cli("--model", "gpt2", "--tp", "2") == 0
    assert "smallest that fits" in capsys.readouterr().out
    manifest = tmp_path / "manifest.json"  # a checkpoint's: its run's batch and sequence
    manifest.write_text(json.dumps({"config": {"n_layer": 2, "dim": 64, "n_head": 4,
                                               "n_kv_head": 2, "vocab_size": 256},
                                    "train": {"batch_size": 3, "seq_len": 48}}))
    assert _cli("--config", str(manifest), "--tp", "2", "--optimizer", "for-loop", "--json") == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert (row["batch"], row["seq"]) == (3, 48)
    for bad, needle in ((["--model", "nope"], "llama-2-7b"), (["--tp", "33"], "--tp 33"),
                        (["--device-memory", "lots"], "--device-memory"),
                        (["--model", "gpt2", "--png", str(tmp_path / "no" / "x.png")], "x.png")):
        assert _cli(*bad) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


def test_cuda_kernels_keep_less():
    """On CUDA (``device="cuda"``) F.rms_norm's fused kernel keeps no fp32 x·rstd (two per block
    and the final norm), where the CPU's composite one does under autocast (in fp32 tensorpar's
    own CPU norm keeps none either), and in fp32 the memory-efficient attention's output is the
    output projection's input; under bf16 cuDNN's output is copied, as on CPU. Measured on an
    H100 (torch 2.11, issue 15): benchmarks/saved_activations.py --device cuda --step."""
    shape = gpt_shape(GPTConfig(vocab_size=256, n_layer=16, dim=2048, n_head=16, n_kv_head=4))
    B, T, N, D = 8, 2048, 8 * 2048, 2048
    for dtype, attention_copy, norm_copies in (("fp32", N * D * 4, 0),
                                               ("bf16-autocast", 0, 2 * shape.n_layer + 1)):
        cpu = tensorpar_memory(Step(shape, 1, B, T, dtype, device="cpu"))
        cuda = tensorpar_memory(Step(shape, 1, B, T, dtype, device="cuda"))
        saved = norm_copies * N * D * 4 + shape.n_layer * attention_copy
        assert cpu.activations - cuda.activations == saved, dtype
    # the H100 measurements of issue 15 (GiB, a whole tensorpar train step): within 2%
    # (planned 0.7% to 1.0% off them)
    for dtype, fused, recompute, measured in (("bf16-autocast", True, "none", 31.56),
                                              ("bf16-autocast", False, "none", 34.56),
                                              ("bf16-autocast", True, "full", 12.36),
                                              ("fp32", True, "none", 46.19)):
        planned = tensorpar_memory(Step(shape, 1, B, T, dtype, recompute=recompute, fused=fused,
                                        device="cuda")).total / 2**30
        assert planned == pytest.approx(measured, rel=0.02), (dtype, fused, recompute, planned)
    with pytest.raises(ValueError, match="device 'tpu'"):
        tensorpar_memory(Step(shape, 1, B, T, "fp32", device="tpu"))
    assert _cli("--model", "llama-2-7b", "--tp", "1", "--device", "cuda", "--json") == 0
