"""``from_pretrained``: a local Hugging Face model directory loaded tensor-parallel, each rank
reading only its own slices of the safetensors files.

Needs the ``hf`` extra (``pip install tensorpar[hf]``); the rest of tensorpar never imports it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn
from torch.distributed import ProcessGroup

from tensorpar.hf.parallelize import apply_plan, check_plan_fits
from tensorpar.hf.plans import plan_for, tied_heads
from tensorpar.runtime.groups import tp_size


class SafetensorsSource:
    """Slices of the tensors of a Hugging Face model directory, read without loading the rest."""

    def __init__(self, path: str | Path, prefix: str = "",
                 renames: list[tuple[str, str]] = ()):
        from safetensors import safe_open

        self.path, self.prefix, self._safe_open = Path(path), prefix, safe_open
        self._files: dict[str, object] = {}
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").is_file():
            keys = self._open("model.safetensors").keys()
            self.weight_map = dict.fromkeys(keys, "model.safetensors")
        else:
            raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json")
        # model parameter name -> key in the files (older checkpoints use older names)
        self.file_key = {}
        for key in self.weight_map:
            name = key
            for pattern, repl in renames:
                name = re.sub(pattern, repl, name)
            self.file_key[name] = key

    def _open(self, fname: str):
        if fname not in self._files:
            self._files[fname] = self._safe_open(self.path / fname, framework="pt")
        return self._files[fname]

    def _key(self, name: str) -> str:
        bare = name.removeprefix(f"{self.prefix}.")  # older files omit the base model's prefix
        for candidate in (name, bare):
            if candidate in self.file_key:
                return self.file_key[candidate]
        raise ValueError(f"{self.path}: no tensor for {name!r} in the checkpoint")

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None):
        key = self._key(key)
        piece = self._open(self.weight_map[key]).get_slice(key)
        if dim is not None:
            stop = piece.get_shape()[dim] if stop is None else stop
        t = piece[:] if dim is None else piece[(slice(None),) * dim + (slice(start, stop),)]
        # an owned, compact copy: the result may view the memory-mapped file or whole rows of it
        return t.clone(memory_format=torch.contiguous_format)

    def close(self) -> None:
        self._files.clear()  # unmaps the files


class EmptySource:
    """Zeros in the dense shape of each parameter of a model built on the meta device: the
    weights of a model that a checkpoint fills next (``tensorpar train --hf``, resumed)."""

    def __init__(self, model: nn.Module):
        self.shapes = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}

    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None):
        shape = list(self.shapes[key])
        if dim is not None:
            shape[dim] = (shape[dim] if stop is None else stop) - start
        return torch.zeros(shape)

    def close(self) -> None:
        pass


def _renames(model: nn.Module) -> list[tuple[str, str]]:
    """The plain key renamings transformers applies when loading this model's checkpoints
    (e.g. GPT-NeoX's ``embed_out`` -> ``lm_head``, Mixtral's ``block_sparse_moe`` -> ``mlp``).
    Experts saved one by one are stacked by ``moe.read_experts``; other conversions are not
    supported: their tensors are then reported missing."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        rules = get_model_conversion_mapping(model)
    except (ImportError, AttributeError, TypeError):  # older transformers: no renamings
        return []
    return [(r.source_patterns[0], r.target_patterns[0]) for r in rules
            if type(r) is WeightRenaming and len(r.source_patterns) == 1]


def from_pretrained(path: str | Path, group: ProcessGroup | None = None,
                    dtype: torch.dtype = torch.float32, plan: dict[str, str] | None = None,
                    attn_implementation: str | None = None,
                    sequence_parallel: bool = False, weights: bool = True,
                    cp_group: ProcessGroup | None = None,
                    ep_group: ProcessGroup | None = None) -> nn.Module:
    """Load a local Hugging Face causal-LM directory (config + safetensors) tensor-parallel.

    The model is built with its parameters on the meta device; each rank then reads only its own
    slices of the split weights (and the replicated ones whole), so per-rank memory is about 1/N
    of the split weights plus the replicated ones. A split the model cannot take (GPT-NeoX's
    per-head q|k|v over a TP size that does not divide its heads) is a ValueError naming the
    module, raised on every rank before anything is read. The converted layers are those of
    ``parallelize`` (q/k/v and gate/up as one fused op each); ``sequence_parallel`` as there.
    weights=False: the directory needs only its config; the parameters are zeros, for a
    checkpoint to fill (``load_checkpoint``). cp_group: context parallelism, as ``parallelize``.
    ep_group: as ``parallelize``'s (MoE models: each rank reads only its experts).
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    plan = plan or plan_for(model)
    # every split checked before a byte is read (and before any collective: there is none here),
    # the same verdict on every rank
    check_plan_fits(model, plan, tp_size(group), sequence_parallel,
                    cp_group is not None and tp_size(cp_group) > 1,
                    ep=tp_size(group if ep_group is None else ep_group))
    source = SafetensorsSource(path, model.base_model_prefix, _renames(model)) if weights \
        else EmptySource(model)
    apply_plan(model, plan, group, source=source, dtype=dtype, tied=tied_heads(model),
               sequence_parallel=sequence_parallel, cp_group=cp_group, ep_group=ep_group)
    source.close()
    if (Path(path) / "generation_config.json").is_file():  # eos lists, sampling defaults, ...
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()
