"""The GPT's tokenizer: UTF-8 bytes, so any text trains and generation can print any string."""

from __future__ import annotations


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255; decoding replaces invalid sequences."""

    vocab_size = 256
    name = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

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
