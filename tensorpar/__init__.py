"""tensorpar: Megatron-style tensor parallelism for PyTorch, exact against one device."""

from tensorpar.attention import ParallelSelfAttention
from tensorpar.comm import (
    copy_to_tp,
    gather_from_sequence,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    scatter_to_tp,
)
from tensorpar.counting import CollectiveCounter
from tensorpar.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.distributed import init_tensor_parallel, tp_rank, tp_size
from tensorpar.dropout import ParallelDropout, TensorParallelRNG
from tensorpar.embedding import VocabParallelEmbedding
from tensorpar.grad_sync import sum_grads_in_backward
from tensorpar.hf import from_pretrained, parallelize
from tensorpar.launch import RankError, RankPool, launch
from tensorpar.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.mlp import ParallelMLP
from tensorpar.norm import LayerNorm, RMSNorm
from tensorpar.sharding import ShardSpec

__version__ = "0.1.0"

__all__ = [
    "CollectiveCounter", "ColumnParallelLinear", "LayerNorm", "ParallelDropout", "ParallelMLP",
    "ParallelSelfAttention", "RMSNorm", "RankError", "RankPool", "RowParallelLinear", "ShardSpec",
    "TensorParallelRNG", "VocabParallelEmbedding", "copy_to_tp", "gather_from_sequence",
    "from_pretrained", "gather_from_tp", "init_tensor_parallel", "launch", "parallelize",
    "reduce_from_tp",
    "reduce_scatter_to_sequence", "scatter_to_sequence", "scatter_to_tp", "sum_grads_in_backward",
    "tp_rank", "tp_size", "vocab_parallel_cross_entropy",
]
