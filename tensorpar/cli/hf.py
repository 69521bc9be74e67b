"""``tensorpar verify --hf PATH`` and ``tensorpar generate --hf PATH``: a local Hugging Face model
directory loaded tensor-parallel (each rank reads its own slices) and checked against, or used
like, the dense model::

    tensorpar verify --hf ./my-llama --tp 4       # per-layer error table, memory per rank
    tensorpar generate --hf ./my-llama --tp 2 --prompt "Once upon a time" --max-new-tokens 40
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from tensorpar.cli.verify import dense_shard, max_rel_error
from tensorpar.hf.plans import is_conv1d
from tensorpar.ranks.local import RankError, run_ranks
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.runtime.output import human_bytes
from tensorpar.runtime.torchrun import say, speaks

TOL = 1e-5


def _private_memory() -> int | None:
    """This process's anonymous resident memory in bytes (Linux ``RssAnon``), or None.

    Pages of the memory-mapped safetensors files are left out: they are page cache, shared by
    every rank reading the file, and reclaimable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _layer_of(name: str) -> str:
    """'model.layers.3.mlp.up_proj.weight' -> 'layer 3'; others by their module."""
    parts = name.split(".")
    return next((f"layer {p}" for p in parts[:-1] if p.isdigit()), ".".join(parts[:-1]))


def verify_hf_rank(path: str, seed: int, batch: int, seq_len: int, group=None) -> dict:
    """Load ``path`` tensor-parallel and dense; compare hidden states per layer, logits, loss,
    the gradients of each layer, and greedy tokens. Returns the errors and memory of this rank."""
    from accelerate import init_empty_weights

    from tensorpar.hf.pretrained import from_pretrained

    transformers = _quiet_transformers()
    config = transformers.AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):  # imports the model's code before measuring
        transformers.AutoModelForCausalLM.from_config(config)
    rss0, t0 = _private_memory(), time.perf_counter()
    model = from_pretrained(path, group)
    model.gather_logits = True  # the logits whole with labels too: compared with the dense ones
    load_s, rss1 = time.perf_counter() - t0, _private_memory()
    dense = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=gen)
    ref = dense(ids, labels=ids, output_hidden_states=True)
    with CollectiveCounter() as fwd:
        out = model(ids, labels=ids, output_hidden_states=True)
    ref.loss.backward()
    with CollectiveCounter() as bwd:
        out.loss.backward()
    rows = [("embeddings", max_rel_error(out.hidden_states[0], ref.hidden_states[0]), None)]
    grads: dict[str, float] = {}
    dense_params = dict(dense.named_parameters())
    for name, p in model.named_parameters():
        g = dense_params[name].grad
        if name.endswith(".weight") and is_conv1d(dense.get_submodule(name.rpartition(".")[0])):
            g = g.t()  # GPT-2's Conv1D stores (in, out); shards are (out, in), as nn.Linear
        key = _layer_of(name)
        grads[key] = max(grads.get(key, 0.0), max_rel_error(p.grad, dense_shard(g, p.tp_shard)))
    n_layers = len(out.hidden_states) - 1
    for i in range(1, n_layers + 1):
        rows.append((f"layer {i - 1}", max_rel_error(out.hidden_states[i], ref.hidden_states[i]),
                     grads.pop(f"layer {i - 1}", None)))
    rows.append(("logits", max_rel_error(out.logits, ref.logits), None))
    rows.append(("loss", max_rel_error(out.loss, ref.loss), None))
    rows += [(f"{key} (weights)", None, err) for key, err in grads.items()]
    greedy = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    model.eval()
    same = torch.equal(model.generate(ids[:, :8], **greedy), dense.generate(ids[:, :8], **greedy))
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    full = sum(p.numel() * p.element_size() for p in dense.parameters())
    return {"rows": rows, "greedy_same": same, "local_bytes": local, "dense_bytes": full,
            "rss_load": None if rss0 is None else rss1 - rss0, "load_s": load_s,
            "forward": dict(fwd.counts), "backward": dict(bwd.counts),
            "family": model.config.model_type}


