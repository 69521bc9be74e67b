"""How the training step's math runs: under ``torch.compile`` (``tensorpar train --compile``) and
with TF32 matmuls on CUDA (``--tf32``). Neither changes what is trained or saved.

``--compile``: the step calls ``torch.compile(model, backend=--compile-backend)`` for the forward
and the loss; the backward runs through AOT autograd's compiled backward graph. The compiled wrapper
is only called, never saved: checkpoints, the optimizer, the gradient clipping and the shard
ownership all use the model itself, so parameter names stay plain (no ``_orig_mod.`` prefix) and a
run saved with ``--compile`` resumes without it and the other way round. Where dynamo cannot trace
(a graph break), the graph is split and that part runs eagerly: the losses stay eager's to fp32
rounding either way (``tests/train/test_compile_train.py``). The first step compiles (with inductor,
seconds on a GPU to a minute on a CPU; ``aot_eager`` generates no code: quick, what the CPU tests
use). The step whose collectives and memory the summary reports (the run's second) runs eagerly,
since its counters are TorchDispatchModes, and every other step runs compiled (see
:func:`loss_function`: the wrapper must not hand dynamo a frame under one). Refused, in one line
before any rank starts: TP > 1 in the GPU test mode (``--device cuda``), see
:func:`check_compile_device`.

``--tf32``: fp32 matmuls (and cuDNN convolutions) on CUDA may run on TF32 tensor cores, set on
every rank for the run and restored after. TF32 keeps a 10-bit mantissa (fp32: 23), so each
product is rounded to about 1e-3 relative instead of fp32's 1e-7 (sums still accumulate in
fp32); on an H100 fp32 matmuls run several times faster. Only ``--dtype fp32`` on a GPU is
affected: on the CPU it does nothing (a note says so), and under bf16 autocast the model's
matmuls run in bf16 already.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode


def check_compile_backend(name: str) -> None:
    """Refuse, in one line, a ``--compile-backend`` this torch does not know."""
    import torch._dynamo

    if name not in torch._dynamo.list_backends(exclude_tags=()):
        usual = ", ".join([*torch._dynamo.list_backends(), "aot_eager"])
        raise ValueError(f"--compile-backend {name!r} is not a backend of torch.compile in torch "
                         f"{torch.__version__} (e.g. {usual})")


def check_compile_device(tp: int, device: str | None) -> None:
    """Refuse ``--compile`` where it crashes: TP > 1 in the GPU test mode (``--device cuda``,
    gloo on CUDA). Compiled graphs all-gather through torch's functional collectives
    (``parallel/collectives.py``), and over gloo their all-gather segfaults on CUDA tensors
    (torch 2.11 on an H100, in eager code too; all-reduce and reduce-scatter work)."""
    if tp > 1 and device == "cuda":
        raise ValueError(f"--compile at --tp {tp} with --device cuda (gloo on CUDA): torch's "
                         "functional all-gather, which compiled graphs use, crashes over gloo on "
                         "CUDA tensors; compile at --tp 1, or with a GPU per rank (NCCL)")


def loss_function(model: torch.nn.Module, compile: bool, backend: str,
                  eager_random: bool = False) -> Callable:
    """What the step calls for the loss: ``model`` itself, or compiled (never saved: see the
    module docstring). ``eager_random``: inductor draws random numbers with torch's own ops
    (``fallback_random``), the masks eager draws from the same generators, so that a step run
    eagerly (below) draws what its compiled twin would: for a model whose dropout calls torch's
    generators (an HF model; the GPT's is an op of its own, ``parallel/dropout.py``).

    Compiled, a call made under a TorchDispatchMode (``CollectiveCounter``; ``MemoryMeter`` on
    the CPU) runs ``model`` itself: dynamo compiles no frame entered under such a mode, and it
    then marks the frame's code to be skipped for good (torch 2.13, ``ConvertFrameReturn``'s
    default), so every later call, long after the mode has gone, would run eagerly too."""
    if not compile:
        return model
    options = {"fallback_random": True} if eager_random and backend == "inductor" else None
    compiled = torch.compile(model, backend=backend, options=options)

    def loss(*args, **kwargs):
        return (model if is_in_torch_dispatch_mode() else compiled)(*args, **kwargs)

    return loss


def tf32_note(tf32: bool, dtype: str, device_type: str) -> str | None:
    """Why ``--tf32`` changes nothing for this run, or None when it applies."""
    if tf32 and device_type != "cuda":
        return ("--tf32 does nothing here: the ranks run on the CPU, whose fp32 matmuls stay "
                "fp32 (TF32 is a format of NVIDIA GPUs' tensor cores)")
    if tf32 and dtype != "fp32":
        return (f"--tf32 affects fp32 matmuls only: under --dtype {dtype} autocast runs the "
                "model's matmuls in bf16 already")
    return None


@contextmanager
def tf32_matmuls(enabled: bool, device: torch.device) -> Iterator[None]:
    """Within the block, fp32 matmuls and cuDNN convolutions on CUDA may use TF32 (when
    ``enabled`` and ``device`` is a GPU); the previous settings come back on exit, since a pool's
    ranks run other jobs after this one. torch's own flags (``allow_tf32``) are process-wide."""
    if not (enabled and device.type == "cuda"):
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = matmul.allow_tf32, cudnn.allow_tf32
    with warnings.catch_warnings():  # newer torch suggests its fp32_precision API instead
        warnings.simplefilter("ignore", UserWarning)
        matmul.allow_tf32 = cudnn.allow_tf32 = True
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            matmul.allow_tf32, cudnn.allow_tf32 = before
