"""Text generation from a checkpoint, with the model and its KV cache split by heads.

::

    tensorpar generate --ckpt runs/gpt --tp 2 --prompt "The with statement" --max-new-tokens 200
    tensorpar generate --ckpt runs/gpt --tp 4 --prompt "..." --temperature 0.8 --seed 1
    tensorpar generate --ckpt runs/gpt --tp 2 --prompt "def " --prompt "The" --top-k 20 \\
        --top-p 0.9 --temperature 0.8
    tensorpar generate --ckpt runs/gpt --tp 2 --prompt-file prompts.txt   # one prompt a line

Each rank keeps the KV cache of its own heads. The logits stay split by vocabulary: the next token
is chosen from each rank's slice with a few small collectives, never by gathering the logits
(``sampling.py``: greedy, Gumbel-max sampling, top-k, top-p), so greedy and seeded sampled
tokens are the same at every TP size.

Several prompts run as one batch: left-padded to the longest, with an attention mask that keeps
every token off the padding and rotary positions that start at each prompt's first real token,
so each prompt's greedy continuation is the one it gets alone. (A sampled continuation depends
on the seed and on the prompt's place in the batch: the noise is drawn per row.)

Output: one prompt prints its text (the prompt, then the continuation) and a newline. Several
print each text in prompt order, the second and later ones after a line ``--- i`` (i counting
from 1)::

    text 1
    --- 2
    text 2

A run trained with ``--tokenizer DIR`` reads prompts and prints text with its copy of that
tokenizer, and a sequence ends at the tokenizer's end-of-text token. The byte tokenizer has none,
so a byte GPT's text always runs to ``--max-new-tokens``; ``generate(..., eos_id=)`` stops a
sequence at a token of your choosing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tensorpar.checkpoint.format import model_kind
from tensorpar.checkpoint.load import CheckpointReader, load_checkpoint
from tensorpar.data.tokenizer import run_tokenizer
from tensorpar.gpt.model import GPT, GPTConfig
from tensorpar.gpt.sampling import check_sampling, pick_token
from tensorpar.runtime.groups import device_for, tp_rank
from tensorpar.runtime.seeds import derive_seed


def left_pad(seqs: list[list[int]], pad_id: int = 0, device=None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists of any lengths -> ids (B, T) padded on the left with ``pad_id`` and the
    attention mask (B, T): 1 at real tokens, 0 at padding."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for b, s in enumerate(seqs):
        if s:
            ids[b, T - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[b, T - len(s):] = 1
    return ids.to(device), mask.to(device)


def format_completions(texts: list[str]) -> str:
    """What the CLI prints: each text and a newline, ``--- i`` lines before the second on."""
    return "".join((f"--- {i + 1}\n" if i else "") + text + "\n" for i, text in enumerate(texts))


def _check_mask(ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> None:
    if mask_BT.shape != ids_BT.shape:
        raise ValueError(f"attention_mask_BT is {tuple(mask_BT.shape)}, ids_BT "
                         f"{tuple(ids_BT.shape)}: they must match")
    valid = mask_BT.bool()
    if not bool(valid[:, -1].all()) or not bool((valid[:, 1:] >= valid[:, :-1]).all()):
        raise ValueError("attention_mask_BT must pad on the left: 0s, then 1s, and every row "
                         "ends with a real token (see left_pad)")


@torch.no_grad()
def generate(model: GPT, ids_BT: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             seed: int = 0, *, attention_mask_BT: torch.Tensor | None = None, top_k: int = 0,
             top_p: float = 1.0, eos_id: int | None = None) -> torch.Tensor:
    """Extend ``ids_BT`` (the same on every rank) by up to ``max_new_tokens``; (B, T + K).

    attention_mask_BT: prompts of different lengths, left-padded (``left_pad``): 1 at real
        tokens, 0 at padding (which stays in the output). None: every token is real.
    temperature: 0 is greedy; above 0, sampling, among the ``top_k`` most likely tokens (0: all)
        and the most likely ones whose probabilities reach ``top_p`` (1: all).
    eos_id: a sequence ends once it produced this token and its row goes on with ``eos_id``;
        generation stops when every row has ended, so K may be below ``max_new_tokens``. The
        byte GPT has no end-of-text token: None runs every row to ``max_new_tokens``.
    """
    check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens {max_new_tokens} must be >= 0")
    if attention_mask_BT is not None:
        _check_mask(ids_BT, attention_mask_BT)
    if max_new_tokens == 0:
        return ids_BT.clone()
    was_training = model.training
    model.eval()
    B = ids_BT.shape[0]
    cache = model.new_cache(ids_BT.shape[1] + max_new_tokens)
    gen = torch.Generator(ids_BT.device).manual_seed(derive_seed(seed, "sampling")) \
        if temperature > 0 else None
    emb, mask = model.embed, attention_mask_BT
    out = [ids_BT]
    done = torch.zeros(B, dtype=torch.bool, device=ids_BT.device)
    logits = model(ids_BT, cache=cache, attention_mask_BS=mask)[:, -1]  # (B, V_local): prefill
    for i in range(max_new_tokens):
        nxt = pick_token(logits, emb.vocab_start, emb.num_embeddings, temperature, gen,
                         model.group, top_k, top_p)  # (B,), the same on every rank
        if eos_id is not None:
            nxt = torch.where(done, eos_id, nxt)
            done |= nxt == eos_id
        out.append(nxt[:, None])
        if i + 1 == max_new_tokens or bool(done.all()):
            break
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
        logits = model(nxt[:, None], cache=cache, attention_mask_BS=mask)[:, -1]
    model.train(was_training)
    return torch.cat(out, dim=1)


def generate_rank(ckpt: str, prompts: list[str], max_new_tokens: int, temperature: float,
                  seed: int, top_k: int = 0, top_p: float = 1.0,
                  group: ProcessGroup | None = None) -> list[str] | None:
    """Load ``ckpt`` at this group's TP size and continue every prompt (one batch); rank 0
    returns the texts (prompt and continuation), in prompt order."""
    group = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    device = device_for(group)
    reader = CheckpointReader(ckpt)
    cfg = GPTConfig(**reader.manifest["config"])
    model = GPT(cfg, group, device=device)
    load_checkpoint(ckpt, model, check_hashes=False)  # hashed once by check_request()
    tok = run_tokenizer(reader.manifest, reader.dir)  # bytes, or the run's --tokenizer
    seqs = [tok.encode(p) for p in prompts]
    ids, mask = left_pad(seqs, device=device)
    # prompts of one length need no mask: the fused causal attention, as for a single prompt
    out = generate(model, ids, max_new_tokens, temperature, seed, top_k=top_k, top_p=top_p,
                   attention_mask_BT=None if bool(mask.all()) else mask, eos_id=tok.eos_id)
    if tp_rank(group) != 0:
        return None
    T, texts = ids.shape[1], []
    for row, s in zip(out.tolist(), seqs, strict=True):
        new = row[T:]
        if tok.eos_id in new:  # the text ends before its end-of-text token
            new = new[:new.index(tok.eos_id)]
        texts.append(tok.decode(s + new))
    return texts


def check_request(ckpt: str, prompts: list[str], max_new_tokens: int, temperature: float,
                  tp: int, top_k: int = 0, top_p: float = 1.0) -> None:
    """Raise ValueError for a request that cannot run, before any rank starts."""
    if tp < 1:
        raise ValueError(f"--tp {tp} must be >= 1")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens} must be >= 1")
    check_sampling(temperature, top_k, top_p)
    if not prompts:
        raise ValueError("no prompt: give --prompt or --prompt-file")
    for i, prompt in enumerate(prompts):
        if not prompt:
            which = "--prompt" if len(prompts) == 1 else f"prompt {i + 1} of {len(prompts)}"
            raise ValueError(f"{which} is empty: give at least one character")
    reader = CheckpointReader(ckpt)
    reader.verify()
    manifest = reader.manifest
    if model_kind(manifest) != "gpt":
        raise ValueError(f"{reader.dir} holds a model fine-tuned by tensorpar train --hf, not "
                         "the GPT: the command tensorpar generate --ckpt runs it "
                         "(cli/generate.py's run_generate_hf)")
    GPTConfig(**manifest["config"]).check(tp)
    run_tokenizer(manifest, reader.dir)  # bytes, or the run's copy of its tokenizer folder