def report_hf(results: list[dict], path: str, n: int, write=print) -> bool:
    rows = [[name, out, grad] for name, out, grad in results[0]["rows"]]
    for r in results[1:]:  # worst over ranks
        for row, (_, out, grad) in zip(rows, r["rows"], strict=True):
            row[1] = None if out is None else max(row[1], out)
            row[2] = None if grad is None else max(row[2], grad)
    ok = all(v is None or v <= TOL for _, *vals in rows for v in vals)
    write(f"tensorpar verify --hf {path}: {results[0]['family']}, TP={n}, fp32, tolerance "
          f"{TOL:.0e} (max relative error over ranks)")
    write(f"{'':32}{'output':>10}  {'gradients':>10}")
    fmt = lambda v: f"{v:10.2e}" if v is not None else f"{'':10}"  # noqa: E731
    for name, out, grad in rows:
        bad = any(v is not None and v > TOL for v in (out, grad))
        write(f"{name:32}{fmt(out)}  {fmt(grad)}  {'MISMATCH' if bad else 'ok'}")
    same = all(r["greedy_same"] for r in results)
    write(f"{'greedy tokens (12 new)':32}{'identical' if same else 'DIFFER'}")
    write(f"{'collectives per rank':32}forward {results[0]['forward']}  backward "
          f"{results[0]['backward']}")
    dense = results[0]["dense_bytes"]
    for r, res in enumerate(results):
        rss = "" if res["rss_load"] is None else \
            f", private memory +{human_bytes(res['rss_load'])} after loading"
        write(f"rank {r}: parameters {human_bytes(res['local_bytes'])} of "
              f"{human_bytes(dense)} ({res['local_bytes'] / dense:.1%}){rss}, "
              f"loaded in {res['load_s']:.2f} s")
    ok = ok and same
    write("all outputs, gradients and greedy tokens match" if ok else "MISMATCH")
    return ok


def _check_dir(path: str) -> None:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ValueError(f"--hf {path}: not a Hugging Face model directory (no config.json)")
    try:
        _quiet_transformers()
    except ImportError:
        raise ValueError("--hf needs transformers: pip install tensorpar[hf]") from None


def _run(fn, n: int, *args, run=run_ranks):
    try:
        return run(fn, n, *args)
    except RankError as e:  # the ranks refused the model (unsupported, ...): a bad request (2)
        if e.expected and all(f.kind == "ValueError" for f in e.failures):
            raise ValueError(e.failures[-1].message) from None
        raise  # a full disk, a bug, ...: cli.main tells them apart


def run_verify_hf(path: str, n: int, seed: int = 0, batch: int = 2, seq_len: int = 16,
                  run=run_ranks) -> bool:
    """Print the table; True when everything matches. ``run(fn, n, *args)``: how the n ranks are
    had (default: spawned, or joined under torchrun; tests pass their pool of ranks)."""
    _check_dir(path)
    results = _run(verify_hf_rank, n, path, seed, batch, seq_len, run=run)
    # under torchrun every rank judges (and exits) alike; rank 0 prints the table
    return report_hf(results, path, n, say)


def _eos_and_pad(model, tok) -> tuple[list[int], int]:
    """The end-of-text ids (generation config, model config, then tokenizer) and the id that
    pads: the generation config's, else the first end-of-text id, else 0."""
    gen_cfg = model.generation_config
    eos = next((e for e in (gen_cfg.eos_token_id, model.config.eos_token_id,
                            tok.eos_token_id if tok is not None else None) if e is not None), [])
    eos = [eos] if isinstance(eos, int) else list(eos)
    pad = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else (eos[0] if eos else 0)
    return eos, pad


def _model(path: str, ckpt: str | None, group):
    """The model to generate with: the folder ``path``, or the checkpoint ``ckpt`` of a run of
    ``train --hf`` (``path`` then its copy of the model's files): a fine-tune's weights, or a
    LoRA run's adapters on the base model it names."""
    from tensorpar.hf.pretrained import from_pretrained

    if ckpt is None:
        return from_pretrained(path, group)
    from tensorpar.checkpoint.load import CheckpointReader, load_checkpoint
    from tensorpar.hf.lora import add_lora, lora_settings

    manifest = CheckpointReader(ckpt).manifest
    lora = lora_settings(manifest)
    if lora is None:
        model = from_pretrained(path, group, weights=False)
    else:
        model = from_pretrained(lora["base"], group)
        adapted = {n.rsplit(".", 3)[-3] for n in manifest["tensors"]
                   if n.endswith(".lora_A.weight") and not n.startswith("optimizer.")}
        add_lora(model, lora["rank"], lora["alpha"], sorted(adapted))
    load_checkpoint(ckpt, model, check_hashes=False)  # hashed before the ranks started
    return model.eval()


