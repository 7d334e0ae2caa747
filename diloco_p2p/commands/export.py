"""`diloco-p2p export`: a checkpoint as a transformers model (save_pretrained)."""

from __future__ import annotations

import argparse
from pathlib import Path

from diloco_p2p.logs import setup_logging


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a transformers model (save_pretrained)")
    p.add_argument("--checkpoint", type=Path, required=True, help="a run directory (or its checkpoints/)")
    p.add_argument("--out", type=Path, required=True, help="directory for the model and tokenizer")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from diloco_p2p.ops.transfer import export

    setup_logging("INFO", False)
    export(args.checkpoint, args.out)
    print(f"wrote {args.out}: load it with AutoModelForCausalLM.from_pretrained({str(args.out)!r})")
    return 0
