"""A Hugging Face ``LlamaForCausalLM`` under ``tensorpar.parallelize`` as a benchmark contender.

The bench's model is a Llama (RMSNorm, rotate-half rotary, GQA, SwiGLU, untied head), so
transformers' own ``LlamaForCausalLM`` of the same shape, loaded with the same weights
(``hf_state``: tensorpar's names mapped to transformers'), computes the same loss on the same
batches. It is converted with the built-in Llama plan, the head left split by vocabulary
(``column``): the loss is ``vocab_parallel_cross_entropy`` on the local logits, as for the GPT
(and as DTensor's ``loss_parallel``), never on gathered logits. Needs transformers (the ``hf``
extra), imported when the contender is set up.

Two more rows step as a transformers user's own loop does, ``model(input_ids=ids,
labels=ids).loss`` on the model ``parallelize`` gives with its default plan (the head
``column_gather``; with labels it gathers nothing and the loss is vocab-parallel,
``hf/labels_loss.py``): ``hf-llama-labels`` trains every weight, ``hf-llama-lora`` LoRA adapters
of rank 8 on every block projection (``hf/lora.py``), the model frozen. The bench's targets go in
as ``shift_labels``, so the loss is the other rows'; the LoRA row's first loss is theirs, its
later ones its adapters' own.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from tensorpar.bench.workload import StepFn, Workload, make_optimizer, mixed_precision
from tensorpar.hf.parallelize import parallelize
from tensorpar.hf.plans import LLAMA_PLAN
from tensorpar.parallel.cross_entropy import vocab_parallel_cross_entropy

# tensorpar's GPT name -> transformers' Llama name, per block (``blocks.i.`` / ``model.layers.i.``)
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "lm_head.weight": "lm_head.weight"}


def hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``dense_state(work)`` under transformers' Llama names (each tensor cloned: contenders in
    one process must not share storage)."""
    out = {}
    for name, t in state.items():
        if name in _TOP_NAMES:
            out[_TOP_NAMES[name]] = t.clone()
            continue
        _, i, rest = name.split(".", 2)  # blocks.{i}.{rest}
        out[f"model.layers.{i}.{_BLOCK_NAMES[rest]}"] = t.clone()
    return out


def hf_llama(work: Workload, state: dict[str, torch.Tensor]):
    """The dense ``LlamaForCausalLM`` of the bench's model, holding ``state``."""
    import transformers

    cfg = work.gpt_config()
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=max(work.seq_len, 1), tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, hidden_act="silu", attention_dropout=0.0,
        use_cache=False)
    transformers.logging.set_verbosity_error()
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    model.load_state_dict(hf_state(state), strict=True)
    return model.train()


def setup_hf_llama(work: Workload, state: dict[str, torch.Tensor], group: ProcessGroup | None,
                   device: torch.device, sequence_parallel: bool = False) -> StepFn:
    """transformers' Llama converted by ``tensorpar.parallelize`` (head: ``column``)."""
    model = parallelize(hf_llama(work, state).to(device), LLAMA_PLAN | {"lm_head": "column"},
                        group=group, sequence_parallel=sequence_parallel)
    opt = make_optimizer(model.parameters(), work)
    vocab = work.vocab_size

    def step(ids_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        with mixed_precision(device):
            logits_BTV_local = model(input_ids=ids_BT, use_cache=False).logits
            loss = vocab_parallel_cross_entropy(logits_BTV_local, targets_BT, group=group,
                                                vocab_size=vocab, reuse_logits=True)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def setup_hf_llama_labels(work: Workload, state: dict[str, torch.Tensor],
                          group: ProcessGroup | None, device: torch.device,
                          lora_rank: int | None = None) -> StepFn:
    """The user's loop: ``parallelize(model)`` (default plan), ``model(..., labels=).loss``;
    ``lora_rank``: adapters on every block projection, only they in the optimizer."""
    from tensorpar.hf.lora import add_lora

    model = parallelize(hf_llama(work, state).to(device), group=group)
    if lora_rank is not None:
        add_lora(model, lora_rank, 2.0 * lora_rank, seed=work.seed)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], work)
    return labels_step(model, opt, device)


def labels_step(model: torch.nn.Module, opt, device: torch.device) -> StepFn:
    """A user's step with a Hugging Face model: its own loss with ``labels=``, backward,
    ``opt``'s update, zero_grad."""

    def step(ids_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        with mixed_precision(device):
            loss = model(input_ids=ids_BT, labels=ids_BT, shift_labels=targets_BT,
                         use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step
