"""From a ``DataConfig`` to what the training loop consumes: a batch function and a held-out set."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from k3jax.config.base import ConfigError
from k3jax.data.batches import PackedBatches, heldout_batches
from k3jax.data.corpus import Corpus, cached_corpus, default_sources, open_corpus
from k3jax.data.sources import STDLIB
from k3jax.data.synthetic import SyntheticBatches, eval_batches

Batch = dict[str, np.ndarray]


@dataclass
class DataSource:
    """``train(i)`` is training batch ``i`` (global batch, [B, T] arrays); ``heldout`` the fixed
    evaluation batches; ``description`` one line for the log; ``tokenizer`` what made the tokens
    (``{"kind", "vocab_size", "corpus"}``, None for a synthetic task); ``has_bytes`` whether
    bits per byte mean anything (text, not a synthetic task)."""

    train: Callable[[int], Batch]
    heldout: list[Batch]
    description: str
    corpus_path: Path | None = None
    tokenizer: dict | None = None
    has_bytes: bool = True


def default_cache_dir(workdir: str | Path) -> Path:
    """Built corpora live next to the run directories (``runs/tiny`` -> ``runs/.data``), unless
    ``K3JAX_DATA_CACHE`` names another place, so every run under ``runs/`` shares one build."""
    env = os.environ.get("K3JAX_DATA_CACHE")
    return Path(env) if env else Path(workdir).resolve().parent / ".data"


def make_data(cfg, vocab_size: int, workdir: str | Path, eval_batches_n: int,
              log=print) -> DataSource:
    """``cfg`` is a DataConfig; ``vocab_size`` the model's. A corpus that cannot be used (missing,
    too short, ids outside the model's vocabulary) is a ConfigError saying what to pass."""
    try:
        if cfg.task != "corpus":
            train = SyntheticBatches(cfg.task, cfg.seq_len, cfg.batch_size, vocab_size, cfg.seed)
            held = eval_batches(cfg.task, cfg.seq_len, cfg.batch_size, eval_batches_n,
                                vocab_size)
            return DataSource(train, held, f"synthetic task {cfg.task}", has_bytes=False)
        corpus = _corpus(cfg, vocab_size, workdir, log)
        check_token_ids(corpus, vocab_size)
        train = PackedBatches(corpus.train, cfg.seq_len, cfg.batch_size, cfg.seed,
                              corpus.token_bytes)
        held = heldout_batches(corpus.val, cfg.seq_len, cfg.batch_size, eval_batches_n,
                               corpus.token_bytes)
    except ConfigError:
        raise
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data: {e}") from None
    m = corpus.meta["splits"]
    desc = (f"corpus {corpus.path} ({corpus.meta['tokenizer']} tokenizer, vocab "
            f"{corpus.vocab_size}): train {m['train']['tokens']:,} tokens in "
            f"{m['train']['docs']} documents, held-out {m['val']['tokens']:,} tokens in "
            f"{m['val']['docs']} documents")
    used = {"kind": corpus.meta["tokenizer"], "vocab_size": corpus.vocab_size,
            "corpus": str(corpus.path)}
    return DataSource(train, held, desc, corpus.path, used)


def _corpus(cfg, vocab_size: int, workdir, log) -> Corpus:
    if cfg.data_dir is not None:
        if not Path(cfg.data_dir).is_dir():
            raise ConfigError(f"data.data_dir={cfg.data_dir!r}: no such directory; build a corpus "
                              f"there with `{build_command(cfg, vocab_size, cfg.data_dir)}`")
        return open_corpus(cfg.data_dir)
    missing = [s for s in cfg.sources if s != STDLIB and not Path(s).exists()]
    if missing:
        raise ConfigError(f"data.sources: {missing[0]!r}: no such file or directory")
    if not cfg.sources:
        log(f"[data] note: no corpus given (data.sources, data.data_dir): training on the Python "
            f"standard library, tokenised with this config's {cfg.tokenizer} tokenizer. For your "
            f"own text: --set data.sources=FILE_OR_DIR, or build once with "
            f"`{build_command(cfg, vocab_size, 'DIR')}` and --set data.data_dir=DIR")
    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir(workdir)
    return cached_corpus(list(cfg.sources) or default_sources(), cache,
                         tokenizer=cfg.tokenizer, vocab_size=vocab_size,
                         heldout_fraction=cfg.heldout_fraction, max_doc_bytes=cfg.max_doc_bytes,
                         seed=cfg.seed, log=log)


def build_command(cfg, vocab_size: int, out: str) -> str:
    """The ``python -m k3jax.data build`` line that makes a corpus this config can train on."""
    tok = f" --tokenizer bpe --vocab {vocab_size}" if cfg.tokenizer == "bpe" else ""
    return f"python -m k3jax.data build --source FILES_OR_DIRS --out {out}{tok}"


def check_token_ids(corpus: Corpus, vocab_size: int) -> None:
    """Every token id of the corpus below ``vocab_size`` (ConfigError naming both otherwise);
    one pass over the memory-mapped splits when the run starts, not a check per batch."""
    if corpus.vocab_size > vocab_size:
        raise ConfigError(f"data: the corpus at {corpus.path} has a vocabulary of "
                          f"{corpus.vocab_size} tokens but model.vocab_size={vocab_size}; pass "
                          f"--set model.vocab_size={corpus.vocab_size} (or more), or a corpus "
                          "built for this model")
    for name in ("train", "val"):
        tokens = corpus.split(name).tokens
        top = int(tokens.max()) if len(tokens) else -1
        if top >= vocab_size:
            raise ConfigError(f"data: the {name} split of the corpus at {corpus.path} holds token "
                              f"id {top}, outside model.vocab_size={vocab_size}; the corpus is "
                              "damaged or from another tokenizer: rebuild it")
