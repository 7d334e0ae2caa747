"""`diloco-p2p prepare`: tokenize a corpus once into memory-mapped shards and a manifest."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from diloco_p2p.errors import UserError
from diloco_p2p.logs import setup_logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="tokenize a corpus once into shards + manifest.json (train with data.path=DIR)")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text files, directories, JSONL or Parquet files, or a datasets save_to_disk directory")
    p.add_argument("--out", type=Path, required=True, help="output directory (an interrupted prepare resumes there)")
    p.add_argument("--tokenizer", metavar="TOKENIZER_DIR",
                   help="local transformers tokenizer directory (as model.tokenizer_path); default: bytes")
    p.add_argument("--text-field", default="text", help="the text field of JSONL / Parquet / Arrow rows")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="threads of the fast tokenizer")
    p.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (default 8Mi: 16 MiB of uint16 ids)")
    p.add_argument("--eval-fraction", type=float, default=0.02, help="share of windows held out for evaluation")
    p.add_argument("--max-bytes", type=int, default=None, help="read at most this many bytes of text")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from diloco_p2p.config import ModelConfig
    from diloco_p2p.data.encode import tokenizer_identity
    from diloco_p2p.data.prepare import DEFAULT_SHARD_TOKENS, prepare
    from diloco_p2p.model.build import build_tokenizer

    setup_logging("INFO", False)
    for flag, value, ok in (("--workers", args.workers, args.workers >= 1),
                            ("--shard-tokens", args.shard_tokens, args.shard_tokens is None or args.shard_tokens > 0),
                            ("--eval-fraction", args.eval_fraction, 0 < args.eval_fraction < 0.5),
                            ("--max-bytes", args.max_bytes, args.max_bytes is None or args.max_bytes > 0)):
        if not ok:
            raise UserError(f"{flag} {value} is out of range; see diloco-p2p prepare --help")
    model_cfg = ModelConfig(tokenizer_path=args.tokenizer)
    tokenizer = build_tokenizer(model_cfg)
    identity = tokenizer_identity(model_cfg, tokenizer)
    result = prepare(args.inputs, args.out, tokenizer, identity, text_field=args.text_field,
                     shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS, eval_fraction=args.eval_fraction,
                     max_bytes=args.max_bytes, workers=args.workers, progress=not args.quiet)
    m = result.manifest
    if result.reused:
        print(f"{args.out} already holds this corpus: dataset {m.id}")
        return 0
    mb = result.text_bytes / 1e6
    print(f"{result.documents:,} documents, {mb:,.1f} MB of text -> {m.total_tokens:,} {m.dtype.name} tokens in "
          f"{len(m.shards)} shard(s), {result.seconds:.1f} s ({mb / max(result.seconds, 1e-9):,.0f} MB/s)")
    if result.replaced_docs:
        print(f"{result.replaced_docs:,} document(s) held bytes that are not UTF-8: replaced with U+FFFD")
    print(f"dataset {m.id}\ntrain on it with: --set data.path={args.out}")
    return 0
