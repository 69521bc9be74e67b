"""The row side of a block as one autograd op (``fused=True``, without sequence parallelism).

The row-parallel matmul and its forward all-reduce (g) together: the partial product is made
inside the op, so it is reduced in place, without the copy that ``reduce_from_tp`` makes of a
tensor it did not create. Backward is local, as g's is. The column side is ``fused.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from tensorpar.parallel.collectives import start_all_reduce
from tensorpar.parallel.fused import autocast_cast
from tensorpar.runtime.groups import tp_size


class _FusedRow(torch.autograd.Function):
    """forward: the row-parallel matmul, then all-reduce of its product; backward: local."""

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.x_dtype = x.dtype
        cast = autocast_cast(x.device.type)  # what autocast's linear would compute
        x, weight = cast(x), cast(weight)
        y = F.linear(x, weight)  # (B, T, out): partial sums, made here and referenced nowhere
        if tp_size(group) > 1:
            y = start_all_reduce(y, group)()  # in place (eager)
        ctx.save_for_backward(x, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_dx, need_dw, _ = ctx.needs_input_grad
        dx = torch.matmul(dy, weight).to(ctx.x_dtype) if need_dx else None
        dw = dy.reshape(-1, dy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])) if need_dw else None
        return dx, dw, None


def fused_row(x: torch.Tensor, weight: torch.Tensor,
              group: ProcessGroup | None = None) -> torch.Tensor:
    """``reduce_from_tp(F.linear(x, weight))`` with the all-reduce done in place on the product.

    x: (..., in_i) this rank's input shard; weight: (out, in_i). Returns the summed (..., out).
    """
    return _FusedRow.apply(x, weight, group)
