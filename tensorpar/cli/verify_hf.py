"""``tensorpar verify --hf PATH``: a local Hugging Face model directory loaded tensor-parallel
(each rank reads its own slices) and checked against the dense model::

    tensorpar verify --hf ./my-llama --tp 4       # per-layer error table, memory per rank
"""

from __future__ import annotations

import time

import torch

from tensorpar.cli.compare import TOLERANCE, dense_shard, max_rel_error
from tensorpar.cli.hf_dir import check_hf_dir, quiet_transformers, run_hf_ranks
from tensorpar.hf.plans import is_conv1d
from tensorpar.ranks.local import run_ranks
from tensorpar.runtime.counting import CollectiveCounter
from tensorpar.runtime.output import human_bytes
from tensorpar.runtime.torchrun import say


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


def _layer_of(name: str) -> str:
    """'model.layers.3.mlp.up_proj.weight' -> 'layer 3'; others by their module."""
    parts = name.split(".")
    return next((f"layer {p}" for p in parts[:-1] if p.isdigit()), ".".join(parts[:-1]))


def verify_hf_rank(path: str, seed: int, batch: int, seq_len: int, group=None) -> dict:
    """Load ``path`` tensor-parallel and dense; compare hidden states per layer, logits, loss,
    the gradients of each layer, and greedy tokens. Returns the errors and memory of this rank."""
    from accelerate import init_empty_weights

    from tensorpar.hf.pretrained import from_pretrained

    transformers = quiet_transformers()
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
    if getattr(model.config, "output_router_logits", False):  # an MoE asking for its aux loss:
        greedy["output_router_logits"] = False  # not while generating (transformers' own fails)
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
    ok = all(v is None or v <= TOLERANCE for _, *vals in rows for v in vals)
    write(f"tensorpar verify --hf {path}: {results[0]['family']}, TP={n}, fp32, tolerance "
          f"{TOLERANCE:.0e} (max relative error over ranks)")
    write(f"{'':32}{'output':>10}  {'gradients':>10}")
    fmt = lambda v: f"{v:10.2e}" if v is not None else f"{'':10}"  # noqa: E731
    for name, out, grad in rows:
        bad = any(v is not None and v > TOLERANCE for v in (out, grad))
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


def run_verify_hf(path: str, n: int, seed: int = 0, batch: int = 2, seq_len: int = 16,
                  run=run_ranks) -> bool:
    """Print the table; True when everything matches. ``run(fn, n, *args)``: how the n ranks are
    had (default: spawned, or joined under torchrun; tests pass their pool of ranks)."""
    check_hf_dir(path)
    results = run_hf_ranks(verify_hf_rank, n, path, seed, batch, seq_len, run=run)
    # under torchrun every rank judges (and exits) alike; rank 0 prints the table
    return report_hf(results, path, n, say)
