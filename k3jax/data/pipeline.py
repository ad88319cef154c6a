"""From a ``DataConfig`` to what the training loop consumes: a batch function and a held-out set."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from k3jax.data.batches import PackedBatches, heldout_batches
from k3jax.data.corpus import cached_corpus, default_sources, open_corpus
from k3jax.data.synthetic import SyntheticBatches, eval_batches

Batch = dict[str, np.ndarray]


@dataclass
class DataSource:
    """``train(i)`` is training batch ``i`` (global batch, [B, T] arrays); ``heldout`` the fixed
    evaluation batches; ``description`` one line for the log."""

    train: Callable[[int], Batch]
    heldout: list[Batch]
    description: str
    corpus_path: Path | None = None


def default_cache_dir(workdir: str | Path) -> Path:
    """Built corpora live next to the run directories (``runs/tiny`` -> ``runs/.data``), unless
    ``K3JAX_DATA_CACHE`` names another place, so every run under ``runs/`` shares one build."""
    env = os.environ.get("K3JAX_DATA_CACHE")
    return Path(env) if env else Path(workdir).resolve().parent / ".data"


def make_data(cfg, vocab_size: int, workdir: str | Path, eval_batches_n: int,
              log=print) -> DataSource:
    """``cfg`` is a DataConfig; ``vocab_size`` the model's."""
    if cfg.task != "corpus":
        train = SyntheticBatches(cfg.task, cfg.seq_len, cfg.batch_size, vocab_size, cfg.seed)
        held = eval_batches(cfg.task, cfg.seq_len, cfg.batch_size, eval_batches_n, vocab_size)
        return DataSource(train, held, f"synthetic task {cfg.task}")
    if cfg.data_dir is not None:
        corpus = open_corpus(cfg.data_dir)
    else:
        cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir(workdir)
        corpus = cached_corpus(list(cfg.sources) or default_sources(), cache,
                               tokenizer=cfg.tokenizer, vocab_size=vocab_size,
                               heldout_fraction=cfg.heldout_fraction,
                               max_doc_bytes=cfg.max_doc_bytes, seed=cfg.seed, log=log)
    if corpus.vocab_size > vocab_size:
        raise ValueError(f"the corpus at {corpus.path} uses {corpus.vocab_size} token ids but "
                         f"model.vocab_size={vocab_size}")
    train = PackedBatches(corpus.train, cfg.seq_len, cfg.batch_size, cfg.seed, corpus.token_bytes)
    held = heldout_batches(corpus.val, cfg.seq_len, cfg.batch_size, eval_batches_n,
                           corpus.token_bytes)
    m = corpus.meta["splits"]
    desc = (f"corpus {corpus.path} ({corpus.meta['tokenizer']} tokenizer, vocab "
            f"{corpus.vocab_size}): train {m['train']['tokens']:,} tokens in "
            f"{m['train']['docs']} documents, held-out {m['val']['tokens']:,} tokens in "
            f"{m['val']['docs']} documents")
    return DataSource(train, held, desc, corpus.path)
