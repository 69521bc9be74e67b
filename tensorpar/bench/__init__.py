"""``tensorpar bench``: the same Llama-like model trained by tensorpar, PyTorch's DTensor tensor
parallel, megatron-core and plain PyTorch, timed side by side (see ``benchmarks/README.md``).

Imports any package but the command line (``bench_cli`` is a command-line module); nothing in
tensorpar imports it but the CLI.
"""

from tensorpar.bench.spec import BenchSpec, DenseLlama, StepFn, batch, dense_state, make_optimizer

__all__ = ["BenchSpec", "DenseLlama", "StepFn", "batch", "dense_state", "make_optimizer"]
