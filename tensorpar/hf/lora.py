"""LoRA on a converted Hugging Face model: adapters on its block projections, split with them
(``parallel/lora.py``), and PEFT's adapter folder in and out.

``add_lora(model, rank, alpha)`` gives every targeted projection the factors ``lora_A`` and
``lora_B`` (named as PEFT names them, so ``model.layers.0.self_attn.q_proj.lora_A.weight`` is
PEFT's ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``) and freezes every
other parameter. Targets are the last part of a module's name, as PEFT's ``target_modules``: by
default every projection a plan splits inside the decoder blocks (Llama's q_proj, k_proj, v_proj,
o_proj, gate_proj, up_proj, down_proj; GPT-2's c_attn, c_proj, c_fc), never the head.

A PEFT folder is ``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``,
``target_modules``, ...) and ``adapter_model.safetensors`` with the dense factors; GPT-2's Conv1D
layers are marked ``fan_in_fan_out``, their factors shaped as a Linear's.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from tensorpar.parallel.linear import ColumnParallelLinear, RowParallelLinear
from tensorpar.parallel.lora import (
    LoRADropout,
    attach_lora,
    dense_lora_a,
    has_lora,
    lora_parameters,
)

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _blocks(model: nn.Module) -> nn.ModuleList | None:
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            return module
    return None


def projection_names(model: nn.Module) -> dict[str, nn.Module]:
    """The split projections inside the decoder blocks, by full module name."""
    blocks = _blocks(model)
    inside = {id(m) for m in blocks.modules()} if blocks is not None else set()
    return {name: m for name, m in model.named_modules()
            if id(m) in inside and isinstance(m, (ColumnParallelLinear, RowParallelLinear))}


def block_linear_kinds(model: nn.Module) -> set[str]:
    """The last parts of the names of the linear layers inside the blocks of a model as
    transformers builds it (before conversion): what ``--lora-targets`` may name."""
    from tensorpar.hf.plans import is_conv1d

    blocks = _blocks(model)
    if blocks is None:
        return set()
    return {n.rsplit(".", 1)[-1] for n, m in blocks.named_modules()
            if isinstance(m, nn.Linear) or is_conv1d(m)}


def lora_targets(model: nn.Module, targets: list[str] | None = None) -> dict[str, nn.Module]:
    """The projections ``targets`` names (the last part of their names; default all of them),
    or ValueError naming the ones that match nothing and what there is."""
    found = projection_names(model)
    if targets is None:
        return found
    check_targets(targets, {n.rsplit(".", 1)[-1] for n in found})
    return {n: m for n, m in found.items() if n.rsplit(".", 1)[-1] in targets}


def check_targets(targets: list[str], kinds: set[str]) -> None:
    """ValueError naming the targets that are none of the projections ``kinds``."""
    unknown = [t for t in targets if t not in kinds]
    if unknown or not targets:
        raise ValueError(f"--lora-targets {','.join(unknown) or '(none)'}: no such projection "
                         f"in the model's blocks (it has {', '.join(sorted(kinds))})")


def add_lora(model: nn.Module, rank: int, alpha: float, targets: list[str] | None = None,
             seed: int = 0, init: dict[str, torch.Tensor] | None = None,
             dropout: float = 0.0) -> list[str]:
    """Adapters of rank ``rank`` (scale alpha / rank) on the target projections, every other
    parameter frozen; returns the adapted modules' names. init: dense factors by name
    (``<module>.lora_A.weight``, from a PEFT folder), else A drawn from (seed, name), B zeros.
    dropout: PEFT's ``lora_dropout`` on each adapter's input while training, its masks those of
    TP=1 at any TP size (``parallel/lora.py``), drawn from (seed, forward number, layer);
    ``seed_dropout`` restarts them for a step (``model.lora_dropout``)."""
    if rank < 1:
        raise ValueError(f"--lora-rank {rank} must be >= 1")
    chosen = lora_targets(model, targets)
    stream = None
    if dropout > 0:
        stream = LoRADropout(dropout, seed)
        model.lora_dropout = stream
        model.register_forward_pre_hook(lambda m, args: stream.next_forward())
    for site, (name, m) in enumerate(sorted(chosen.items())):
        device = m.weight.device
        if init is not None:
            a = init[f"{name}.lora_A.weight"].float()
            b = init[f"{name}.lora_B.weight"].float()
        else:
            a = dense_lora_a(name, rank, m.in_features, seed)
            b = torch.zeros(m.out_features, rank)
        a, b = a.to(device), b.to(device)
        if isinstance(m, RowParallelLinear):
            attach_lora(m, "row", a, b, alpha, in_range=(m.shard_start, m.shard_stop),
                        dropout=stream, site=site)
        else:
            attach_lora(m, "column", a, b, alpha, out_spec=m.shard_spec, dropout=stream,
                        site=site)
    adapters = {id(p) for _, p in lora_parameters(model)}
    for p in model.parameters():
        p.requires_grad_(id(p) in adapters)
    return sorted(chosen)


def frozen_in_bf16(model: nn.Module) -> int:
    """Keep the frozen weights of a LoRA model's matmuls (its projections and head) in bf16,
    half their memory: the values a bf16 autocast step casts them to anyway, so the step computes
    what it would with them in fp32 and makes no bf16 copies. The embedding (a lookup; a head
    tied to it too), norms, biases and the adapters stay fp32. Returns the parameters cast."""
    embedding = model.get_input_embeddings().weight
    cast = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and w is not embedding \
                and not w.requires_grad and w.dtype == torch.float32:
            w.data = w.data.to(torch.bfloat16)
            cast += w.numel()
    return cast


def adapted_modules(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if has_lora(m)]


def peft_config(rank: int, alpha: float, targets: list[str], base: str, conv1d: bool,
                dropout: float = 0.0) -> dict:
    """PEFT's ``adapter_config.json`` for these adapters."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": sorted(targets), "lora_dropout": dropout, "bias": "none",
            "fan_in_fan_out": conv1d, "base_model_name_or_path": base,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "inference_mode": True}


