"""``tensorpar prepare``: tokenize text and JSON-lines files once into token shards that
``tensorpar train --data DIR`` memory-maps (``tensorpar/data/prepare.py``)::

    tensorpar prepare corpus/*.txt --tokenizer ./gpt2-tok --out data/corpus
    tensorpar prepare "books/**/*.jsonl" --tokenizer ./llama-tok --out data/books
"""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    from tensorpar.data.prepare import SHARD_TOKENS

    p = sub.add_parser("prepare", help="tokenize text or JSON-lines files into token shards "
                       "for train --data DIR")
    p.add_argument("files", nargs="+", metavar="FILE", help="text files (each one document) "
                   "and JSON-lines files (.jsonl, .ndjson: one document per line, its \"text\" "
                   "field); globs are expanded, ** too (quote them)")
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="a local Hugging Face "
                   "tokenizer folder (tokenizer.json, ...) with an end-of-text token, which "
                   "follows every document; copied into --out (required)")
    p.add_argument("--out", required=True, metavar="DIR", help="the shard folder to write: new "
                   "or empty; written next to it and renamed into place (required)")
    p.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS, metavar="N",
                   help=f"ids per shard file (default {SHARD_TOKENS:,})")
    p.set_defaults(func=run)


def run(args) -> int:
    from tensorpar.data.prepare import prepare, summary

    index = prepare(args.files, args.tokenizer, args.out, args.shard_tokens)
    print(summary(args.out, index), file=sys.stderr)
    return 0
