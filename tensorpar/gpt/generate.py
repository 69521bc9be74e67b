"""Text generation from a checkpoint, with the model and its KV cache split by heads.

::

    tensorpar generate --ckpt runs/gpt --tp 2 --prompt "The with statement" --max-new-tokens 200
    tensorpar generate --ckpt runs/gpt --tp 4 --prompt "..." --temperature 0.8 --seed 1

Each rank keeps the KV cache of its own heads. The logits stay split by vocabulary: the next token
is chosen by one all-gather of each rank's best (score, token id) per sequence, never of the
logits. Sampling uses the Gumbel-max trick: every rank draws the same noise for the whole
vocabulary from a seeded generator and adds its slice, so the argmax of logits/T + noise is an
exact sample from softmax(logits/T) and the same token at every TP size.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tensorpar.checkpoint.load import CheckpointReader, load_checkpoint
from tensorpar.gpt.data import ByteTokenizer
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.runtime.groups import device_for, tp_rank, tp_size
from tensorpar.runtime.launch import run_ranks
from tensorpar.runtime.seeds import derive_seed


def pick_token(logits_BV_local: torch.Tensor, vocab_start: int, vocab_size: int,
               temperature: float, generator: torch.Generator | None,
               group: ProcessGroup | None = None) -> torch.Tensor:
    """The next token id (B,) from vocab-sharded logits: argmax (temperature 0) or a sample."""
    scores = logits_BV_local.float()
    if temperature > 0:
        B, v_local = scores.shape
        noise = torch.empty(B, vocab_size, device=scores.device).exponential_(generator=generator)
        gumbel = -noise.log()[:, vocab_start:vocab_start + v_local]  # this rank's columns
        scores = scores / temperature + gumbel
    best, idx = scores.max(dim=-1)  # (B,) each
    if tp_size(group) == 1:
        return idx
    # (score, global id) of every rank; float64 holds ids exactly
    mine = torch.stack([best.double(), (idx + vocab_start).double()], dim=-1)  # (B, 2)
    every = [torch.empty_like(mine) for _ in range(tp_size(group))]
    dist.all_gather(every, mine, group=group)
    every = torch.stack(every, dim=1)  # (B, n, 2)
    # the highest score wins; on a tie the lower rank, which holds the lower token id
    winner = every[..., 0].argmax(dim=1)  # first maximum
    return every[torch.arange(len(winner)), winner, 1].long()


@torch.no_grad()
def generate(model: GPT, ids_BT: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0) -> torch.Tensor:
    """Extend ``ids_BT`` (the same on every rank) by ``max_new_tokens``; returns (B, T + K)."""
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature {temperature} must be finite and >= 0")
    was_training = model.training
    model.eval()
    cache = model.new_cache(ids_BT.shape[1] + max_new_tokens)
    gen = torch.Generator(ids_BT.device).manual_seed(derive_seed(seed, "sampling")) \
        if temperature > 0 else None
    emb = model.embed
    out = [ids_BT]
    logits = model(ids_BT, cache=cache)[:, -1]  # (B, V_local): prefill the cache
    for i in range(max_new_tokens):
        nxt = pick_token(logits, emb.vocab_start, emb.num_embeddings, temperature, gen,
                         model.group)
        out.append(nxt[:, None])
        if i + 1 < max_new_tokens:
            logits = model(nxt[:, None], cache=cache)[:, -1]
    model.train(was_training)
    return torch.cat(out, dim=1)


def generate_rank(ckpt: str, prompt: str, max_new_tokens: int, temperature: float, seed: int,
                  group: ProcessGroup | None = None) -> str | None:
    """Load ``ckpt`` at this group's TP size and generate; rank 0 returns the text."""
    group = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    device = device_for(group)
    cfg = GPTConfig(**CheckpointReader(ckpt).manifest["config"])
    model = GPT(cfg, group, device=device)
    load_checkpoint(ckpt, model, check_hashes=False)  # hashed once by check_request()
    tok = ByteTokenizer()
    ids = torch.tensor([tok.encode(prompt)], dtype=torch.long, device=device)
    out = generate(model, ids, max_new_tokens, temperature, seed)
    return tok.decode(out[0].tolist()) if tp_rank(group) == 0 else None


def check_request(ckpt: str, prompt: str, max_new_tokens: int, temperature: float,
                  tp: int) -> None:
    """Raise ValueError for a request that cannot run, before any rank starts."""
    if tp < 1:
        raise ValueError(f"--tp {tp} must be >= 1")
    reader = CheckpointReader(ckpt)
    reader.verify()
    manifest = reader.manifest
    GPTConfig(**manifest["config"]).check(tp)
    if manifest.get("tokenizer", "bytes") != ByteTokenizer.name:
        raise ValueError(f"checkpoint tokenizer {manifest.get('tokenizer')!r} is not supported")
    if not prompt:
        raise ValueError("--prompt is empty: give at least one character")
    if max_new_tokens < 1 or not temperature >= 0 or temperature == float("inf"):
        raise ValueError(f"--max-new-tokens {max_new_tokens} must be >= 1 and --temperature "
                         f"{temperature} >= 0")


def run_generate(ckpt: str, tp: int, prompt: str, max_new_tokens: int, temperature: float,
                 seed: int) -> int:
    check_request(ckpt, prompt, max_new_tokens, temperature, tp)
    texts = run_ranks(generate_rank, tp, ckpt, prompt, max_new_tokens, temperature, seed)
    if texts is not None and texts[0] is not None:
        sys.stdout.write(texts[0] + "\n")
        sys.stdout.flush()
    return 0
