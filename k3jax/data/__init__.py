"""Training data: corpus builder, tokenizers, packed batches and synthetic tasks.

``python -m k3jax.data build --source PATH... --out DIR`` builds a corpus; :func:`make_data` turns a
:class:`~k3jax.config.experiment.DataConfig` into a training batch function and a fixed held-out
set.
"""

from k3jax.data.batches import LN2, PackedBatches, bits_per_byte, heldout_batches, window_batch
from k3jax.data.corpus import Corpus, build_corpus, cached_corpus, open_corpus
from k3jax.data.pipeline import DataSource, default_cache_dir, make_data
from k3jax.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer

__all__ = ["BPETokenizer", "ByteTokenizer", "Corpus", "DataSource", "LN2", "PackedBatches",
           "bits_per_byte", "build_corpus", "cached_corpus", "default_cache_dir",
           "heldout_batches", "load_tokenizer", "make_data", "open_corpus", "window_batch"]
