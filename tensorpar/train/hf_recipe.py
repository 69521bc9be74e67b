"""``tensorpar train --hf PATH``: fine-tune a Hugging Face causal LM with tensor parallelism, in
the GPT's training loop (``train/loop.py``, every flag of it), through the recipe below::

    tensorpar train --hf ./my-llama --tp 2 --steps 200 --data notes.txt --out runs/ft
    tensorpar train --resume --tp 4 --steps 400 --out runs/ft      # no --hf: the run's copy
    tensorpar export --ckpt runs/ft --hf-out runs/ft-hf             # its architecture, its names

The model is ``from_pretrained(PATH, plan=<its plan> | {"lm_head": "column"})``: the head stays
split by vocabulary, and the loss is ``vocab_parallel_cross_entropy`` on each rank's logits,
never gathered, never the model's own ``labels=`` loss. The text (``--data``, default the GPT's
corpus) is tokenized by PATH's tokenizer, without special tokens, and kept in the smallest
integer type of the vocabulary; batches are the GPT's (a function of seed and step).

The run keeps what it needs without PATH: at its start the lead rank copies PATH's files but
the weights (config.json, generation_config.json, the tokenizer's) into ``RUN/hf/``; a resumed
run builds the model from that copy (zeros, then the checkpoint) and tokenizes with it.
Checkpoints are the GPT's (``model_kind: "hf"``, ``config``: the config.json), so they resume at
any --tp and --dp; GPT-2's Conv1D weights are stored (out, in), as the trainer holds them.

Dropout: outside the TP regions HF layers draw from torch's global generator, which each step
seeds from (seed, "hf-dropout", step, dp rank), the same on the ranks of a TP group; inside them
from the model's per-rank stream (``hf/dropout.py``), restarted each step from (seed,
"hf-tp-region", step, dp rank, tp rank). A resumed run at the same TP size draws the same masks.

Refused before any rank starts, in one line each: a PATH without config.json, tokenizer or
safetensors weights; a model no plan covers (the error lists its linear layers); a split the
model cannot take (heads over --tp, --sequence-parallel outside the Llama family; --cp outside
it, or with --sequence-parallel, dropout or --lora-dropout); the GPT's model flags; --no-fused,
and --compile with --recompute for a model with dropout (not supported here yet); on --resume, a
--hf whose config.json is not the run's.

A Mixture-of-Experts model (``hf/moe.py``) takes ``--dp`` and ``--ep N``: the EP groups folded
from the dp x tp ranks as the GPT's (``mesh/experts.py``; at ``--ep 1`` each TP group), the
experts' gradients reduced by the trainer as the GPT's, and the model's balancing loss over each
pass's tokens on every dp rank (:func:`_aux_term`); under ``--cp`` the CP ranks count as data
replicas there (the EP groups fold from the dp x cp x tp ranks, the balancing loss's statistics
sum over dp x cp).

``--cp N`` (the Llama family and the MoE models whose attention is Llama's, ``hf/context.py``):
every CP rank is given the same whole rows, the model keeps its load-balanced chunks of them,
and the loss reads the targets of those chunks (the trainer averages the gradients over dp x cp
and divides the loss by the step's tokens).

``--compile`` compiles the converted model as the GPT's (``train/compute.py``): one graph, no
break, with and without sequence parallelism, the loss outside it. A model that drops breaks the
graph where each TP region swaps the generator states (torch.compile runs those calls eagerly),
and each compiled piece draws its masks from the generator in place when it runs: the per-rank
stream inside the regions, the shared one outside, seeded each step as above; inductor with
torch's own random ops (``fallback_random``), so compiled steps draw eager's masks (the one
step the trainer measures runs eagerly, and a resumed run measures another).

``--recompute`` turns on transformers' gradient checkpointing (non-reentrant): each decoder layer
keeps only its input and runs again in backward, its collectives included, and draws the
dropout masks of its first forward (``RegionStream.checkpoint_contexts``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from torch import nn

from tensorpar.checkpoint.format import model_kind
from tensorpar.data.tokenizer import TOKENIZER_FILES, HFTokenizer
from tensorpar.hf.context import model_cp_group
from tensorpar.hf.dropout import seed_dropout
from tensorpar.hf.lora import (
    add_lora,
    block_linear_kinds,
    check_init,
    check_targets,
    frozen_in_bf16,
    read_peft,
)
from tensorpar.hf.moe import balancing_loss
from tensorpar.hf.parallelize import check_plan_fits, has_dropout
from tensorpar.hf.plans import plan_for
from tensorpar.mesh.experts import expert_groups
from tensorpar.mesh.mesh import replica_group
from tensorpar.parallel.context import split_to_cp
from tensorpar.parallel.cross_entropy import vocab_parallel_cross_entropy
from tensorpar.parallel.sharding import check_expert_parallel
from tensorpar.planner.shapes import ModelShape, shape_from_hf_config
from tensorpar.train.compute import loss_function
from tensorpar.train.config import TrainConfig, lora_targets, passes
from tensorpar.train.resume import RunFlags, resolve_run
from tensorpar.transformer.expert_groups import ExpertGroups

HF_FILES = "hf"  # the run's copy of the source model's files, in --out
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf",
                ".index.json")  # not copied into the run


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError("--hf needs transformers: pip install tensorpar[hf]") from None
    transformers.logging.set_verbosity_error()
    return transformers


@dataclass
class HFRecipe:
    """A Hugging Face causal LM for the trainer (``train/gpt_recipe.py`` has the interface).

    source: the directory the ranks load: PATH (a new run: config, tokenizer, weights) or the
    run's copy (a resumed run: config and tokenizer; ``weights`` False, zeros that the
    checkpoint fills). origin: the PATH the run started from. config: its config.json. plan:
    its tensor-parallel plan, the head ``column``. dropout: whether the model drops anything.
    meta: the model of config.json on the meta device, built once in the launcher for the
    checks before any rank (:meth:`meta_model`); never pickled: a rank builds its own model.
    """

    source: str
    origin: str
    config: dict
    plan: dict[str, str]
    weights: bool = True
    dropout: bool = False
    meta: nn.Module | None = field(default=None, repr=False, compare=False)
    kind = "hf"
    context_parallel = True  # build takes cp_group= (--cp: the Llama family, hf/context.py)

    def __getstate__(self) -> dict:
        return self.__dict__ | {"meta": None}  # the ranks get plain values only

    def meta_model(self) -> nn.Module:
        """The model of ``source``'s config.json on the meta device (nothing read), built at
        most once."""
        if self.meta is None:
            self.meta = _meta_model(self.source)
        return self.meta

    def check(self, cfg: TrainConfig) -> None:
        if cfg.pp > 1:
            raise ValueError(f"--pp with --hf {self.origin}: pipeline stages are built for "
                             "tensorpar's GPT only. A Hugging Face model's forward runs its "
                             "embedding, every decoder layer and its head in one call, with "
                             "masks and positions made inside it, so torch.distributed."
                             "pipelining cannot cut it into stages without a model-specific "
                             "stage forward, which tensorpar does not have yet")
        # --ep against the model's routed experts (none: a dense model), the one rule
        check_expert_parallel(cfg.ep, cfg.tp, cfg.dp,
                              getattr(self.meta_model(), "num_experts", 0) if self.moe else 0,
                              cfg.cp)
        if not cfg.fused:
            raise ValueError("--no-fused is not supported with --hf yet (the converted blocks "
                             "always run the fused ops)")
        if cfg.compile and cfg.recompute and self.dropout:
            raise ValueError(f"--compile with --recompute is not supported with --hf for a model "
                             f"that drops (dropout in {self.origin}'s config) yet: the recomputed "
                             "layer replays its TP regions' masks through checkpoint contexts, "
                             "which torch.compile does not trace")
        if cfg.cp > 1 and cfg.lora_dropout > 0:
            raise ValueError(f"--lora-dropout {cfg.lora_dropout} with --cp {cfg.cp} is not "
                             "supported yet (the adapters' masks are drawn per TP rank, not per "
                             "CP rank's tokens)")
        split = f"--tp {cfg.tp}" + (" --sequence-parallel" if cfg.sequence_parallel else "") + \
            (f" --cp {cfg.cp}" if cfg.cp > 1 else "")
        try:
            check_plan_fits(self.meta_model(), self.plan, cfg.tp, cfg.sequence_parallel,
                            cfg.cp > 1, ep=self.ep_size(cfg) if self.moe else None)
        except ValueError as e:
            raise ValueError(f"--hf {self.origin} at {split}: {e}") from None

    @property
    def moe(self) -> bool:
        """Whether the model has Mixture-of-Experts blocks (the plan style ``moe``)."""
        return "moe" in self.plan.values()

    @staticmethod
    def ep_size(cfg: TrainConfig) -> int:
        """The EP size of an MoE model: ``--ep``, or at ``--ep 1`` the TP size (the experts cut
        across each TP group, as ``parallelize`` cuts them by default)."""
        return cfg.ep if cfg.ep > 1 else cfg.tp

    def expert_groups(self, cfg: TrainConfig, mesh, run_group) -> ExpertGroups | None:
        """The ranks of an MoE model's experts (None: a dense model), folded from the stage's
        dp x tp ranks as the GPT's (``mesh/experts.py``; collective); the trainer reduces their
        gradients over ``expert_data`` and counts them once over ``ep`` in the gradient norm.
        The router statistics cover the tokens of the ranks that hold different ones: every TP
        rank routes all of its group's tokens, so ``stats`` is the data-parallel group, under
        --cp the ("dp", "cp") one (each CP rank routes its chunks); under --sequence-parallel
        each routes its shard, so it stays the stage's dp x tp ranks."""
        if not self.moe:
            return None
        groups = expert_groups(self.ep_size(cfg), cfg.tp, cfg.dp or 1, mesh, run_group)
        if cfg.sequence_parallel:
            return groups
        return replace(groups, stats=replica_group(mesh) if groups.dp > 1 else None)

    def tokenizer(self) -> HFTokenizer:
        return HFTokenizer(self.source, self.config["vocab_size"], "--hf")

    def build(self, cfg: TrainConfig, group, dp_rank: int, device: torch.device,
              cp_group=None, experts: ExpertGroups | None = None
              ) -> tuple[nn.Module, Callable[[int], None]]:
        """cp_group: under --cp, the model takes the whole rows and keeps this rank's chunks
        (``hf/context.py``); the loss then reads the targets of those chunks. experts: an MoE
        model's groups (:meth:`expert_groups`), its experts cut across ``experts.ep``."""
        from tensorpar.hf.pretrained import from_pretrained

        _transformers()
        model = from_pretrained(self.source, group, plan=self.plan, weights=self.weights,
                                sequence_parallel=cfg.sequence_parallel,
                                cp_group=cp_group,
                                ep_group=None if experts is None else experts.ep
                                ).to(device).train()
        if cfg.lora_rank is not None:  # adapters on the projections, the model frozen
            init = None if cfg.lora_init is None else read_peft(cfg.lora_init)[1]
            add_lora(model, cfg.lora_rank, cfg.lora_alpha, lora_targets(cfg), cfg.seed, init,
                     dropout=cfg.lora_dropout)
            if cfg.base_dtype == "bf16":
                frozen_in_bf16(model)
        stream = model.tp_region_stream
        if cfg.recompute:  # transformers' own: each decoder layer keeps its input only
            enable = getattr(model, "activation_checkpointing_enable", None) or \
                model.gradient_checkpointing_enable  # its name before transformers 5.x
            # the recomputed layer replays its dropout masks: torch's global generator by the
            # checkpoint's preserve_rng_state, the per-rank region stream by its contexts (so
            # not with --compile for a model that drops: dynamo traces no context_fn)
            replay = {"context_fn": stream.checkpoint_contexts} if self.dropout else {}
            enable({"use_reentrant": False} | replay)

        def at_step(step: int) -> None:  # this step's dropout masks, from (seed, step) alone
            seed_dropout(model, cfg.seed, step, dp_rank)

        return model, at_step

    def loss_fn(self, model: nn.Module, cfg: TrainConfig, group,
                experts: ExpertGroups | None = None) -> Callable:
        """The vocab-parallel cross-entropy, plus an MoE model's own balancing loss (with
        ``output_router_logits`` in its config) times ``router_aux_loss_coef``: each pass's
        over the pass's tokens on every dp rank (``experts.stats``), the step's the mean over
        its passes, so any layout equals one rank taking the same passes."""
        vocab = self.config["vocab_size"]
        aux = _aux_term(model, cfg, self.config.get("router_aux_loss_coef", 0.0),
                        None if experts is None else experts.stats)

        # (or compiled; with dropout, inductor draws eager's masks: the run's measured step runs
        # eagerly, and a resumed run measures another step)
        forward = loss_function(model, cfg.compile, cfg.compile_backend, self.dropout)
        cp_group = model_cp_group(model)

        def loss(ids_BT: torch.Tensor, targets_BT: torch.Tensor,
                 loss_tokens: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
            # position_ids (--pack): restarting positions, from which transformers confines
            # attention to each example (no cache: the block-diagonal causal mask)
            extra = {} if position_ids is None else {"position_ids": position_ids}
            out = forward(input_ids=ids_BT, use_cache=False, **extra)
            if cp_group is not None:  # the logits are this CP rank's chunks: so the targets
                targets_BT = split_to_cp(targets_BT, cp_group)
            loss = vocab_parallel_cross_entropy(
                out.logits, targets_BT, group=group, vocab_size=vocab, reuse_logits=True,
                reduction="mean" if loss_tokens is None else "sum")
            loss = loss if loss_tokens is None else loss / loss_tokens
            if getattr(out, "router_logits", None):  # an MoE's own balancing loss
                loss = loss + aux(out.router_logits)
            return loss

        return loss

    def manifest(self) -> dict:
        return {"model_kind": self.kind, "config": self.config, "tokenizer": HFTokenizer.name,
                # the source's absolute path: a LoRA run's base, wherever generate or export run
                "hf": {"source": str(Path(self.origin).resolve()), "files": HF_FILES,
                       "plan": self.plan}}

    def shape(self) -> ModelShape | None:
        """The planner's view of config.json (``tensorpar plan --config``), None if it has none."""
        try:
            return shape_from_hf_config(self.config, Path(self.origin).name)
        except ValueError:
            return None

    def write_run_files(self, out: Path) -> None:
        """Copy the source's files but the weights into ``out/hf`` (atomically; a resumed run
        has them there already)."""
        target, tmp = out / HF_FILES, out / f".{HF_FILES}.tmp"
        if Path(self.source).resolve() == target.resolve():
            return
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for f in sorted(Path(self.source).iterdir()):
            if f.is_file() and not f.name.endswith(WEIGHT_FILES):
                shutil.copy2(f, tmp / f.name)
        shutil.rmtree(target, ignore_errors=True)  # an earlier start that saved no checkpoint
        os.rename(tmp, target)


def _aux_term(model: nn.Module, cfg: TrainConfig, coef: float,
              stats) -> Callable[[tuple], torch.Tensor]:
    """A pass's term of an MoE model's balancing loss, from its router logits: ``coef`` x the
    loss over the pass's tokens on every rank of ``stats`` (``hf/moe.py``), divided by the
    step's passes. Its value is the same on every dp rank (so the step's reported loss, the
    dp ranks' mean, counts it once); its gradient counts dp times, each rank's gradient being
    its tokens' share and data parallelism averaging the shares over dp (dp x cp under --cp: the
    CP ranks route their own chunks, and the gradients are averaged over them too)."""
    inner = getattr(model, "module", model)  # through a DDP wrapper
    weight, dp = coef / passes(cfg), (cfg.dp or 1) * cfg.cp

    def term(router_logits: tuple) -> torch.Tensor:
        loss = balancing_loss(router_logits, inner.num_experts, inner.num_experts_per_tok, stats)
        return weight * (dp * loss - (dp - 1) * loss.detach())

    return term


def _meta_model(path: str) -> nn.Module:
    """The model of ``path``'s config.json, its parameters on the meta device (nothing read)."""
    from accelerate import init_empty_weights

    transformers = _transformers()
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    with init_empty_weights(include_buffers=False):
        return transformers.AutoModelForCausalLM.from_config(config)


def _read_config(path: str | Path, weights: bool) -> dict:
    """config.json of a model directory (or of a run's copy of one) that has what training
    needs: a tokenizer and, for ``weights``, the safetensors weights."""
    p, what = Path(path), f"--hf {path}" if weights else f"the run's copy of its model, {path}"
    _transformers()
    if not (p / "config.json").is_file():
        raise ValueError(f"{what}: no config.json (not a Hugging Face model directory)")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"{what}: no tokenizer ({', '.join(TOKENIZER_FILES)}); train --hf "
                         "tokenizes --data with the model's own (tokenizer.save_pretrained)")
    if weights and not any((p / f).is_file() for f in ("model.safetensors",
                                                       "model.safetensors.index.json")):
        raise ValueError(f"{what}: no model.safetensors or model.safetensors.index.json")
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what}: config.json: {e}") from None
    if not isinstance(config, dict) or type(config.get("vocab_size")) is not int:
        raise ValueError(f"{what}: config.json has no vocab_size (not a causal LM's config)")
    return config


