"""tensorpar: Megatron-style tensor parallelism for PyTorch, exact against one device.

The packages, and the one direction their imports flow (each imports only those before it)::

    runtime      process groups, launcher, collective counting, atomic output     \
    parallel     f/g collectives, column/row/vocab layers, loss, norms, dropout   | the core
    transformer  attention and MLP blocks, the dense reference, verify            /
    checkpoint   sharded checkpoints that load at any TP size                  (core)
    plan         memory and communication planner, memory meter                (core)
    scale        the ("dp", "tp") DeviceMesh; FSDP2 / DDP around a TP model    (core)
    gpt          the GPT, its data, trainer, report, generation  (core, checkpoint, plan, scale)
    hf           Hugging Face plans, parallelize, from_pretrained      (core, checkpoint, ...)
    bench        tensorpar against DTensor, megatron-core and plain PyTorch    (all above)
    cli          ``tensorpar`` and every package's ``cli`` module: on top

``import tensorpar`` imports torch only; the names below are the public API.
(``tests/test_layout.py`` checks this order by reading every import.)
"""

from tensorpar.hf.parallelize import parallelize
from tensorpar.hf.pretrained import from_pretrained
from tensorpar.parallel.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.parallel.dropout import ParallelDropout, TensorParallelRNG
from tensorpar.parallel.embedding import VocabParallelEmbedding
from tensorpar.parallel.grad_sync import sum_grads_in_backward
from tensorpar.parallel.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.parallel.mappings import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    scatter_to_tp,
)
from tensorpar.parallel.norm import LayerNorm, RMSNorm
from tensorpar.parallel.sharding import ShardSpec
from tensorpar.runtime.checking import naming_layers
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.runtime.failures import CollectiveMismatch
from tensorpar.runtime.groups import init_tensor_parallel, tp_rank, tp_size
from tensorpar.runtime.launch import RankError, RankPool, launch
from tensorpar.scale.data_parallel import data_parallel
from tensorpar.scale.mesh import init_parallel
from tensorpar.transformer.attention import ParallelSelfAttention
from tensorpar.transformer.mlp import ParallelMLP

__version__ = "0.1.0"

__all__ = [
    "CollectiveCounter", "CollectiveMismatch", "ColumnParallelLinear", "LayerNorm",
    "ParallelDropout", "ParallelMLP", "ParallelSelfAttention", "RankError", "RankPool", "RMSNorm",
    "RowParallelLinear", "ShardSpec", "TensorParallelRNG", "VocabParallelEmbedding", "copy_to_tp",
    "data_parallel", "from_pretrained", "gather_from_sequence", "gather_from_tp", "init_parallel",
    "init_tensor_parallel", "launch",
    "naming_layers", "parallelize", "reduce_from_tp", "reduce_scatter_to_sequence",
    "scatter_to_sequence", "scatter_to_tp", "sum_grads_in_backward", "tp_rank", "tp_size",
    "vocab_parallel_cross_entropy",
]
