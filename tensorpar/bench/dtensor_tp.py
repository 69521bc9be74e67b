"""PyTorch's own tensor parallel (DTensor, ``parallelize_module``) as a benchmark contender."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tensorpar.bench.workload import DenseLlama, StepFn, Workload, make_optimizer, mixed_precision


def setup_dtensor(work: Workload, state: dict[str, torch.Tensor], group: ProcessGroup | None,
                  device: torch.device, sequence_parallel: bool = False) -> StepFn:
    """PyTorch's tensor parallel on DenseLlama, the way torchtitan shards Llama.

    Heads: q/k/v colwise, o rowwise; MLP: gate/up colwise, down rowwise; the embedding rowwise
    (its vocabulary rows split, input replicated ids); the head colwise with vocab-sharded
    DTensor logits, consumed by ``loss_parallel`` (the logits are never gathered). Under SP the
    norms are ``SequenceParallel`` and each attention / MLP input is gathered by
    ``PrepareModuleInput``; the rowwise outputs become reduce-scatters onto sequence shards.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    group = group or dist.group.WORLD
    n = dist.get_world_size(group)
    uneven = [f"--{k.replace('_', '-')} {getattr(work, k)}" for k in ("n_head", "n_kv_head")
              if getattr(work, k) % n]
    if uneven:  # DTensor's colwise q/k/v need whole heads per rank (tensorpar shares KV heads)
        raise ValueError(f"dtensor: {' and '.join(uneven)} "
                         f"{'do' if len(uneven) > 1 else 'does'} not divide by --tp {n} (its "
                         "column-parallel q/k/v need whole heads on each rank)")
    mesh = DeviceMesh.from_group(group, device.type)
    model = DenseLlama(work, state).to(device)
    residual = Shard(1) if sequence_parallel else Replicate()  # layout between the blocks
    top = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        "lm_head": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.blocks:
        plan = {
            "attn.q_proj": ColwiseParallel(),
            "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(output_layouts=residual),
            "mlp.gate": ColwiseParallel(),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=residual),
        }
        if sequence_parallel:
            plan |= {
                "attn_norm": SequenceParallel(),
                "attn": PrepareModuleInput(input_layouts=(Shard(1), None),
                                           desired_input_layouts=(Replicate(), None)),
                "mlp_norm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                          desired_input_layouts=(Replicate(),)),
            }
        parallelize_module(block, mesh, plan)
    # without SP the norms keep plain tensors, and one fused op cannot mix them with DTensors
    params = list(model.parameters())
    groups = [{"params": [p for p in params if isinstance(p, DTensor) == is_dt]}
              for is_dt in (True, False)]
    opt = make_optimizer([g for g in groups if g["params"]], work)

    def step(ids_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        # loss_parallel must cover the backward too: it patches the loss's gradient ops
        with loss_parallel():
            with mixed_precision(device):
                loss = model(ids_BT, targets_BT)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().full_tensor()

    return step