def read_peft(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT LoRA folder: its config and its dense factors by tensorpar's names (PEFT's without
    ``base_model.model.``); ValueError for anything else."""
    from safetensors.torch import load_file

    folder = Path(folder)
    _check_folder(folder)
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    except (OSError, ValueError) as e:
        raise ValueError(f"--lora-init {folder}: not a PEFT adapter folder ({ADAPTER_CONFIG}, "
                         f"{ADAPTER_WEIGHTS}): {e}") from None
    if config.get("peft_type") != "LORA":
        raise ValueError(f"--lora-init {folder}: peft_type {config.get('peft_type')!r}, not LORA")
    for key in ("use_dora", "use_rslora"):
        if config.get(key):
            raise ValueError(f"--lora-init {folder}: {key} is not supported")
    if config.get("modules_to_save"):
        raise ValueError(f"--lora-init {folder}: modules_to_save {config['modules_to_save']} "
                         "(trained whole modules) is not supported")
    factors = {}
    for key, t in tensors.items():
        name = key.removeprefix(PEFT_PREFIX)
        for factor in ("lora_A", "lora_B"):  # PEFT's saved names carry no adapter name
            name = name.replace(f".{factor}.default.weight", f".{factor}.weight")
        factors[name] = t
    return config, factors


def _check_folder(folder: Path) -> None:
    """One line for a path that is no adapter folder: missing, a file, a training run, or a
    folder without PEFT's two files."""
    if not folder.exists():
        raise ValueError(f"--lora-init {folder}: no such folder")
    if not folder.is_dir():
        raise ValueError(f"--lora-init {folder} is a file: expected a PEFT adapter folder "
                         f"({ADAPTER_CONFIG}, {ADAPTER_WEIGHTS})")
    missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (folder / f).is_file()]
    if missing and ((folder / "metrics.jsonl").is_file() or (folder / "manifest.json").is_file()
                    or any(folder.glob("step-*"))):
        raise ValueError(f"--lora-init {folder} is a training run, not a PEFT adapter folder: "
                         f"write its adapters with tensorpar export --ckpt {folder} --peft-out "
                         f"DIR, or continue it with tensorpar train --resume --out {folder}")
    if missing:
        raise ValueError(f"--lora-init {folder}: no {' or '.join(missing)} (a PEFT adapter "
                         f"folder has {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")