def started_as_hf_run(out: str | None) -> bool:
    """Whether ``out`` holds a fine-tune's copy of its model's files (written before its first
    step): ``--resume`` of it before its first checkpoint is the fine-tune's, not a GPT run."""
    return (Path(out or TrainConfig.out) / HF_FILES / "config.json").is_file()


def hf_recipe(path: str | None, out: str, manifest: dict | None,
              ckpt: Path | None) -> HFRecipe:
    """The recipe of a new run from ``path``, or of the run whose checkpoint is resumed (its
    copy of the model's files; ``path``, if given, must have the same config.json)."""
    if manifest is None and path is None:
        raise ValueError(f"--resume: {out} has no checkpoint of its fine-tune yet; pass --hf "
                         "PATH to start it over")
    if manifest is None:
        config, source, weights, origin = _read_config(path, True), path, True, path
    elif (manifest.get("train") or {}).get("lora_rank") is not None:
        # a LoRA run's checkpoints hold the adapters: the base comes from the model it names
        origin = (manifest.get("hf") or {}).get("source")
        if path is not None and Path(path).resolve() != Path(origin).resolve():
            raise ValueError(f"--hf {path}: the run's adapters are on {origin}; leave out --hf")
        try:
            config, source, weights = _read_config(origin, True), origin, True
        except ValueError as e:
            raise ValueError(f"the LoRA run in {out} needs its base model: {e}") from None
    else:
        if model_kind(manifest) != HFRecipe.kind:
            raise ValueError(f"{ckpt} holds tensorpar's GPT, not a fine-tuned Hugging Face "
                             "model: leave out --hf to resume it")
        source = str(Path(out) / HF_FILES)
        origin = (manifest.get("hf") or {}).get("source", source)
        config, weights = _read_config(source, False), False
        theirs = _read_config(path, True) if path is not None else config
        differ = sorted(k for k in config.keys() | theirs.keys() if config.get(k) != theirs.get(k))
        if differ:
            raise ValueError(f"--hf {path}: its config.json differs from the run's ({source}) in "
                             f"{differ[0]} ({theirs.get(differ[0])!r}, the run's "
                             f"{config.get(differ[0])!r}); leave out --hf to resume the run")
    model = _meta_model(source)
    plan = plan_for(model)  # a model no plan covers: the error lists its linear layers
    if "lm_head" not in plan:
        raise ValueError(f"--hf {origin}: the plan of {type(model).__name__} does not split "
                         "lm_head, so the loss cannot run on logits split by vocabulary")
    return HFRecipe(str(source), str(origin), config, plan | {"lm_head": "column"}, weights,
                    has_dropout(model), model)


