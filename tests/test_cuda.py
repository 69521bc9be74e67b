"""The CUDA path. NCCL at world size 1 and, with 2+ GPUs, at 2; and TP = 2 and 4 on one GPU
through the test mode that puts every rank on a GPU over gloo (``tensorpar --device cuda``,
``RankPool(n, device="cuda")``; NCCL refuses two ranks on one GPU). Without a GPU (CI has none)
these are skipped, and only the refusal of ``--device cuda`` is checked.

On an H100 (torch 2.11): ``PYTHONPATH=. python -m pytest -q tests/test_cuda.py``.
"""

import json

import pytest
import torch
import torch.distributed as dist

from tensorpar import RankPool
from tensorpar.cli.verify import report, verify_rank
from tensorpar.runtime.groups import device_for
from tensorpar.transformer.reference import BlockConfig

from tests_common import read_metrics, tensorpar_cli

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# 2 layers, width 64; 10 bf16 steps, then resumed to 12 (one schedule for all: decay to 12)
TINY = ["--n-layer", "2", "--dim", "64", "--n-head", "4", "--n-kv-head", "2", "--seq-len", "64",
        "--batch-size", "4", "--warmup-steps", "3", "--lr-decay-steps", "12", "--save-every", "5"]


def _where(group=None):
    return str(device_for(group)), dist.get_backend(group)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_one_line():
    """``--device cuda`` where torch sees no GPU: one line, exit 2, no rank started; the same
    for RankPool(device="cuda"), before it spawns."""
    r = tensorpar_cli("--device", "cuda", "verify", "--tp", "2", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"tensorpar verify: --device cuda (TENSORPAR_DEVICE=cuda): no CUDA GPU is visible to "
        f"torch {torch.__version__} here; leave it out to run on the CPU"]
    with pytest.raises(ValueError, match="no CUDA GPU is visible"):
        RankPool(2, device="cuda")


def test_device_cpu_keeps_every_rank_on_the_cpu():
    """``RankPool(n, device="cpu")``: gloo on the CPU, also where there are GPUs."""
    with RankPool(1, device="cpu") as pool:
        assert pool.run(_where) == [("cpu", "gloo")]


@gpu
@pytest.mark.parametrize("sp", [False, True])
def test_verify_on_gpus_with_nccl(sp):
    """The verification model on GPUs with NCCL, at world size 1 and, with 2+ GPUs, at 2."""
    cfg = BlockConfig()
    for n in sorted({1, min(2, torch.cuda.device_count())}):
        with RankPool(n, backend="nccl") as pool:
            assert report(pool.run(verify_rank, cfg, sp, 0), cfg, n, sp)


@gpu
@pytest.mark.parametrize("sp", [False, True])
def test_verify_at_tp_2_and_4_on_one_gpu(sp):
    """The test mode: 2 and 4 ranks over gloo, each on ``cuda:(local rank % GPUs)``; fp32
    outputs and gradients match the dense block, collective counts the analytic ones."""
    cfg = BlockConfig()
    for n in (2, 4):
        with RankPool(n, device="cuda", check_collectives=True) as pool:
            count = torch.cuda.device_count()
            assert pool.run(_where) == [(f"cuda:{r % count}", "gloo") for r in range(n)]
            assert report(pool.run(verify_rank, cfg, sp, 0), cfg, n, sp)


