"""``tensorpar prepare``: text and JSON-lines files tokenized once into token shards
(``shards.py``), which ``train --data DIR`` memory-maps::

    tensorpar prepare corpus/*.txt --tokenizer ./gpt2-tok --out data/corpus
    tensorpar prepare train.jsonl --tokenizer ./llama-tok --out data/train --shard-tokens 100000000

A text file is one document; a JSON-lines file (``.jsonl``, ``.ndjson``) one document per line, in
its ``"text"`` field. Each document is encoded without special tokens and followed by one
end-of-text id, so the token count is the tokenizer's own count of every document plus one each.
Documents are encoded many at a time by the tokenizers library's batch encoding, which uses
every core. A text file is encoded in pieces of about ``PIECE_CHARS`` characters, each cut just
before a line break that follows a non-space character, so that even one long file keeps every
core busy: a byte-level BPE tokenizer (GPT-2's, Llama 3's) never joins tokens across such a
break, so the ids are those of the whole file. A tokenizer for which a cut changes the ids on a
few probes (one that adds a prefix space to every text it encodes) gets each document whole.

The folder is written next to ``--out`` under a temporary name and renamed at the end: a stopped
or failed prepare leaves nothing at ``--out``.
"""

from __future__ import annotations

import glob
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tensorpar.data.shards import TOKENIZER_DIR, ShardWriter, id_dtype, write_index
from tensorpar.data.tokenizer import HFTokenizer

JSON_LINES = (".jsonl", ".ndjson")
PIECE_CHARS = 1 << 18  # 256 Ki characters: a text file's pieces, encoded in parallel
BATCH_CHARS = 1 << 23  # characters per call of the batch encoder
BATCH_TEXTS = 1024
SHARD_TOKENS = 1 << 28  # 268 million ids a file (512 MiB of uint16)


def input_files(patterns: list[str]) -> list[Path]:
    """The files named or matched (globs, ``**`` too), in the order given, each once."""
    files: list[Path] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) \
            else [pattern]
        if not matched:
            raise ValueError(f"{pattern}: matches no file")
        for name in matched:
            path = Path(name)
            if path.is_dir():
                raise ValueError(f"{name} is a folder: name its files (for example "
                                 f"{Path(name) / '*.txt'})")
            if not path.is_file():
                raise ValueError(f"{name}: no such file")
            if path not in files:
                files.append(path)
    return files


def documents(path: Path, piece_chars: int | None = None) -> Iterator[tuple[str, bool, int]]:
    """The text of ``path`` as (text, ends_a_document, bytes_read) pieces of about
    ``piece_chars`` (None: each document whole); empty documents are left out."""
    with open(path, "rb") as f:
        if path.suffix.lower() in JSON_LINES:
            for n, line in enumerate(f, 1):
                if line.strip() and (text := _json_text(path, n, line)):
                    yield text, True, len(line)
            return
        carry, pending, started = "", 0, False
        while True:
            raw = _utf8(path, f.read(piece_chars or -1), f)
            pending += len(raw)
            text = carry + raw.decode("utf-8")
            if not raw or piece_chars is None:
                if text or started:
                    yield text, True, pending
                return
            cut = _safe_cut(text)
            if cut is None:  # no break to cut at: keep reading
                carry = text
                continue
            yield text[:cut], False, pending
            carry, pending, started = text[cut:], 0, True


def _utf8(path: Path, raw: bytes, f) -> bytes:
    """``raw``, a character split at its end completed from ``f``; an error for bytes that
    are not UTF-8."""
    for _ in range(4):
        try:
            raw.decode("utf-8")
            return raw
        except UnicodeDecodeError as e:
            if e.start < len(raw) - 3 or e.reason != "unexpected end of data":
                raise ValueError(f"{path}: not UTF-8 text (byte {raw[e.start]:#04x} at "
                                 f"{f.tell() - len(raw) + e.start:,}); give text, or JSON lines "
                                 "with a \"text\" field") from None
            more = f.read(1)
            if not more:
                raise ValueError(f"{path}: not UTF-8 text (it ends inside a character)") \
                    from None
            raw += more
    raise ValueError(f"{path}: not UTF-8 text")


def _safe_cut(text: str) -> int | None:
    """The last position before a line break that follows a non-space character."""
    at = len(text)
    while (at := text.rfind("\n", 0, at)) > 0:
        if not text[at - 1].isspace():
            return at
    return None


PROBES = ("The first line.\nThe second one, indented:\n    x = f(1)  # a comment\n\nEnd.\n",
          "naïve café, 3.14 — ✓\nunder_scores and CamelCase\n\t\ttabs\n")


