"""Sequence parallelism for converted Llama-family models (``parallelize(model,
sequence_parallel=True)``, ``from_pretrained(path, sequence_parallel=True)``).

As in tensorpar's GPT (Korthikanti et al. 2022): between the blocks the residual stream holds
this rank's ``tensor_split`` shard of the T tokens, so the norms and the residual adds run on
T/n tokens, and each block's f / g pair becomes an all-gather at its column side and a
reduce-scatter at its row side::

    embed_tokens                   vocab-parallel, all-reduce        (B, T, D) on every rank
    layers.0 entry                 split (backward: all-gather)      (B, T_r, D)
    input_layernorm                on T_r tokens; weight gradient summed over the group
    self_attn  q, k, v             fused_column: all-gather in forward; backward: the shard
                                   gathered again, the input gradient reduce-scattered
               o_proj              reduce-scatter                    (B, T_r, D)
    post_attention_layernorm, mlp  the same
    norm                           on T_r tokens; weight gradient summed
    lm_head                        fused_column: all-gather          (B, T, V_local)

The stream is split at the first layer, not inside the embedding (whose output the GPT
reduce-scatters): HF's base model derives the position ids, the causal mask and the rotary
tables from the embedding output's shape, which must stay (B, T, D). So the forward all-reduces
the embedding where the GPT reduce-scatters it; the backward is the same (one all-gather).

Supported: the Llama family (``SP_FAMILIES``), with every layer's attention and MLP converted
(the built-in plan; the head ``column`` or ``column_gather``), without dropout; and Qwen3-MoE,
whose MoE blocks (``moe.py``) route each rank's shard: its tokens go to their experts as they
are (no split, no gather), the router's gradient is summed over the group like the norms'.
The model's own ``aux_loss`` then counts this rank's tokens only (``train --hf`` sums the
statistics over the ranks: ``balancing_loss``). A forward needs
at least as many tokens as ranks: it is for training and scoring; ``generate()`` decodes one
token at a time, so generate with a model converted without sequence parallelism.
``output_hidden_states`` gives each rank's shards of the layers' outputs.
"""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.parallel.mappings import scatter_to_sequence
from tensorpar.runtime.groups import tp_size

SP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
LAYERS, NORM, EMBED, HEAD = "model.layers", "model.norm", "model.embed_tokens", "lm_head"


class SequenceLength:
    """T, the full length of the sequence whose shards the ranks hold, noted where the residual
    stream is split and read by the fused column ops (they gather T tokens without first
    exchanging the ranks' shard sizes)."""

    length: int | None = None


def check_sequence_parallel(model: nn.Module, styles: dict[str, str], dropout: bool) -> None:
    """Raise ValueError, naming what does not fit, unless ``model`` converted with ``styles``
    (module name -> style) can run sequence-parallel (see the module docstring)."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in SP_FAMILIES:
        raise ValueError(f"sequence_parallel=True: supported for the Llama family "
                         f"({', '.join(SP_FAMILIES)}), not model_type={family!r}")
    if dropout:
        raise ValueError("sequence_parallel=True: the model has dropout, which is not "
                         "supported on sequence shards of HF models yet; set its dropout "
                         "probabilities to 0")
    n_layers = len(model.get_submodule(LAYERS))
    want = {f"{LAYERS}.{i}.{child}": style for i in range(n_layers)
            for child, style in (("self_attn", "attention"), ("mlp", "mlp"))}
    for name, style in want.items():
        if styles.get(name) != style and not (style == "mlp" and styles.get(name) == "moe"):
            raise ValueError(f"sequence_parallel=True: {name} must have the style {style!r} "
                             f"(its input is a sequence shard), not {styles.get(name)!r}")
    allowed = {EMBED: ("vocab",), HEAD: ("column", "column_gather")}
    for name, style in styles.items():
        if name not in want and style != "replicated" and style not in allowed.get(name, ()):
            raise ValueError(f"sequence_parallel=True: the plan gives {name} the style "
                             f"{style!r}; only the layers' attention and MLP, {EMBED} (vocab) "
                             f"and {HEAD} (column, column_gather) can be split with it")


def split_at_first_layer(model: nn.Module, seq: SequenceLength, regions: list[str],
                         group: ProcessGroup | None) -> list[str]:
    """Split the residual stream into sequence shards at the first layer's input (noting T in
    ``seq``); return the names of the parameters that then see only this rank's tokens (the
    norms, an MoE block's router), whose gradients must be summed over the group. Routed
    experts (``ep_shard``) are left out: the tokens of every rank reach them."""
    n = tp_size(group)

    def split(module, args, kwargs):
        named = "hidden_states" in kwargs
        x = kwargs["hidden_states"] if named else args[0]  # (B, T, D), the same on every rank
        if x.shape[1] < n:
            raise ValueError(f"sequence_parallel=True: {x.shape[1]} token(s) cannot be split "
                             f"over {n} ranks; a forward needs at least {n} (generate with a "
                             "model converted without sequence parallelism)")
        seq.length = x.shape[1]
        x = scatter_to_sequence(x, group)  # (B, T_r, D)
        if named:
            return args, kwargs | {"hidden_states": x}
        return (x, *args[1:]), kwargs

    model.get_submodule(LAYERS)[0].register_forward_pre_hook(split, with_kwargs=True)
    inside = tuple(f"{r}." for r in regions)
    return [name for name, p in model.named_parameters()
            if ((name.startswith(f"{LAYERS}.") and not name.startswith(inside))
                or name.startswith(f"{NORM}.")) and not hasattr(p, "ep_shard")]