def generate_hf_rank(path: str, prompts: list[str] | None, prompt_ids: list[int] | None,
                     max_new_tokens: int, temperature: float, seed: int, top_k: int = 0,
                     top_p: float = 1.0, ckpt: str | None = None, chat: bool = False,
                     group=None) -> list[str]:
    """Load ``path`` (or the run's checkpoint ``ckpt``, see ``_model``) tensor-parallel and
    continue the prompts (one left-padded batch) or the single sequence ``prompt_ids`` with
    transformers' ``generate``; each sequence stops at its end-of-text token. Returns the
    texts (or the ids, space-separated) on every rank. chat: each prompt is a user message
    rendered by the tokenizer's chat template with the generation prompt, and the text is the
    reply alone, without special tokens."""
    from tensorpar.gpt.generate import left_pad

    transformers = _quiet_transformers()
    model = _model(path, ckpt, group)
    tok = transformers.AutoTokenizer.from_pretrained(path) if prompts is not None else None
    if chat:
        seqs = [chat_ids(tok, p) for p in prompts]
    else:
        seqs = [tok(p)["input_ids"] for p in prompts] if tok is not None else [prompt_ids]
    for i, seq in enumerate(seqs):
        if not seq:
            raise ValueError(f"prompt {i + 1} of {len(seqs)} gives no token")
    eos, pad = _eos_and_pad(model, tok)
    ids, mask = left_pad(seqs, pad)
    torch.manual_seed(seed)  # the same on every rank: the gathered logits are, too
    kw = {"do_sample": True, "temperature": temperature, "top_k": top_k, "top_p": top_p} \
        if temperature > 0 else {"do_sample": False}
    if eos:
        kw["eos_token_id"] = eos
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         pad_token_id=pad, **kw).tolist()
    texts = []
    for row, seq in zip(out, seqs, strict=True):
        new = row[ids.shape[1]:]
        ends = [i for i, t in enumerate(new) if t in eos]
        new = new[:ends[0] + 1 if ends else len(new)]  # none after eos
        if chat:
            texts.append(tok.decode(new, skip_special_tokens=True))
            continue
        row = seq + new  # no left padding
        texts.append(tok.decode(row) if tok is not None else " ".join(map(str, row)))
    return texts


def chat_ids(tok, prompt: str) -> list[int]:
    """``prompt`` as a user message, rendered by the chat template with the generation prompt:
    the ids the model continues with its reply."""
    return list(tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                        add_generation_prompt=True,
                                        return_dict=True)["input_ids"])


def _check_chat(path: str, prompts: list[str] | None) -> None:
    """--chat needs prompts and a tokenizer with a chat template."""
    if prompts is None:
        raise ValueError("--chat renders --prompt as a user message: give --prompt or "
                         "--prompt-file, not --prompt-ids")
    tok = _quiet_transformers().AutoTokenizer.from_pretrained(path)
    if not tok.chat_template:
        raise ValueError(f"--chat: the tokenizer of {path} has no chat template (its "
                         "tokenizer_config.json's chat_template, or chat_template.jinja)")


def run_generate_hf(path: str | None, n: int, prompts: list[str] | None,
                    prompt_ids: str | None, max_new_tokens: int, temperature: float, seed: int,
                    top_k: int = 0, top_p: float = 1.0, ckpt: str | None = None,
                    chat: bool = False) -> int:
    """``tensorpar generate --hf PATH`` (or ``--ckpt RUN`` of a run of ``train --hf``, full or
    LoRA; ``path`` None): continue each prompt (or the ``--prompt-ids`` sequence) on ``n``
    ranks and print the texts: one prompt, its text; several, separated by ``--- i`` lines
    (see ``tensorpar.gpt.generate``)."""
    from tensorpar.gpt.generate import format_completions
    from tensorpar.gpt.sampling import check_sampling

    if ckpt is not None:
        from tensorpar.checkpoint.load import CheckpointReader
        from tensorpar.hf.export_finetuned import run_files

        reader = CheckpointReader(ckpt)
        reader.verify()
        path, ckpt = str(run_files(reader)), str(reader.dir)
    _check_dir(path)
    if n < 1:
        raise ValueError(f"--tp {n} must be >= 1")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens} must be >= 1")
    check_sampling(temperature, top_k, top_p)
    if (prompts is None) == (prompt_ids is None):
        raise ValueError("give --prompt or --prompt-file (with a tokenizer in the model "
                         "directory), or --prompt-ids 1,2,3")
    if prompts is not None and not any((Path(path) / f).is_file()
                                       for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"{path} has no tokenizer: pass --prompt-ids instead of --prompt")
    if chat:
        _check_chat(path, prompts)
    ids = None
    if prompt_ids is not None:
        try:
            ids = [int(t) for t in prompt_ids.split(",")]
        except ValueError:
            raise ValueError(f"--prompt-ids {prompt_ids!r}: expected token ids like 1,2,3") \
                from None
    results = _run(generate_hf_rank, n, path, prompts, ids, max_new_tokens, temperature, seed,
                   top_k, top_p, ckpt, chat)
    if speaks():  # rank 0's completions, once (under torchrun too)
        sys.stdout.write(format_completions(results[0]))
    return 0
