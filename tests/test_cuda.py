"""The CUDA/NCCL path: skipped cleanly on machines without a GPU (CI has none)."""

import pytest
import torch

from tensorpar import RankPool
from tensorpar.reference import BlockConfig
from tensorpar.verify import report, verify_rank

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("sp", [False, True])
def test_verify_on_gpus_with_nccl(sp):
    """The verification model on GPUs with NCCL, at world size 1 and, with 2+ GPUs, at 2."""
    cfg = BlockConfig()
    for n in sorted({1, min(2, torch.cuda.device_count())}):
        with RankPool(n, backend="nccl") as pool:
            assert report(pool.run(verify_rank, cfg, sp, 0), cfg, n, sp)