def resolve_hf(flags: RunFlags) -> tuple[TrainConfig, HFRecipe, str | None]:
    """``tensorpar train --hf PATH`` (or ``--resume`` of such a run, PATH then optional): the
    flags merged and checked as the GPT's (``resume.py``'s ``resolve_run``), with the recipe
    above. The GPT's model flags and ``--tokenizer`` must all be None here."""
    path = flags.hf
    if flags.tokenizer is not None:
        raise ValueError("--tokenizer is the GPT's: a fine-tune reads text with its own "
                         "model's tokenizer")
    given = [f"--{k.replace('_', '-')}" for k, v in flags.model.items() if v is not None]
    if given:
        raise ValueError(f"--hf takes the model from {path or 'the run'}'s config.json: leave "
                         f"out the GPT's model flags {', '.join(given)}")
    out = flags.train.get("out") or TrainConfig.out
    cfg, recipe, resume_from = resolve_run(flags.train, partial(hf_recipe, path, out))
    if cfg.lora_init is not None and resume_from is None:
        _adopt_peft_config(cfg)
        check_init(read_peft(cfg.lora_init)[1], cfg.lora_rank, lora_targets(cfg),
                   recipe.meta_model(), cfg.lora_init)
    if resume_from is not None:
        _check_same_lora(cfg, resume_from)
    if cfg.lora_rank is not None and cfg.lora_targets is not None:  # names in the blocks
        check_targets(lora_targets(cfg), block_linear_kinds(recipe.meta_model()))
    return cfg, recipe, resume_from


