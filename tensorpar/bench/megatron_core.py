"""megatron-core's own GPT as a benchmark contender: same model, same weights, CPU and gloo.

``setup_megatron(work, state)`` builds ``megatron.core.models.gpt.GPTModel`` from the local layer
work (no Transformer Engine, no Apex: torch's RMSNorm, megatron's DotProductAttention and its
Column/RowParallelLinear), loads the dense fp32 weights of ``state`` into megatron's sharded
layout and returns one training step. Run it on every rank of a gloo world of size TP: megatron
keeps its process groups in module globals (``parallel_state``), so it owns the whole world of the
processes it runs in, and the benchmark gives it processes of its own.

Where megatron keeps what tensorpar calls ``blocks.i.*`` on TP rank r of n (H = hidden_dim,
q = query heads per KV head, every split even: megatron does not pad or split unevenly)::

    tensorpar (dense)                    megatron-core (rank r)
    embed.weight                   ->    embedding.word_embeddings.weight   rows r·V/n .. (r+1)·V/n
    blocks.i.attn_norm.weight      ->    decoder.layers.i.input_layernorm.weight        (replicated)
    blocks.i.attn.{q,k,v}_proj     ->    decoder.layers.i.self_attention.linear_qkv.weight
        one fused matrix; per KV head g of this rank, rows [q heads of g | k_g | v_g]
    blocks.i.attn.o_proj.weight    ->    decoder.layers.i.self_attention.linear_proj.weight
        input columns of this rank's query heads
    blocks.i.mlp_norm.weight       ->    decoder.layers.i.pre_mlp_layernorm.weight      (replicated)
    blocks.i.mlp.{gate,up}.weight  ->    decoder.layers.i.mlp.linear_fc1.weight
        [gate rows r·H/n .. (r+1)·H/n ; up rows, same]: megatron's GLU is silu(first half) * second
    blocks.i.mlp.down.weight       ->    decoder.layers.i.mlp.linear_fc2.weight  input columns, same
    norm.weight                    ->    decoder.final_layernorm.weight                 (replicated)
    lm_head.weight                 ->    output_layer.weight                rows r·V/n .. (r+1)·V/n

Rotary embeddings are megatron's default "rotate half" layout (channels i and i + hd/2 paired),
tensorpar's. The loss is megatron's vocab-parallel cross-entropy per token, averaged.

What runs on the CPU only with help, and why (all local to this module, nothing left behind):
- ``torch.cuda.current_device()`` is called where megatron allocates gather buffers, moves the
  rotary frequencies and builds some buffers; :func:`on_cpu` makes it return the CPU device while
  megatron builds the model and while each step runs, and restores it after.
- the RNG tracker forks the CUDA generator around attention dropout even at dropout 0; megatron's
  own no-op tracker (``initialize_rng_tracker(inference_rng_tracker=True)``) replaces it, which is
  exact because the benchmark model has no dropout (checked).
- the default causal mask is built with ``device="cuda"``: the step passes its own mask instead.
- sequence parallelism is refused: without Apex or Transformer Engine, megatron-core's RMSNorm is
  torch's, wrapped by ``WrappedTorchNorm``, which asserts ``not config.sequence_parallel``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from tensorpar.bench.megatron_fits import check_megatron_fits
from tensorpar.bench.workload import StepFn
from tensorpar.bench.workload import make_optimizer as bench_adamw

try:
    with warnings.catch_warnings():  # "Apex is not installed": we mean to run without it
        warnings.simplefilter("ignore")
        import megatron.core
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import random as megatron_random
        from megatron.core.transformer.transformer_config import TransformerConfig
    MEGATRON_AVAILABLE = True
    MEGATRON_VERSION: str | None = megatron.core.__version__
    _IMPORT_ERROR: str | None = None
except Exception as e:  # ImportError, or a version that fails on import against this torch
    MEGATRON_AVAILABLE, MEGATRON_VERSION = False, None
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

def megatron_unavailable_reason() -> str | None:
    """None when megatron-core imports; otherwise one line saying why and how to install it."""
    if MEGATRON_AVAILABLE:
        return None
    return (f"megatron-core is not importable ({_IMPORT_ERROR}); "
            "install it with: pip install --no-deps 'megatron-core>=0.16.1,<0.17'")


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """Inside: ``torch.cuda.current_device()`` returns the CPU device (megatron allocates its
    gather buffers and rotary tables on "the current device"), and megatron's advice for CUDA
    (``CUDA_DEVICE_MAX_CONNECTIONS``, deprecated CUDA-graph scopes) is not printed. Restored on
    exit."""
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
            yield
    finally:
        torch.cuda.current_device = original


def megatron_shards(state: dict[str, torch.Tensor], cfg, tp_rank: int,
                    tp_size: int) -> dict[str, torch.Tensor]:
    """The dense tensorpar ``state`` cut into megatron-core's parameters of rank ``tp_rank``
    (names and layout as in the module docstring)."""

    def rows(t: torch.Tensor) -> torch.Tensor:  # this rank's even slice of dim 0
        return t.chunk(tp_size, dim=0)[tp_rank]

    def cols(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp_size, dim=1)[tp_rank]

    hd, D = cfg.head_dim, cfg.dim
    q_per_kv = cfg.n_head // cfg.n_kv_head
    out = {"embedding.word_embeddings.weight": rows(state["embed.weight"]),
           "decoder.final_layernorm.weight": state["norm.weight"],
           "output_layer.weight": rows(state["lm_head.weight"])}
    for i in range(cfg.n_layer):
        src, dst = f"blocks.{i}.", f"decoder.layers.{i}."
        q_GqhD = state[src + "attn.q_proj.weight"].view(cfg.n_kv_head, q_per_kv * hd, D)
        k_GhD = state[src + "attn.k_proj.weight"].view(cfg.n_kv_head, hd, D)
        v_GhD = state[src + "attn.v_proj.weight"].view(cfg.n_kv_head, hd, D)
        # per KV head g: its q heads, then k_g, then v_g; rank r holds KV heads r·G/n .. (r+1)·G/n
        qkv_G_D = torch.cat([q_GqhD, k_GhD, v_GhD], dim=1)  # (G, (q + 2)·hd, D)
        out |= {
            dst + "input_layernorm.weight": state[src + "attn_norm.weight"],
            dst + "self_attention.linear_qkv.weight": rows(qkv_G_D).reshape(-1, D),
            dst + "self_attention.linear_proj.weight": cols(state[src + "attn.o_proj.weight"]),
            dst + "pre_mlp_layernorm.weight": state[src + "mlp_norm.weight"],
            dst + "mlp.linear_fc1.weight": torch.cat([rows(state[src + "mlp.gate.weight"]),
                                                      rows(state[src + "mlp.up.weight"])]),
            dst + "mlp.linear_fc2.weight": cols(state[src + "mlp.down.weight"]),
        }
    return out


def build_megatron_gpt(cfg, max_seq_len: int, tp: int) -> GPTModel:
    """megatron-core's GPTModel with tensorpar's architecture: RMSNorm, SwiGLU, GQA, rotary
    (base ``cfg.rope_theta``, rotate-half), no biases, untied head, fp32, no weight init (the
    caller loads weights). Needs ``parallel_state`` initialized with TP ``tp``."""
    with on_cpu():
        config = TransformerConfig(
            num_layers=cfg.n_layer, hidden_size=cfg.dim, num_attention_heads=cfg.n_head,
            num_query_groups=cfg.n_kv_head, kv_channels=cfg.head_dim,
            ffn_hidden_size=cfg.hidden_dim, gated_linear_unit=True, activation_func=F.silu,
            normalization="RMSNorm", layernorm_epsilon=cfg.norm_eps,
            add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
            # the fused kernels are CUDA extensions; on the CPU megatron's torch fallbacks run
            bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
            apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
            cross_entropy_loss_fusion=False,
            use_cpu_initialization=True, perform_initialization=False, params_dtype=torch.float32,
            tensor_model_parallel_size=tp, sequence_parallel=False)
        return GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm"),
                        vocab_size=cfg.vocab_size, max_sequence_length=max_seq_len,
                        position_embedding_type="rope", rotary_base=cfg.rope_theta,
                        rotary_percent=1.0, share_embeddings_and_output_weights=False,
                        parallel_output=True)


def _init_parallel_state(tp: int) -> None:
    """Megatron's process groups for TP ``tp`` over the whole world (kept if already so)."""
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() == tp:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                             create_gloo_process_groups=False)
    # no dropout, so no random numbers: megatron's no-op tracker instead of its CUDA one
    megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def setup_megatron(work, state: dict[str, torch.Tensor], group=None,
                   sequence_parallel: bool = False,
                   make_optimizer: Callable | None = None) -> StepFn:
    """Build megatron-core's GPT of ``work`` on this rank, load ``state`` (dense fp32, tensorpar
    names), and return ``step(ids_BT, targets_BT) -> loss``: forward (mean cross-entropy over all
    B·T tokens), backward, one optimizer step, zero_grad; the loss comes back detached and is the
    same on every rank.

    group: None or the whole world (megatron-core builds its own TP group over all ranks).
    make_optimizer: ``(params, work) -> optimizer``; default the benchmark's AdamW.
    """
    import torch.distributed as dist

    if not MEGATRON_AVAILABLE:
        raise RuntimeError(megatron_unavailable_reason())
    if not dist.is_initialized():
        raise RuntimeError("setup_megatron runs on the ranks of an initialized gloo world")
    world = dist.get_world_size()
    if group is not None and dist.get_world_size(group) != world:
        raise ValueError(f"megatron-core's TP group spans the whole world ({world} ranks); got a "
                         f"group of {dist.get_world_size(group)}: give megatron its own processes")
    cfg = work.gpt_config()
    check_megatron_fits(cfg, world, sequence_parallel)  # before any collective
    _init_parallel_state(world)
    model = build_megatron_gpt(cfg, work.seq_len, world)
    shards = megatron_shards(state, cfg, parallel_state.get_tensor_model_parallel_rank(), world)
    params = dict(model.named_parameters())
    if sorted(params) != sorted(shards):
        raise RuntimeError(f"megatron-core {MEGATRON_VERSION} names its parameters "
                           f"{sorted(set(params) ^ set(shards))} differently than expected")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(shards[name])
    optimizer = (make_optimizer or bench_adamw)(list(params.values()), work)
    masks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def inputs(T: int) -> tuple[torch.Tensor, torch.Tensor]:
        if T not in masks:  # True = masked: the future (megatron's default mask is CUDA-only)
            masks[T] = (torch.arange(T).unsqueeze(0),
                        torch.ones(1, 1, T, T, dtype=torch.bool).triu(diagonal=1))
        return masks[T]

    def step(ids_BT: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        B, T = ids_BT.shape
        position_ids_1T, mask_11TT = inputs(T)
        with on_cpu():
            loss_BT = model(ids_BT, position_ids_1T.expand(B, T), mask_11TT, labels=targets_BT)
            loss = loss_BT.mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    step.model = model  # for tests and memory accounting
    return step
