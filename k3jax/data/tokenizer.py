"""Byte-level tokenizers: raw bytes (vocab 256) or a byte-level BPE trained with ``tokenizers``.

Both expose ``encode(bytes) -> np.ndarray``, ``decode(ids) -> bytes`` and ``token_bytes`` (how many
bytes of text each token id stands for), which is what bits-per-byte accounting needs: a byte-level
BPE token always decodes to the same bytes, so the bytes of a batch are a table lookup.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

TOKENIZER_FILE = "tokenizer.json"


class ByteTokenizer:
    kind = "byte"
    vocab_size = 256

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> bytes:
        return bytes(int(i) for i in ids)

    @property
    def token_bytes(self) -> np.ndarray:
        return np.ones(256, np.int32)

    def save(self, out: Path) -> None:
        (out / TOKENIZER_FILE).write_text(json.dumps({"kind": "byte"}))


def _byte_to_char() -> dict[int, str]:
    """The byte-level alphabet: printable Latin-1 bytes stand for themselves, the rest are moved
    to code points from 256 up, so every byte is one visible character (GPT-2's convention, which
    ``tokenizers.pre_tokenizers.ByteLevel`` uses)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class BPETokenizer:
    """A byte-level BPE (``tokenizers``); ids below ``vocab_size``."""

    kind = "bpe"

    def __init__(self, tok):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size()
        char_to_byte = {c: b for b, c in _byte_to_char().items()}
        lengths = np.zeros(self.vocab_size, np.int32)
        for piece, i in tok.get_vocab().items():
            lengths[i] = sum(1 for c in piece if c in char_to_byte)
        self._token_bytes = lengths

    @classmethod
    def train(cls, texts: Iterable[bytes], vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        check_bpe_vocab(vocab_size, "vocab_size")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator((t.decode("utf-8", errors="replace") for t in texts), trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: Path) -> "BPETokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def encode(self, data: bytes) -> np.ndarray:
        ids = self._tok.encode(data.decode("utf-8", errors="replace")).ids
        return np.asarray(ids, dtype=np.int32)

    def encode_batch(self, docs: list[bytes]) -> list[np.ndarray]:
        texts = [d.decode("utf-8", errors="replace") for d in docs]
        return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> bytes:
        return self._tok.decode([int(i) for i in ids]).encode("utf-8")

    @property
    def token_bytes(self) -> np.ndarray:
        return self._token_bytes

    def save(self, out: Path) -> None:
        self._tok.save(str(out / TOKENIZER_FILE))


def check_bpe_vocab(vocab_size: int, name: str) -> None:
    """A ValueError naming ``name`` unless ``vocab_size`` leaves a BPE room for a merge: its
    first 256 ids are the bytes themselves, and the trainer quietly returns those alone when asked
    for fewer."""
    if vocab_size <= ByteTokenizer.vocab_size:
        raise ValueError(f"{name}={vocab_size} is invalid: a byte-level BPE needs more than "
                         f"{ByteTokenizer.vocab_size} tokens (its first "
                         f"{ByteTokenizer.vocab_size} are the bytes)")


def load_tokenizer(data_dir: Path) -> ByteTokenizer | BPETokenizer:
    path = Path(data_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no tokenizer saved with this corpus")
    if json.loads(path.read_text()).get("kind") == "byte":
        return ByteTokenizer()
    return BPETokenizer.load(path)
