"""The tokenizers text is read with: UTF-8 bytes (the GPT's default: any text trains, generation
can print any string) or a local Hugging Face tokenizer folder (``--tokenizer DIR`` for the GPT,
a fine-tuned model's own with ``--hf``).

Both give ids without special tokens (``encode``) and decode them back; the folder's also
encodes many texts in one call over every core (``encode_batch``: the tokenizers library's
batch encoding) and has an end-of-text id, which ``tensorpar prepare`` puts after each document.
"""

from __future__ import annotations

from pathlib import Path

# the files a tokenizer folder is recognised by (transformers' save_pretrained writes the first
# two; sentencepiece and GPT-2 style folders carry the others)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
RUN_TOKENIZER = "tokenizer"  # a GPT run's copy of its tokenizer folder, beside its checkpoints


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255; decoding replaces invalid sequences."""

    vocab_size = 256
    name = "bytes"
    eos_id = None  # bytes have no end-of-text token

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        """Bytes to text; invalid UTF-8 and ids outside 0..255 become U+FFFD."""
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
            else:
                out.append(run.decode("utf-8", errors="replace") + "\ufffd")
                run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face tokenizer folder (transformers' ``AutoTokenizer``, nothing
    downloaded). vocab_size: the model's vocabulary, which every id must fall in (default: the
    tokenizer's own size, its added tokens included); flag: the option that named the folder,
    for the errors."""

    name = "hf"

    def __init__(self, path: str | Path, vocab_size: int | None = None, flag: str = "--tokenizer"):
        path = str(path)
        if not Path(path).is_dir() or not any((Path(path) / f).is_file()
                                              for f in TOKENIZER_FILES):
            raise ValueError(f"{flag} {path}: not a tokenizer folder (expected one of "
                             f"{', '.join(TOKENIZER_FILES)})")
        try:
            import transformers
        except ImportError:
            raise ValueError(f"{flag} needs transformers: pip install tensorpar[hf]") from None
        transformers.logging.set_verbosity_error()
        try:
            self.tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: cannot load its tokenizer ({str(e).splitlines()[0]})") \
                from None
        self.path = path
        self.vocab_size = len(self.tok) if vocab_size is None else vocab_size
        self.eos_id = self.tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._checked(self.tok(text, add_special_tokens=False)["input_ids"])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once: a fast tokenizer encodes them in parallel on every core."""
        return [self._checked(ids)
                for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def save(self, folder: Path) -> None:
        """The tokenizer's files in ``folder`` (transformers' ``save_pretrained``)."""
        self.tok.save_pretrained(str(folder))

    def same_as(self, other) -> bool:
        """Whether ``other`` maps text to the same ids (vocabulary and end-of-text)."""
        return (isinstance(other, HFTokenizer) and self.eos_id == other.eos_id
                and self.tok.get_vocab() == other.tok.get_vocab())

    def describe(self) -> str:
        return f"{self.path} ({len(self.tok):,} tokens)"

    def _checked(self, ids: list[int]) -> list[int]:
        if ids and max(ids) >= self.vocab_size:
            raise ValueError(f"the tokenizer of {self.path} gives id {max(ids)}, outside the "
                             f"model's vocabulary of {self.vocab_size}")
        return ids


def describe(tokenizer) -> str:
    """The tokenizer in a few words, for messages."""
    return tokenizer.describe() if isinstance(tokenizer, HFTokenizer) else "bytes (256 tokens)"


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers give the same ids for every text."""
    if isinstance(a, ByteTokenizer) or isinstance(b, ByteTokenizer):
        return isinstance(a, ByteTokenizer) and isinstance(b, ByteTokenizer)
    return a.same_as(b)


def run_tokenizer_dir(manifest: dict, ckpt: Path) -> str | None:
    """The tokenizer folder of the GPT run whose checkpoint ``ckpt`` (``RUN/step-*``) holds
    ``manifest``: None for bytes."""
    kind = manifest.get("tokenizer", ByteTokenizer.name)
    if kind == ByteTokenizer.name:
        return None
    if kind != HFTokenizer.name:
        raise ValueError(f"{ckpt}: tokenizer {kind!r} is not one this tensorpar reads")
    folder = Path(ckpt).parent / manifest.get("tokenizer_files", RUN_TOKENIZER)
    if not folder.is_dir():
        raise ValueError(f"{ckpt}: the run's tokenizer folder {folder} is missing (a checkpoint "
                         "copied without its run folder?): copy the run's tokenizer/ beside it")
    return str(folder)


def run_tokenizer(manifest: dict, ckpt: Path) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of the GPT run whose checkpoint ``ckpt`` holds ``manifest``."""
    folder = run_tokenizer_dir(manifest, ckpt)
    if folder is None:
        return ByteTokenizer()
    return HFTokenizer(folder, manifest["config"]["vocab_size"], flag="the run's tokenizer")
