"""The contenders of ``tensorpar bench``: the same model and step, built by each library.

Each contender is a ``setup(work, state, group) -> step`` run on every rank of its pool (see
``work.py``), plus where it runs::

    name               ranks  threads  pool                what it is
    tensorpar          tp     1        the TP pool         tensorpar's GPT (fused, overlapped)
    tensorpar-sp       tp     1        the TP pool         the same with sequence parallelism
    tensorpar-sp-keep  tp     1        the TP pool         SP, keep_gathered_input=True
    tensorpar-unfused  tp     1        the TP pool         fused=False: plain layers, no overlap
    tensorpar-c        tp     1        the TP pool         tensorpar under torch.compile
    tensorpar-sp-c     tp     1        the TP pool         tensorpar-sp under torch.compile
    tensorpar-tp1      1      1        a one-rank pool     GPT at TP=1 (vs dense-1t: its overhead)
    tensorpar-tp1-c    1      1        a one-rank pool     the same under torch.compile
    hf-llama           tp     1        the TP pool         transformers' Llama via parallelize
    hf-llama-sp        tp     1        the TP pool         the same with sequence parallelism
    hf-qwen3moe        tp     1        the TP pool         transformers' Qwen3-MoE via parallelize
    hf-qwen3moe-transformers  tp  1    the TP pool         the same model, transformers' TP + EP
    hf-qwen3moe-1      1      1        a one-rank pool     the same model (their loss reference)
    dtensor            tp     1        the TP pool         DenseLlama + parallelize_module
    dtensor-sp         tp     1        the TP pool         the same with SequenceParallel norms
    megatron           tp     1        a pool of its own   megatron-core (megatron_core.py)
    dense-1t           1      1        a one-rank pool     DenseLlama, one thread
    dense-Nt           1      cores    a one-rank pool     DenseLlama, one thread per core
    dense-c            1      cores    a one-rank pool     dense-Nt under torch.compile

Compiled contenders (``-c``) run the forward and the loss under ``torch.compile`` (the
backward through AOT autograd; the optimizer as everywhere); the first warmup step compiles.
On a GPU (``--device cuda``) threads do not matter: dense-1t and dense-Nt are the same model,
dense-c is its compiled twin; every forward runs in bf16 autocast there (``mixed_precision``).

Pools that are not running a contender wait on their task queue, so they take no CPU time.

A contender of another library that cannot run a configuration is reported as "skipped: <why>"
and the other rows stand: megatron-core says so before its own ranks are spawned
(``megatron_cannot_run``), DTensor by raising ValueError in its setup, on every rank of the TP
pool, before any collective. tensorpar's contenders and the dense ones are this
project's own code: the command line checks their configuration before any rank starts, so
their failing on the ranks is a bug, and fails the bench.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch.distributed import ProcessGroup

from tensorpar.bench.dtensor_tp import setup_dtensor
from tensorpar.bench.hf_llama import setup_hf_llama, setup_hf_llama_labels
from tensorpar.bench.hf_moe import setup_dense_moe, setup_tensorpar_moe, setup_transformers_moe
from tensorpar.bench.megatron_fits import check_megatron_fits
from tensorpar.bench.workload import DenseLlama, StepFn, Workload, make_optimizer, mixed_precision
from tensorpar.gpt.model import GPT
from tensorpar.train.compute import loss_function


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device,
                compile_backend: str | None = None) -> StepFn:
    """The step every contender of ours runs; with ``compile_backend``, the forward and the loss
    under ``torch.compile`` (the compiled wrapper is only called: the optimizer has the model's
    own parameters)."""
    forward = loss_function(model, compile_backend is not None, compile_backend)

    def step(ids_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        with mixed_precision(device):
            loss = forward(ids_BT, targets_BT)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def setup_tensorpar(work: Workload, state: dict[str, torch.Tensor], group: ProcessGroup | None,
                    device: torch.device, sequence_parallel: bool = False, fused: bool = True,
                    keep_gathered_input: bool = False, compile_backend: str | None = None
                    ) -> StepFn:
    """tensorpar's GPT on ``group``, each rank loading its slice of the dense weights."""
    kwargs = {"keep_gathered_input": True} if keep_gathered_input else {}
    if "fused" in inspect.signature(GPT).parameters:
        kwargs["fused"] = fused
    elif not fused:
        raise ValueError("this tensorpar has no GPT(fused=...) yet: tensorpar-unfused is the "
                         "tensorpar contender")
    model = GPT(work.gpt_config(), group, sequence_parallel, seed=work.seed, device=device,
                **kwargs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(p.tp_shard.take(state[name]))
    return _train_step(model, make_optimizer(model.parameters(), work), device, compile_backend)


def setup_dense(work: Workload, state: dict[str, torch.Tensor], group: ProcessGroup | None,
                device: torch.device, compile_backend: str | None = None) -> StepFn:
    """The unsharded plain-PyTorch model (the group is not used)."""
    model = DenseLlama(work, state).to(device)
    return _train_step(model, make_optimizer(model.parameters(), work), device, compile_backend)


def setup_megatron(work: Workload, state: dict[str, torch.Tensor],
                   group: ProcessGroup | None, device: torch.device) -> StepFn:
    """megatron-core's GPT (``tensorpar/bench/megatron_core.py``), imported only when used; on
    the CPU (``cpu_only``: ``device`` is the CPU)."""
    module = importlib.import_module("tensorpar.bench.megatron_core")
    return module.setup_megatron(work, state, group,
                                 make_optimizer=make_optimizer)


def transformers_missing(work: Workload, tp: int) -> str | None:
    """Why the hf-llama contenders cannot run here: transformers (the ``hf`` extra) missing."""
    if importlib.util.find_spec("transformers") is None:
        return "not installed (transformers: pip install tensorpar[hf])"
    return None


def megatron_cannot_run(work: Workload, tp: int) -> str | None:
    """Why the megatron contender cannot run ``work`` at TP ``tp`` here, or None when it can:
    checked before its ranks are spawned (and megatron imported), by the benchmark's parent."""
    if importlib.util.find_spec("megatron") is None or \
            importlib.util.find_spec("megatron.core") is None:
        return "not installed (megatron-core)"
    if importlib.util.find_spec("tensorpar.bench.megatron_core") is None:
        return "not installed (tensorpar/bench/megatron_core.py)"
    try:
        check_megatron_fits(work.gpt_config(), tp)
    except ValueError as e:
        return str(e)
    return None


@dataclass(frozen=True)
class Contender:
    """How to build one contender and where it runs.

    world: "tp" (the TP size) or 1. threads: torch threads per rank (0: one per core).
    own_pool: it needs processes of its own (megatron-core keeps global parallel state).
    cannot_run: ``(work, tp) -> why`` it cannot run that configuration here, None when it can;
    asked before any rank is spawned (a contender without one says so on its ranks, by raising
    ValueError in its setup).
    ours: this project's code (tensorpar, the dense model): a failure is a bug and fails the
    bench; another library's contender that fails is reported and skipped.
    compiled: its setup takes ``compile_backend`` (``--compile-backend``).
    cpu_only: this bench runs it on the CPU only (skipped under ``--device cuda``).
    reference: the contender whose losses this one's are compared with (run untimed when not
    asked for); None: the bench's reference, ``dense-1t``. A model other than the bench's GPT
    (the Qwen3-MoE rows) names its own.
    """

    name: str
    setup: Callable[..., StepFn]
    world: str | int
    threads: int = 1
    own_pool: bool = False
    cannot_run: Callable[[Workload, int], str | None] | None = None
    about: str = ""
    ours: bool = True
    compiled: bool = False
    cpu_only: bool = False
    reference: str | None = None

    def ranks(self, tp: int) -> int:
        return tp if self.world == "tp" else int(self.world)

    def n_threads(self) -> int:
        return self.threads or os.cpu_count() or 1

    def label(self, tp: int) -> str:
        """ranks x threads, e.g. "2x1"."""
        return f"{self.ranks(tp)}x{self.n_threads()}"


CONTENDERS: dict[str, Contender] = {c.name: c for c in [
    Contender("tensorpar", partial(setup_tensorpar), "tp",
              about="tensorpar GPT (fused: overlapped backward all-reduce)"),
    Contender("tensorpar-sp", partial(setup_tensorpar, sequence_parallel=True), "tp",
              about="tensorpar GPT with sequence parallelism"),
    Contender("tensorpar-sp-keep", partial(setup_tensorpar, sequence_parallel=True,
                                           keep_gathered_input=True), "tp",
              about="tensorpar-sp keeping the gathered column inputs (no backward re-gather)"),
    Contender("tensorpar-unfused", partial(setup_tensorpar, fused=False), "tp",
              about="tensorpar GPT with the plain layers (fused=False)"),
    Contender("tensorpar-c", partial(setup_tensorpar), "tp", compiled=True,
              about="tensorpar GPT under torch.compile"),
    Contender("tensorpar-sp-c", partial(setup_tensorpar, sequence_parallel=True), "tp",
              compiled=True, about="tensorpar GPT with sequence parallelism under torch.compile"),
    Contender("tensorpar-tp1", partial(setup_tensorpar), 1,
              about="tensorpar GPT at TP=1, one process"),
    Contender("tensorpar-tp1-c", partial(setup_tensorpar), 1, compiled=True,
              about="tensorpar GPT at TP=1 under torch.compile"),
    Contender("hf-llama", partial(setup_hf_llama), "tp", cannot_run=transformers_missing,
              about="transformers' LlamaForCausalLM under tensorpar.parallelize"),
    Contender("hf-llama-sp", partial(setup_hf_llama, sequence_parallel=True), "tp",
              cannot_run=transformers_missing,
              about="hf-llama with sequence parallelism"),
    Contender("hf-llama-labels", partial(setup_hf_llama_labels), "tp",
              cannot_run=transformers_missing,
              about="hf-llama as a user's loop steps it: default plan, model(..., labels=).loss"),
    Contender("hf-llama-lora", partial(setup_hf_llama_labels, lora_rank=8), "tp",
              cannot_run=transformers_missing,
              about="hf-llama-labels training LoRA adapters (rank 8) on every block projection"),
    Contender("hf-qwen3moe", setup_tensorpar_moe, "tp", cannot_run=transformers_missing,
              reference="hf-qwen3moe-1",
              about="transformers' Qwen3-MoE under tensorpar.parallelize (EP = the TP group)"),
    Contender("hf-qwen3moe-transformers", setup_transformers_moe, "tp", ours=False,
              cannot_run=transformers_missing, reference="hf-qwen3moe-1",
              about="the same Qwen3-MoE, transformers' own TP + EP (DistributedConfig)"),
    Contender("hf-qwen3moe-1", setup_dense_moe, 1, cannot_run=transformers_missing,
              reference="hf-qwen3moe-1", about="the same Qwen3-MoE, one process, one thread"),
    Contender("dtensor", partial(setup_dtensor), "tp", ours=False,
              about="PyTorch DTensor TP (parallelize_module, loss_parallel)"),
    Contender("dtensor-sp", partial(setup_dtensor, sequence_parallel=True), "tp", ours=False,
              about="PyTorch DTensor TP with SequenceParallel"),
    Contender("megatron", setup_megatron, "tp", own_pool=True, cannot_run=megatron_cannot_run,
              ours=False, cpu_only=True, about="megatron-core GPT on gloo"),
    Contender("dense-1t", setup_dense, 1, threads=1,
              about="plain PyTorch, one process, one thread"),
    Contender("dense-Nt", setup_dense, 1, threads=0,
              about="plain PyTorch, one process, one thread per core"),
    Contender("dense-c", setup_dense, 1, threads=0, compiled=True,
              about="plain PyTorch under torch.compile, one process, one thread per core"),
]}

DEFAULT = ("tensorpar", "tensorpar-sp", "tensorpar-unfused", "tensorpar-tp1", "hf-llama",
           "dtensor", "dtensor-sp", "megatron", "dense-1t", "dense-Nt")
COMPILED = ("tensorpar-c", "tensorpar-tp1-c", "dense-c")  # what --compile adds
# on GPUs: the TP contenders (skipped with fewer GPUs than --tp), the one-GPU ones, both compiled
DEFAULT_CUDA = ("tensorpar", "tensorpar-sp", "tensorpar-c", "dtensor", "tensorpar-tp1",
                "tensorpar-tp1-c", "dense-1t", "dense-c")


def parse_contenders(text: str) -> list[str]:
    """"a,b,c" -> names, each known, in the order given; ValueError naming an unknown one."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or not names:
        raise ValueError(f"--contenders: unknown {unknown or 'empty list'}; choose from "
                         f"{', '.join(CONTENDERS)}")
    return list(dict.fromkeys(names))
