"""A Hugging Face ``Qwen3MoeForCausalLM`` as a benchmark contender: tensorpar's ``parallelize``
against transformers' own tensor and expert parallelism, on the same model in the same ranks.

The bench's workload sets the shape (width, heads, layers, vocabulary, batches); every MLP is a
Qwen3-MoE block of ``EXPERTS`` routed experts, top ``TOP_K`` with the top-k weights renormalised,
each expert half the dense SwiGLU's hidden width. The weights are transformers' own seeded
initialisation (``work.seed``), the same on every rank and in every contender; the step is a
user's own loop, ``model(input_ids=ids, labels=ids, shift_labels=targets).loss``, backward and
the bench's AdamW. No router logits are asked for, so no load-balancing loss joins the loss.

    hf-qwen3moe-1             the dense model on one rank: the rows' loss reference
    hf-qwen3moe               ``tensorpar.parallelize(model, group=)``: attention by heads, the
                              routed experts cut across the group (EP = the TP group)
    hf-qwen3moe-transformers  ``from_pretrained(..., distributed_config=DistributedConfig(
                              tp_size=N, ep_size=N))``: transformers' DTensor TP plan for
                              attention and its expert-parallel plan for the experts

transformers' tensor parallelism loads from a checkpoint, so each rank writes the dense model
into a directory of its own and loads it back. Needs transformers
(the ``hf`` extra), imported when a contender is set up.
"""

from __future__ import annotations

import tempfile

import torch
from torch.distributed import ProcessGroup

from tensorpar.bench.hf_llama import labels_step
from tensorpar.bench.workload import StepFn, Workload, make_optimizer
from tensorpar.runtime.groups import tp_size

EXPERTS = 8
TOP_K = 2


def qwen3_moe_config(work: Workload):
    """The bench's model as a ``Qwen3MoeConfig``: every layer an MoE block."""
    import transformers

    cfg = work.gpt_config()
    return transformers.Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim,
        moe_intermediate_size=max(cfg.hidden_dim // 2, 1), num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
        head_dim=cfg.head_dim, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        output_router_logits=False, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=max(work.seq_len, 1), tie_word_embeddings=False,
        attention_dropout=0.0, use_cache=False)


def dense_qwen3_moe(work: Workload):
    """The dense model, seeded by ``work.seed`` (the same weights on every rank)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(work.seed)
    model = transformers.Qwen3MoeForCausalLM._from_config(qwen3_moe_config(work),
                                                          attn_implementation="sdpa")
    return model.train()


def _labels_step(model: torch.nn.Module, work: Workload, device: torch.device) -> StepFn:
    """A user's loop: the model's own loss with labels, backward, AdamW, zero_grad."""
    from torch.distributed.tensor import DTensor  # here: every command's start skips it (0.7 s)

    params = list(model.parameters())
    # fused AdamW takes DTensors (transformers' sharded weights) and plain tensors (its
    # replicated norms and router), one kind per group
    dtensors = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    opt = make_optimizer([{"params": g} for g in (dtensors, plain) if g], work)
    return labels_step(model, opt, device)


def setup_dense_moe(work: Workload, state: dict[str, torch.Tensor], group: ProcessGroup | None,
                    device: torch.device) -> StepFn:
    """The dense Qwen3-MoE on one rank (``state``, the GPT's weights, is not used)."""
    return _labels_step(dense_qwen3_moe(work).to(device), work, device)


def setup_tensorpar_moe(work: Workload, state: dict[str, torch.Tensor],
                        group: ProcessGroup | None, device: torch.device) -> StepFn:
    """The dense model converted by ``tensorpar.parallelize`` (its default plan)."""
    from tensorpar.hf.parallelize import parallelize

    model = parallelize(dense_qwen3_moe(work).to(device), group=group)
    return _labels_step(model, work, device)


def _save(model: torch.nn.Module, path: str) -> None:
    """The model's config and weights in ``path`` (``save_pretrained`` writes on rank 0 only)."""
    from safetensors.torch import save_file

    model.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              f"{path}/model.safetensors", metadata={"format": "pt"})


def setup_transformers_moe(work: Workload, state: dict[str, torch.Tensor],
                           group: ProcessGroup | None, device: torch.device) -> StepFn:
    """transformers' own TP + EP over the whole world (its device mesh takes every rank; the
    bench's TP pool is the world)."""
    import transformers
    from transformers.distributed import DistributedConfig

    n = tp_size(group)
    with tempfile.TemporaryDirectory(prefix="tensorpar-bench-moe-") as path:
        _save(dense_qwen3_moe(work), path)
        model = transformers.Qwen3MoeForCausalLM.from_pretrained(
            path, distributed_config=DistributedConfig(tp_size=n, ep_size=n),
            dtype=torch.float32, attn_implementation="sdpa")
    return _labels_step(model.train(), work, device)
