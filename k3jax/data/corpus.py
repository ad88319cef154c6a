"""Build and open a tokenised corpus: memory-mapped token arrays, document boundaries, a held-out
split by document, and the tokenizer that made them.

Layout of a corpus directory::

    meta.json          tokenizer kind, vocab, sources, token/byte/document counts per split
    tokenizer.json     the tokenizer (byte marker or the trained BPE)
    token_bytes.npy    [vocab] int32, bytes of text per token id (bits-per-byte accounting)
    {split}.tokens.npy [N] uint16/uint32, all documents of the split back to back
    {split}.docs.npy   [D+1] int64, document d is tokens[docs[d]:docs[d+1]]

Splits are ``train`` and ``val``. A document goes to ``val`` when a hash of its group (the file it
came from) falls below ``heldout_fraction``, so the split does not depend on source order.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3jax.data.sources import STDLIB, Document, directory_files, iter_documents, stdlib_dir
from k3jax.data.tokenizer import BPETokenizer, ByteTokenizer

FORMAT_VERSION = 1
SPLITS = ("train", "val")
BPE_TRAIN_BYTES = 32 << 20  # the BPE learns its merges from the first 32 MiB of training text


@dataclass(frozen=True)
class Split:
    """One split, memory-mapped: ``tokens`` [N], ``docs`` [D+1] offsets."""

    tokens: np.ndarray
    docs: np.ndarray

    @property
    def num_docs(self) -> int:
        return len(self.docs) - 1


@dataclass(frozen=True)
class Corpus:
    path: Path
    meta: dict
    token_bytes: np.ndarray
    train: Split
    val: Split

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def split(self, name: str) -> Split:
        return {"train": self.train, "val": self.val}[name]


def open_corpus(path: str | Path) -> Corpus:
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path}: not a corpus directory (no meta.json); build one with "
                                "`python -m k3jax.data build --source PATH --out DIR`")
    meta = json.loads(meta_file.read_text())
    splits = {s: Split(np.load(path / f"{s}.tokens.npy", mmap_mode="r"),
                       np.load(path / f"{s}.docs.npy")) for s in SPLITS}
    return Corpus(path, meta, np.load(path / "token_bytes.npy"), **splits)


def is_heldout(group: str, fraction: float, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{group}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < fraction


def build_corpus(sources: list[str], out: str | Path, *, tokenizer: str = "byte",
                 vocab_size: int = 256, heldout_fraction: float = 0.02, max_doc_bytes: int = 65536,
                 seed: int = 0, log=print) -> Corpus:
    """Read ``sources``, tokenise, split by document and write a corpus directory at ``out``.

    Written into a temporary sibling and renamed, so a crash never leaves half a corpus at ``out``.
    """
    out = Path(out)
    docs = list(iter_documents(sources, max_doc_bytes))
    if not docs:
        raise ValueError(f"--source {sources}: no text documents found")
    val_mask = _heldout_mask(docs, heldout_fraction, seed)
    tok = _make_tokenizer(tokenizer, vocab_size, [d.data for d, v in zip(docs, val_mask) if not v])
    if tok.kind == "bpe" and tok.vocab_size < vocab_size:
        log(f"[data] note: the BPE reached {tok.vocab_size:,} tokens, fewer than the "
            f"{vocab_size:,} asked: the training text has no more merges to learn. Token ids "
            f"stop at {tok.vocab_size - 1}; a model with a larger vocabulary trains, its extra "
            "rows unused")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        counts = {}
        for name, want_val in (("train", False), ("val", True)):
            part = [d for d, v in zip(docs, val_mask) if v == want_val]
            counts[name] = _write_split(tmp, name, part, tok)
        tok.save(tmp)
        np.save(tmp / "token_bytes.npy", tok.token_bytes.astype(np.int32))
        meta = {"format": FORMAT_VERSION, "tokenizer": tok.kind, "vocab_size": tok.vocab_size,
                "sources": sources, "heldout_fraction": heldout_fraction,
                "max_doc_bytes": max_doc_bytes, "seed": seed, "splits": counts}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for name, c in counts.items():
        log(f"[data] {out} {name}: {c['docs']} documents, {c['tokens']:,} tokens, "
            f"{c['bytes']:,} bytes ({tok.kind} tokenizer, vocab {tok.vocab_size})")
    return open_corpus(out)


def _heldout_mask(docs: list[Document], fraction: float, seed: int) -> list[bool]:
    mask = [is_heldout(d.group, fraction, seed) for d in docs]
    groups = sorted({d.group for d in docs})
    if len(groups) < 2:
        raise ValueError(f"a held-out split by document needs at least two source documents, "
                         f"found {len(groups)}")
    if not any(mask) or all(mask):
        # Tiny corpora: hold out the single group with the smallest hash (or keep one for training).
        first = min(groups, key=lambda g: hashlib.sha256(f"{seed}:{g}".encode()).digest())
        mask = [d.group == first for d in docs]
    return mask


def _make_tokenizer(kind: str, vocab_size: int, train_texts: list[bytes]):
    if kind == "byte":
        return ByteTokenizer()
    if kind != "bpe":
        raise ValueError(f"tokenizer={kind!r}: expected 'byte' or 'bpe'")
    sample, total = [], 0
    for t in train_texts:
        if total >= BPE_TRAIN_BYTES:
            break
        sample.append(t)
        total += len(t)
    return BPETokenizer.train(sample, vocab_size)


def _write_split(out: Path, name: str, docs: list[Document], tok) -> dict:
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    encoded = (tok.encode_batch([d.data for d in docs]) if hasattr(tok, "encode_batch")
               else [tok.encode(d.data) for d in docs])
    offsets = np.zeros(len(encoded) + 1, np.int64)
    offsets[1:] = np.cumsum([len(e) for e in encoded])
    tokens = np.concatenate(encoded).astype(dtype) if encoded else np.zeros(0, dtype)
    np.save(out / f"{name}.tokens.npy", tokens)
    np.save(out / f"{name}.docs.npy", offsets)
    return {"docs": len(docs), "tokens": int(offsets[-1]), "bytes": sum(len(d.data) for d in docs)}


def default_sources() -> list[str]:
    return [STDLIB]


def cached_corpus(sources: list[str], cache_dir: str | Path, *, tokenizer: str, vocab_size: int,
                  heldout_fraction: float, max_doc_bytes: int, seed: int, log=print) -> Corpus:
    """Open the corpus built from these settings in ``cache_dir``, building it on first use."""
    key = {"sources": [_source_id(s) for s in sources], "tokenizer": tokenizer,
           "vocab": vocab_size if tokenizer == "bpe" else 256, "heldout": heldout_fraction,
           "max_doc_bytes": max_doc_bytes, "seed": seed, "format": FORMAT_VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    name = "stdlib" if sources == [STDLIB] else "corpus"
    path = Path(cache_dir) / f"{name}-{tokenizer}{key['vocab']}-{digest}"
    if (path / "meta.json").is_file():
        return open_corpus(path)
    log(f"[data] building the corpus once into {path} (sources: {', '.join(sources)})")
    return build_corpus(sources, path, tokenizer=tokenizer, vocab_size=vocab_size,
                        heldout_fraction=heldout_fraction, max_doc_bytes=max_doc_bytes,
                        seed=seed, log=log)


def _source_id(source: str) -> str:
    """Identify a source by path and modification time, so an edited source is rebuilt. A
    directory's own time changes when an entry is added, removed or renamed in it, not when a file
    in it is rewritten nor when anything changes in a subdirectory: a directory is identified by
    its files' count, newest time and total size (one stat per file, no reading)."""
    if source == STDLIB:
        return f"stdlib:{stdlib_dir()}:{sys.version_info[:3]}"
    p = Path(source).resolve()
    if not p.exists():
        return f"{p}:missing"
    if not p.is_dir():
        return f"{p}:{p.stat().st_mtime_ns}"
    stats = [f.stat() for f in directory_files(p)]
    return (f"{p}:{len(stats)} files:{max((s.st_mtime_ns for s in stats), default=0)}:"
            f"{sum(s.st_size for s in stats)}")
