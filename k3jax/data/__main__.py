"""``python -m k3jax.data build --source PATH... --out DIR [--tokenizer bpe --vocab 8192]``."""

from __future__ import annotations

import argparse
import sys

from k3jax.config.base import ConfigError
from k3jax.config.experiment import DataConfig
from k3jax.data.corpus import build_corpus
from k3jax.data.sources import STDLIB
from k3jax.data.tokenizer import check_bpe_vocab


def _check_args(args: argparse.Namespace) -> None:
    """A ValueError naming the flag whose value the build cannot use, before any source is read.
    The ranges are DataConfig's, so a corpus built here can be named in a config."""
    for flag, field, value in (("--heldout", "heldout_fraction", args.heldout),
                               ("--max-doc-bytes", "max_doc_bytes", args.max_doc_bytes)):
        try:
            DataConfig(**{field: value})
        except ConfigError as e:
            raise ValueError(f"{flag} {value}: {e}") from None
    if args.tokenizer == "bpe":
        check_bpe_vocab(args.vocab, "--vocab")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3jax.data")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="tokenise text into a memory-mapped corpus")
    b.add_argument("--source", nargs="+", default=[STDLIB],
                   help="text files, directories, .jsonl, .tar.xz/.txt.xz archives, or 'stdlib' "
                        "(the running interpreter's standard library; the default)")
    b.add_argument("--out", required=True, help="output corpus directory")
    b.add_argument("--tokenizer", choices=("byte", "bpe"), default="byte")
    b.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary size")
    b.add_argument("--heldout", type=float, default=0.02, help="held-out fraction of documents")
    b.add_argument("--max-doc-bytes", type=int, default=65536,
                   help="files above this are cut at paragraph breaks into several documents")
    b.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        _check_args(args)
        build_corpus(args.source, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab,
                     heldout_fraction=args.heldout, max_doc_bytes=args.max_doc_bytes,
                     seed=args.seed)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