def cuts_safely(tok) -> bool:
    """Whether cutting a text just before a line break that follows a non-space character
    leaves its ids as they are, on a few probes: true of byte-level BPE (GPT-2's, Llama 3's),
    whose pre-tokenizer never joins across such a break; false of a tokenizer that adds a
    prefix space to each text it encodes (sentencepiece's Llama 2), whose documents prepare
    then encodes whole."""
    for text in PROBES:
        whole = tok.encode(text)
        for cut in (i for i in range(1, len(text)) if text[i] == "\n" and
                    not text[i - 1].isspace()):
            if tok.encode(text[:cut]) + tok.encode(text[cut:]) != whole:
                return False
    return True


def _json_text(path: Path, n: int, line: bytes) -> str:
    try:
        record = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} line {n}: not JSON ({e})") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise ValueError(f"{path} line {n}: expected an object with a \"text\" string")
    return record["text"]


def prepare(patterns: list[str], tokenizer_dir: str, out: str,
            shard_tokens: int = SHARD_TOKENS, progress: bool = True) -> dict:
    """Tokenize the files into a shard folder at ``out``; returns its index. Everything that can
    be refused (files, tokenizer, --out) is refused before the first document is read."""
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens {shard_tokens} must be >= 1")
    target = Path(out)
    if target.exists() and not (target.is_dir() and not any(target.iterdir())):
        raise ValueError(f"--out {out} exists: choose another folder, or remove it")
    files = input_files(patterns)
    tok = HFTokenizer(tokenizer_dir)
    if tok.eos_id is None:
        raise ValueError(f"--tokenizer {tokenizer_dir} has no end-of-text token (eos_token in "
                         "tokenizer_config.json), which prepare puts after each document")
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        index = _write(files, tok, tmp, shard_tokens, progress)
        tok.save(tmp / TOKENIZER_DIR)
        write_index(tmp, index)
        if target.exists():
            target.rmdir()
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return index


def _write(files: list[Path], tok: HFTokenizer, folder: Path, shard_tokens: int,
           progress: bool) -> dict:
    start = time.perf_counter()
    dtype = id_dtype(tok.vocab_size)
    writer = ShardWriter(folder, dtype, shard_tokens)
    eos = np.array([tok.eos_id], dtype=np.int64)
    piece_chars = PIECE_CHARS if cuts_safely(tok) else None
    sources = []
    with _Progress(sum(f.stat().st_size for f in files), progress) as bar:
        for path in files:
            counts = {"file": str(path), "documents": 0, "tokens": 0}
            for batch in _batches(documents(path, piece_chars)):
                for ids, ends in zip(tok.encode_batch([t for t, _, _ in batch]),
                                     [e for _, e, _ in batch], strict=True):
                    ids = np.asarray(ids, dtype=np.int64)
                    writer.write(np.concatenate([ids, eos]) if ends else ids)
                    counts["tokens"] += len(ids) + ends
                    counts["documents"] += ends
                bar.advance(sum(n for _, _, n in batch))
            sources.append(counts)
    writer.close()
    seconds = time.perf_counter() - start
    tokens = sum(s["tokens"] for s in sources)
    return {"dtype": dtype,
            "tokenizer": {"files": TOKENIZER_DIR, "source": str(tok.path),
                          "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
            "documents": sum(s["documents"] for s in sources), "tokens": tokens,
            "sha256": writer.hash.hexdigest(), "shards": writer.shards, "sources": sources,
            "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds)}


def _batches(pieces: Iterator[tuple[str, bool, int]]) -> Iterator[list]:
    batch, chars = [], 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece[0])
        if len(batch) >= BATCH_TEXTS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


class _Progress:
    """A rich bar over the input bytes on a terminal; nothing otherwise."""

    def __init__(self, total: int, wanted: bool):
        self.bar = None
        if wanted and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("[bold]prepare"), BarColumn(), DownloadColumn(),
                                TimeRemainingColumn(), console=Console(stderr=True),
                                transient=True)
            self.task = self.bar.add_task("prepare", total=total)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, n)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def summary(out: str, index: dict) -> str:
    """The line prepare ends with."""
    shards = len(index["shards"])
    docs = index["documents"]
    return (f"tensorpar prepare: wrote {out}: {docs:,} document{'s' * (docs != 1)}, "
            f"{index['tokens']:,} tokens ({index['dtype']}, {shards} shard"
            f"{'s' if shards != 1 else ''}) from {len(index['sources'])} file"
            f"{'s' if len(index['sources']) != 1 else ''} in {index['seconds']:.1f} s, "
            f"{index['tokens_per_second']:,} tokens/s")
