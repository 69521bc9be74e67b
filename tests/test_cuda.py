"""The CUDA/NCCL path: skipped cleanly on machines without a GPU (CI has none)."""

import pytest
import torch

from tensorpar import RankPool
from tensorpar.transformer.reference import BlockConfig
from tensorpar.transformer.verify import report, verify_rank

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("sp", [False, True])
def test_verify_on_gpus_with_nccl(sp):
    """The verification model on GPUs with NCCL, at world size 1 and, with 2+ GPUs, at 2."""
    cfg = BlockConfig()
    for n in sorted({1, min(2, torch.cuda.device_count())}):
        with RankPool(n, backend="nccl") as pool:
            assert report(pool.run(verify_rank, cfg, sp, 0), cfg, n, sp)


def test_train_and_generate_on_gpu(tmp_path):
    """``tensorpar train --dtype bf16`` on the GPUs (NCCL with 2+), resumed, then generation."""
    import subprocess
    import sys

    n = min(2, torch.cuda.device_count())
    tiny = ["--n-layer", "2", "--dim", "64", "--n-head", "4", "--n-kv-head", "2",
            "--seq-len", "64", "--batch-size", "4"]
    train = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--tp", str(n),
                            "--steps", "10", "--dtype", "bf16", "--out", str(tmp_path), *tiny],
                           capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stdout + train.stderr
    # resuming puts fused AdamW's step back on the GPU (on the CPU its kernel would misread it)
    resumed = subprocess.run([sys.executable, "-m", "tensorpar", "train", "--tp", str(n),
                              "--steps", "12", "--resume", "--dtype", "bf16", "--out",
                              str(tmp_path), *tiny], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    gen = subprocess.run([sys.executable, "-m", "tensorpar", "generate", "--ckpt", str(tmp_path),
                          "--tp", str(n), "--prompt", "The ", "--max-new-tokens", "16"],
                         capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0 and gen.stdout.startswith("The "), gen.stderr
