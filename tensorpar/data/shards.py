"""Token shards: a corpus tokenized once (``tensorpar prepare``) and memory-mapped by every rank,
so that a run's start-up time and resident memory do not grow with the corpus.

A shard folder holds::

    index.json          what the folder holds: the id type, the tokenizer, the shards, the
                        documents and tokens of each input file, a hash of every id
    tokens-00000.bin    token ids, one after another (uint16 for a vocabulary up to 65,536,
    tokens-00001.bin    else uint32), little-endian, no header: numpy.fromfile reads them
    tokenizer/          the tokenizer's files (save_pretrained), so the folder is self-contained

Each document is its ids followed by one end-of-text id; the shards read in order are one
sequence of ids, and the trainer cuts that sequence into windows exactly as it cuts a text
file's ids (``text.py``), a window running across a shard's end into the next.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path

import numpy as np
import torch

INDEX = "index.json"
FORMAT = "tensorpar token shards"
VERSION = 1
TOKENIZER_DIR = "tokenizer"
_HASH_CHUNK = 1 << 20  # ids hashed at a time, as int64 (the hash of the text path's ids too)


def id_dtype(vocab_size: int) -> str:
    """The id type of a vocabulary: uint16 up to 65,536 ids, else uint32."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def ids_hash() -> hashlib._Hash:
    """The hash of a sequence of ids, fed as int64 bytes (``update_ids``)."""
    return hashlib.sha256()


def update_ids(h, ids: np.ndarray) -> None:
    for start in range(0, len(ids), _HASH_CHUNK):
        h.update(ids[start:start + _HASH_CHUNK].astype("<i8").tobytes())


class ShardWriter:
    """Appends documents' ids to ``tokens-NNNNN.bin`` files in ``folder``, starting a new file
    once one holds ``shard_tokens`` ids (a document may run across two files)."""

    def __init__(self, folder: Path, dtype: str, shard_tokens: int):
        self.folder, self.dtype, self.shard_tokens = folder, np.dtype(dtype).newbyteorder("<"), \
            shard_tokens
        self.shards: list[dict] = []
        self.hash = ids_hash()
        self._file = None
        self._left = 0

    def write(self, ids: np.ndarray) -> None:
        update_ids(self.hash, ids)
        ids = ids.astype(self.dtype, copy=False)
        while len(ids):
            if self._left == 0:
                self._next_file()
            part, ids = ids[:self._left], ids[self._left:]
            part.tofile(self._file)
            self._left -= len(part)
            self.shards[-1]["tokens"] += len(part)

    def _next_file(self) -> None:
        if self._file is not None:
            self._file.close()
        name = f"tokens-{len(self.shards):05d}.bin"
        self._file = open(self.folder / name, "wb")
        self.shards.append({"file": name, "tokens": 0})
        self._left = self.shard_tokens

    def close(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


def write_index(folder: Path, index: dict) -> None:
    tmp = folder / f".{INDEX}.tmp"
    tmp.write_text(json.dumps({"format": FORMAT, "version": VERSION} | index, indent=1) + "\n")
    os.replace(tmp, folder / INDEX)


def _mapped(path: Path, dtype: np.dtype) -> np.ndarray:
    """The file's ids, memory-mapped read-only and advised random access: a window's read
    brings in its own pages, not the kernel's read-ahead around them (8 MiB a fault on a disk
    measured here: a cold 1 GB corpus then waited 3-4% of each step, against 0.2% advised)."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):  # Linux, macOS
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=dtype)


def is_shard_folder(path: str | Path) -> bool:
    return (Path(path) / INDEX).is_file()


class TokenShards:
    """A shard folder, memory-mapped, read as one sequence of ids: ``len(shards)`` ids;
    ``shards[a:b]`` the ids a .. b-1 as an int64 tensor (only the pages read become resident).

    flag: the option that named the folder, for the errors (each one line, before any rank)."""

    def __init__(self, folder: str | Path, flag: str = "--data"):
        self.folder = Path(folder)
        where = f"{flag} {folder}"
        try:
            index = json.loads((self.folder / INDEX).read_text())
        except FileNotFoundError:
            raise ValueError(f"{where}: a folder without {INDEX}: expected a text file or a "
                             "folder of token shards written by tensorpar prepare") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{where}/{INDEX}: unreadable ({e})") from None
        if not isinstance(index, dict) or index.get("format") != FORMAT:
            raise ValueError(f"{where}/{INDEX}: not the index of tensorpar prepare's shards")
        if index.get("version") != VERSION:
            raise ValueError(f"{where}/{INDEX}: shard format version {index.get('version')}; "
                             f"this tensorpar reads version {VERSION}")
        self.index = index
        self.dtype = np.dtype(index["dtype"]).newbyteorder("<")
        self.maps, starts = [], [0]
        for shard in index["shards"]:
            path = self.folder / shard["file"]
            want = shard["tokens"] * self.dtype.itemsize
            size = path.stat().st_size if path.is_file() else None
            if size != want:
                found = "missing" if size is None else f"{size:,} bytes"
                raise ValueError(f"{where}: {shard['file']} is {found}; the index says "
                                 f"{want:,} bytes ({shard['tokens']:,} ids): prepare it again")
            self.maps.append(_mapped(path, self.dtype))
            starts.append(starts[-1] + shard["tokens"])
        self.starts = starts
        self.digest = index["sha256"][:16]
        self.vocab_size = index["tokenizer"]["vocab_size"]

    @property
    def tokenizer_dir(self) -> Path:
        return self.folder / TOKENIZER_DIR

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, s: slice) -> torch.Tensor:
        start, stop, step = s.indices(len(self))
        if step != 1:
            raise ValueError("token shards are read in contiguous ranges")
        parts = []
        for i, (lo, hi) in enumerate(zip(self.starts[:-1], self.starts[1:], strict=True)):
            if lo < stop and start < hi:
                parts.append(self.maps[i][max(start, lo) - lo: min(stop, hi) - lo])
        ids = np.concatenate(parts) if parts else np.empty(0, dtype=self.dtype)
        return torch.from_numpy(ids.astype(np.int64))