def _check_same_lora(cfg: TrainConfig, resume_from: str) -> None:
    """A resumed run keeps its adapters' shapes: another --lora-rank or --lora-targets (or LoRA
    on a run that trained every weight, or none on a LoRA run) is refused in one line."""
    from tensorpar.checkpoint.load import CheckpointReader

    saved = CheckpointReader(resume_from).manifest.get("train") or {}
    mine, theirs = cfg.lora_rank, saved.get("lora_rank")
    run = f"the run in {cfg.out}"
    if (mine is None) != (theirs is None):
        what = "trains every weight" if theirs is None else f"trains LoRA adapters of rank {theirs}"
        raise ValueError(f"--lora-rank {mine}: {run} {what}; leave out --lora-rank to resume "
                         "it, or start a new run in another --out")
    if mine != theirs:
        raise ValueError(f"--lora-rank {mine}: {run} trains adapters of rank {theirs} (its "
                         f"checkpoint {resume_from} holds them); leave out --lora-rank to resume "
                         "it, or start a new run in another --out")
    targets = lambda t: sorted(t.split(",")) if t else None  # noqa: E731
    if targets(cfg.lora_targets) != targets(saved.get("lora_targets")):
        raise ValueError(f"--lora-targets {cfg.lora_targets}: {run} adapts "
                         f"{saved.get('lora_targets') or 'every projection'}; leave out "
                         "--lora-targets to resume it, or start a new run in another --out")


def _adopt_peft_config(cfg: TrainConfig) -> None:
    """``--lora-init DIR``: the rank, alpha and targets of the adapter folder; a flag that says
    otherwise is refused."""
    config, _ = read_peft(cfg.lora_init)
    theirs = {"lora_rank": config["r"], "lora_alpha": float(config["lora_alpha"]),
              "lora_targets": ",".join(sorted(config["target_modules"]))}
    for key, value in theirs.items():
        mine = getattr(cfg, key)
        if key == "lora_alpha" and mine == TrainConfig.lora_alpha:
            mine = None  # the default, not asked for
        if mine is not None and (sorted(mine.split(",")) != sorted(value.split(","))
                                 if key == "lora_targets" else mine != value):
            raise ValueError(f"--{key.replace('_', '-')} {mine} disagrees with --lora-init "
                             f"{cfg.lora_init} ({value})")
        setattr(cfg, key, value)
