"""The data: text and its tokens (``text``: a corpus read and tokenized), token shards on disk
(``shards``: the format, memory-mapped) and the shard writer behind ``tensorpar prepare``
(``prepare``), chat and instruction examples (``formats``: each record's form recognised and
checked; ``chat``: read, masked to their answers), how
tokens become batches in the order of (seed, step) (``packing``: text windows, examples one a
row or packed, the validation data), and the tokenizers (``tokenizer``: bytes, or a Hugging
Face tokenizer folder).

Imports only ``runtime`` (the seeds of the batch order); the trainer (``tensorpar.train``), the
GPT and the CLI read their data through it.
"""
