"""tensorpar: Megatron-style tensor parallelism for PyTorch, exact against one device.

The packages, and the one direction their imports flow (each imports only those before it)::

    runtime      the ground floor: process groups, seeds, collective counting   \
    parallel     f/g collectives, column/row/vocab layers, loss, norms, dropout   | the core
    transformer  attention, MLP and MoE blocks, the dense reference              /
    ranks        local ranks, torchrun's ranks, signals, failures, check mode
    data         text, token shards, their writer (prepare), chat examples, packing, tokenizers
    checkpoint   sharded checkpoints that load at any TP size
    planner      memory and communication per rank, the memory meter
    mesh         the ("pp", "dp", "cp", "tp") DeviceMesh; FSDP2 / DDP; the expert groups
    gpt          tensorpar's GPT, its pipeline stages, generation
    hf           Hugging Face plans, parallelize, from_pretrained, LoRA, export
    train        the trainer: config, run, loop, the recipes, the report
    bench        tensorpar against DTensor, megatron-core and plain PyTorch
    cli          ``tensorpar``: one module per command, on top

The names below are the public API; each is imported when first used (``tensorpar.RankPool``,
``from tensorpar import RankPool``), so that ``import tensorpar`` costs nothing and
``python -m tensorpar`` can start its ranks' forkserver before it imports torch itself
(``ranks/forkserver.py``); the public names load torch only.
(``tests/test_layout.py`` checks this order by reading every import.)
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_WHERE = {
    "parallelize": "hf.parallelize", "from_pretrained": "hf.pretrained",
    "seed_dropout": "hf.dropout",
    "vocab_parallel_cross_entropy": "parallel.cross_entropy",
    "ParallelDropout": "parallel.dropout", "TensorParallelRNG": "parallel.dropout",
    "VocabParallelEmbedding": "parallel.embedding", "sum_grads_in_backward": "parallel.mappings",
    "ColumnParallelLinear": "parallel.linear", "RowParallelLinear": "parallel.linear",
    **dict.fromkeys(["copy_to_tp", "gather_from_sequence", "gather_from_tp", "reduce_from_tp",
                     "reduce_scatter_to_sequence", "scatter_to_sequence", "scatter_to_tp"],
                    "parallel.mappings"),
    "LayerNorm": "parallel.norm", "RMSNorm": "parallel.norm", "ShardSpec": "parallel.sharding",
    "naming_layers": "ranks.checking", "CollectiveCounter": "runtime.counting",
    "CollectiveMismatch": "ranks.failures", "init_tensor_parallel": "runtime.groups",
    "tp_rank": "runtime.groups", "tp_size": "runtime.groups", "RankError": "ranks.local",
    "RankPool": "ranks.local", "launch": "ranks.local",
    "data_parallel": "mesh.data_parallel", "init_parallel": "mesh.mesh",
    "ParallelSelfAttention": "transformer.attention", "ParallelMLP": "transformer.mlp",
    "MoEConfig": "transformer.moe", "ParallelMoE": "transformer.moe",
    "ExpertGroups": "transformer.expert_groups",
    "combine_from_experts": "parallel.expert_dispatch",
    "CPSequence": "transformer.context_parallel", "split_to_cp": "parallel.context",
    "gather_from_cp": "parallel.context",
    "dispatch_to_experts": "parallel.expert_dispatch",
}

__version__ = "0.1.0"
__all__ = sorted(_WHERE, key=str.lower)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'tensorpar' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"tensorpar.{_WHERE[name]}"), name)
    globals()[name] = value  # found here from now on
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))

