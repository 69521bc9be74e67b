"""``tensorpar bench``: the same Llama-like model trained by tensorpar, PyTorch's DTensor tensor
parallel, megatron-core and plain PyTorch, timed side by side (see ``benchmarks/README.md``).

Imports any package but the command line; nothing in tensorpar imports it but the CLI
(``tensorpar/cli/bench.py``).
"""

from tensorpar.bench.workload import (
    DenseLlama,
    StepFn,
    Workload,
    batch,
    dense_state,
    make_optimizer,
)

__all__ = ["Workload", "DenseLlama", "StepFn", "batch", "dense_state", "make_optimizer"]