def _train(out, tp, steps, *flags, device=True, dtype="bf16"):
    r = tensorpar_cli(*(["--device", "cuda"] if device else []), "train", "--tp", tp, "--steps",
                      steps, "--dtype", dtype, "--out", out, *TINY, *flags, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return [row["loss"] for row in read_metrics(out)]


def _generate(ckpt, tp):
    r = tensorpar_cli("--device", "cuda", "generate", "--ckpt", ckpt, "--tp", tp, "--prompt",
                      "The with statement", "--max-new-tokens", "24", timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("The with statement"), r.stderr
    return r.stdout


@gpu
def test_train_resume_and_generate_at_tp_2_and_4_on_one_gpu(tmp_path):
    """bf16 training at TP=2 and 4 on one GPU (the test mode), resumed from step 10 to 12,
    follows TP=1 within 5e-4 relative loss at every step (4.4e-5 measured on an H100); greedy
    text from the TP=4 checkpoint is the same at TP=2 and TP=1."""
    ref = _train(tmp_path / "tp1", 1, 12)
    for tp in (2, 4):
        run = tmp_path / f"tp{tp}"
        _train(run, tp, 10)
        losses = _train(run, tp, 12, "--resume")
        assert len(losses) == len(ref) == 12
        errors = [abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True)]
        assert max(errors) <= 5e-4, f"TP={tp}: {errors}"
        manifest = json.loads((run / "step-00000012" / "manifest.json").read_text())
        assert manifest["tp_size"] == tp and manifest["step"] == 12
    assert _generate(tmp_path / "tp4", 2) == _generate(tmp_path / "tp4", 1)


@gpu
def test_train_and_generate_on_gpus_with_nccl(tmp_path):
    """``tensorpar train --dtype bf16`` on the GPUs (NCCL with 2+), resumed, then generation."""
    n = min(2, torch.cuda.device_count())
    _train(tmp_path, n, 10, device=False)
    # resuming puts fused AdamW's step back on the GPU (on the CPU its kernel would misread it)
    _train(tmp_path, n, 12, "--resume", device=False)
    gen = tensorpar_cli("generate", "--ckpt", tmp_path, "--tp", n, "--prompt", "The ",
                        "--max-new-tokens", "16", timeout=300)
    assert gen.returncode == 0 and gen.stdout.startswith("The "), gen.stderr


@gpu
def test_compile_and_tf32_on_a_gpu(tmp_path):
    """fp32 at TP=1 on the GPU: ``--compile`` (inductor) follows eager to fp32 rounding, with
    ``--dropout --recompute`` too (the masks: ``tensorpar::dropout_mask`` on CUDA, its key on
    the CPU); ``--tf32`` moves the losses by TF32's rounding, well under 1e-2 relative. At TP > 1
    in the test mode ``--compile`` is refused: torch's functional all-gather crashes over gloo
    on CUDA (train/compute.py)."""
    eager = _train(tmp_path / "eager", 1, 6, dtype="fp32")
    compiled = _train(tmp_path / "compiled", 1, 6, "--compile", dtype="fp32")
    tf32 = _train(tmp_path / "tf32", 1, 6, "--tf32", dtype="fp32")
    drop = ("--dropout", "0.1", "--recompute")
    dropped = _train(tmp_path / "dropped", 1, 6, *drop, dtype="fp32")
    dropped_compiled = _train(tmp_path / "dropped-compiled", 1, 6, *drop, "--compile",
                              dtype="fp32")
    assert abs(dropped[0] - eager[0]) > 1e-4 * abs(eager[0])  # the masks change the loss
    for name, losses, ref, tol in (("--compile", compiled, eager, 1e-5),
                                   ("--tf32", tf32, eager, 1e-2),
                                   ("--compile --dropout", dropped_compiled, dropped, 1e-5)):
        errors = [abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True)]
        assert max(errors) <= tol, f"{name}: {errors}"
    r = tensorpar_cli("--device", "cuda", "train", "--tp", 2, "--compile", "--out",
                      tmp_path / "refused", *TINY, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "functional all-gather" in r.stderr and not (tmp_path / "refused").exists()


@gpu
def test_bench_on_one_gpu(tmp_path):
    """``tensorpar bench --device cuda`` on a tiny model: the one-GPU contenders (tensorpar at
    TP=1 and the dense model, eager and compiled) run in bf16 autocast and follow the dense
    model's losses to bf16 rounding; the GPU's matmul peak is measured; each row has model
    TFLOP/s and an MFU in (0, 1); a TP contender with more ranks than GPUs is skipped."""
    from tensorpar.bench.outputs import table
    from tensorpar.bench.runner import RunPlan, run_bench
    from tensorpar.bench.workload import Workload

    work = Workload(dim=128, n_head=4, n_kv_head=2, n_layer=2, vocab_size=512, seq_len=64,
                     batch_size=4)
    names = ["tensorpar-tp1", "tensorpar-tp1-c", "dense-1t", "dense-c", "tensorpar", "megatron"]
    plan = RunPlan(repeats=2, steps_per_repeat=2, warmup=2, tp=2, device="cuda")
    results = run_bench(work, names, plan, log=lambda s: None)
    assert results["errors"] == [] and results["peak_flops"] > 1e12
    rows = {r["name"]: r for r in results["contenders"]}
    assert rows["megatron"]["status"].startswith("skipped: this bench runs it on the CPU")
    if torch.cuda.device_count() < 2:
        assert rows["tensorpar"]["status"].startswith("skipped: needs 2 GPUs")
    for name in names[:4]:
        row = rows[name]
        assert row["status"] == "ok" and row["loss_max_rel_diff"] <= 2e-2, (name, row)
        assert 0 < row["mfu"] < 1 and row["model_tflops"] > 0, (name, row)
        assert max(row["peak_bytes_per_rank"]) > 0
    md = table(results)
    assert "| model TFLOP/s | MFU |" in md and "bf16 matmul peak measured" in md
