"""The data: text and its tokens (``text``: a corpus read and tokenized, the batch order of
(seed, step)), token shards on disk (``shards``: the format, memory-mapped) and the shard
writer behind ``tensorpar prepare`` (``prepare``), chat and instruction examples (``chat``:
read, masked to their answers, packed), and the tokenizers (``tokenizer``: bytes, or a Hugging
Face tokenizer folder).

Imports only ``runtime`` (the seeds of the batch order); the trainer (``tensorpar.train``), the
GPT and the CLI read their data through it.
"""