def check_init(factors: dict[str, torch.Tensor], rank: int, targets: list[str] | None,
               model: nn.Module, folder: str) -> None:
    """The factors of a PEFT folder against the model (as transformers builds it, on the meta
    device): a pair of the rank's shapes for each targeted projection of the blocks, none for a
    module it lacks; ValueError naming the first that differs."""
    from tensorpar.hf.plans import is_conv1d

    blocks = _blocks(model)
    inside = {id(m) for m in blocks.modules()} if blocks is not None else set()
    linears = {n: m for n, m in model.named_modules()
               if id(m) in inside and (isinstance(m, nn.Linear) or is_conv1d(m))}
    adapted = sorted({n.rsplit(".", 2)[0] for n in factors})
    for name in adapted:
        if name not in linears:
            raise ValueError(f"--lora-init {folder}: it adapts {name}, which the model does "
                             "not have in its blocks: an adapter made for another model")
    kinds = targets or sorted({n.rsplit(".", 1)[-1] for n in adapted})
    for name, m in sorted(linears.items()):
        if name.rsplit(".", 1)[-1] not in kinds:
            continue
        fan_in, fan_out = (m.weight.shape[0], m.nf) if is_conv1d(m) else \
            (m.in_features, m.out_features)
        for factor, want in (("lora_A", (rank, fan_in)), ("lora_B", (fan_out, rank))):
            got = factors.get(f"{name}.{factor}.weight")
            if got is None:
                raise ValueError(f"--lora-init {folder}: no {factor} for {name}, one of its "
                                 f"targets ({', '.join(kinds)})")
            if tuple(got.shape) != want:
                raise ValueError(f"--lora-init {folder}: {name}.{factor} is "
                                 f"{tuple(got.shape)}, the model needs {want} (rank {rank}, "
                                 f"{name} {fan_in} -> {fan_out}): an adapter made for a model "
                                 "of another size")


def lora_settings(manifest: dict) -> dict | None:
    """A LoRA run's rank, alpha, targets and base model, from its checkpoint's manifest (None:
    a run that trained every weight)."""
    train = manifest.get("train") or {}
    if train.get("lora_rank") is None:
        return None
    return {"rank": train["lora_rank"], "alpha": train["lora_alpha"],
            "dropout": train.get("lora_dropout", 0.0),
            "base": (manifest.get("hf") or {}).get("source")}


def checkpoint_factors(reader) -> dict[str, torch.Tensor]:
    """The dense factors a LoRA run's checkpoint holds, by tensorpar's (PEFT's) names."""
    return {name: reader.read(name) for name in reader.tensors
            if name.endswith((".lora_A.weight", ".lora_B.weight"))
            and not name.startswith("optimizer.")}


def _conv1d_modules(files: Path) -> set[str]:
    """The modules of the run's model (its config in ``files``) that are GPT-2's Conv1D."""
    import transformers
    from accelerate import init_empty_weights

    from tensorpar.hf.plans import is_conv1d

    config = transformers.AutoConfig.from_pretrained(files, local_files_only=True)
    with init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return {n for n, m in model.named_modules() if is_conv1d(m)}


def peft_writer(reader, files: Path):
    """What writes a LoRA run's checkpoint as a PEFT adapter folder (checked first)."""
    from safetensors.torch import save_file

    settings = lora_settings(reader.manifest)
    if settings is None:
        raise ValueError(f"checkpoint {reader.dir} is not a LoRA run's (train --hf ... "
                         "--lora-rank R): export --hf-out writes its model")
    factors = checkpoint_factors(reader)
    modules = sorted({n.rsplit(".", 2)[0] for n in factors})
    conv = _conv1d_modules(files)
    config = peft_config(settings["rank"], settings["alpha"],
                         sorted({m.rsplit(".", 1)[-1] for m in modules}), settings["base"],
                         any(m in conv for m in modules), settings["dropout"])

    def write(folder: Path) -> None:
        save_file({PEFT_PREFIX + n: t.contiguous() for n, t in factors.items()},
                  str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")

    return write


def merge_factors(state: dict[str, torch.Tensor], factors: dict[str, torch.Tensor],
                  scale: float, conv: set[str]) -> None:
    """``W += scale · B A`` for each adapted module of the dense ``state`` (HF names; a Conv1D
    weight is (in, out), so its update is transposed)."""
    for name in sorted({n.rsplit(".", 2)[0] for n in factors}):
        delta = scale * factors[f"{name}.lora_B.weight"] @ factors[f"{name}.lora_A.weight"]
        key = f"{name}.weight"
        state[key] = state[key] + (delta.t() if name in conv else delta).to(state[key].dtype)
