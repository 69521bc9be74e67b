"""``tensorpar bench``: the same Llama-like model trained by tensorpar, PyTorch's DTensor tensor
parallel, megatron-core and plain PyTorch, timed side by side (see ``benchmarks/README.md``)."""

from tensorpar.bench.spec import BenchSpec, DenseLlama, StepFn, batch, dense_state, make_optimizer

__all__ = ["BenchSpec", "DenseLlama", "StepFn", "batch", "dense_state", "make_optimizer"]
