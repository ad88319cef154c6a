"""Corpus builder, tokenizers, packed batches and synthetic tasks (no model needed)."""

import json
import lzma
import os
import tarfile

import numpy as np
import pytest

from k3jax.data import (
    BPETokenizer,
    PackedBatches,
    bits_per_byte,
    build_corpus,
    cached_corpus,
    heldout_batches,
    load_tokenizer,
    open_corpus,
    window_batch,
)
from k3jax.data.__main__ import main as data_main
from k3jax.data.sources import split_document
from k3jax.data.synthetic import TASKS, make_batch

TEXTS = {f"doc{i}.txt": (f"Document {i}: "
                         + "the quick brown fox jumps over the lazy dog. " * (i + 3)
                         + "caf\u00e9 \u65e5\u672c\n") for i in range(12)}


@pytest.fixture
def source_dir(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name, text in TEXTS.items():
        (src / name).write_text(text, encoding="utf-8")
    (src / "image.bin").write_bytes(b"\0\1\2binary")  # not text: skipped in a directory
    return src


def _all_docs(corpus):
    out = []
    for split in (corpus.train, corpus.val):
        out += [bytes(split.tokens[a:b].astype(np.uint8)) for a, b in
                zip(split.docs[:-1], split.docs[1:])]
    return out


def test_byte_corpus_boundaries_and_split(source_dir, tmp_path):
    corpus = build_corpus([str(source_dir)], tmp_path / "c", heldout_fraction=0.2, log=lambda m: 0)
    assert corpus.train.num_docs + corpus.val.num_docs == len(TEXTS)
    assert corpus.val.num_docs >= 1 and corpus.train.num_docs >= 1
    # Every document comes back exactly, once, between its boundaries.
    assert sorted(_all_docs(corpus)) == sorted(t.encode() for t in TEXTS.values())
    # The split is by document and deterministic: a rebuild holds out the same documents.
    again = build_corpus([str(source_dir)], tmp_path / "d", heldout_fraction=0.2, log=lambda m: 0)
    assert np.array_equal(again.val.tokens, corpus.val.tokens)
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    assert meta["splits"]["train"]["bytes"] + meta["splits"]["val"]["bytes"] == sum(
        len(t.encode()) for t in TEXTS.values())


def test_archives_jsonl_and_cli(tmp_path):
    tar_path = tmp_path / "a.tar.xz"
    with tarfile.open(tar_path, "w:xz") as tar:
        for name, text in list(TEXTS.items())[:4]:
            p = tmp_path / name
            p.write_text(text, encoding="utf-8")
            tar.add(p, arcname=name)
    xz_path = tmp_path / "b.txt.xz"
    xz_path.write_bytes(lzma.compress(TEXTS["doc5.txt"].encode()))
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": TEXTS[f"doc{i}.txt"]}) for i in (6, 7)))
    assert data_main(["build", "--source", str(tar_path), str(xz_path), str(jsonl),
                      "--out", str(tmp_path / "out"), "--heldout", "0.3"]) == 0
    got = sorted(_all_docs(open_corpus(tmp_path / "out")))
    want = sorted(TEXTS[f"doc{i}.txt"].encode() for i in (0, 1, 2, 3, 5, 6, 7))
    assert got == want
    assert data_main(["build", "--source", str(tmp_path / "nope"), "--out",
                      str(tmp_path / "x")]) == 2


def test_cached_corpus_sees_a_file_edited_inside_a_directory(source_dir, tmp_path):
    def cached():
        return cached_corpus([str(source_dir)], tmp_path / "cache", tokenizer="byte",
                             vocab_size=256, heldout_fraction=0.2, max_doc_bytes=65536, seed=0,
                             log=lambda m: 0)

    (source_dir / "sub").mkdir()
    (source_dir / "sub" / "early.txt").write_text("a file in a subdirectory\n")
    dir_time = source_dir.stat().st_mtime_ns
    first = cached()
    assert cached().path == first.path  # unchanged sources: the built corpus is reused
    (source_dir / "sub" / "late.txt").write_text("a file added to the subdirectory\n")
    added = cached()
    assert added.path != first.path
    doc = source_dir / "doc3.txt"
    doc.write_text(doc.read_text().replace("quick", "QUICK"))  # in place, same size
    os.utime(doc, ns=(doc.stat().st_atime_ns, doc.stat().st_mtime_ns + 10**9))
    edited = cached()
    assert edited.path != added.path
    assert any(b"QUICK" in d for d in _all_docs(edited))
    assert source_dir.stat().st_mtime_ns == dir_time  # the directory itself looked unchanged


def test_large_files_are_cut_at_paragraphs(tmp_path):
    big = "\n\n".join(f"paragraph {i} " + "x" * 50 for i in range(40))
    (tmp_path / "big.txt").write_text(big)
    (tmp_path / "small.txt").write_text("small document\n")
    corpus = build_corpus([str(tmp_path / "big.txt"), str(tmp_path / "small.txt")],
                          tmp_path / "c", max_doc_bytes=300, log=lambda m: 0)
    docs = _all_docs(corpus)
    assert len(docs) > 10 and all(len(d) <= 300 for d in docs)
    assert b"".join(d for d in docs if d != b"small document\n") == big.encode()


@pytest.mark.parametrize("size", [0, -1])
def test_piece_size_below_one_byte_is_refused(source_dir, tmp_path, capsys, size):
    # (a piece of no bytes never moved the cut forward: the build never ended)
    with pytest.raises(ValueError, match=f"max_doc_bytes={size} is invalid: expected a positive"):
        next(split_document("g", b"some text\n\nmore text\n", size))
    assert data_main(["build", "--source", str(source_dir), "--out", str(tmp_path / "c"),
                      "--max-doc-bytes", str(size)]) == 2
    assert f"--max-doc-bytes {size}: " in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("args, named", [
    (["--heldout", "7"], "--heldout 7.0: DataConfig.heldout_fraction=7.0 is invalid: expected a "
                         "fraction in (0, 0.5)"),
    (["--heldout", "0"], "--heldout 0.0: "),
    (["--tokenizer", "bpe", "--vocab", "5"], "--vocab=5 is invalid: a byte-level BPE needs more "
                                             "than 256 tokens"),
    (["--tokenizer", "bpe", "--vocab", "256"], "--vocab=256 is invalid"),
], ids=["heldout-7", "heldout-0", "vocab-5", "vocab-256"])
def test_unusable_build_flags_are_named(source_dir, tmp_path, capsys, args, named):
    # (a held-out fraction outside the range fell back to one document held out; a BPE asked
    # for 256 tokens or fewer came back as the 256 bytes alone)
    assert data_main(["build", "--source", str(source_dir), "--out", str(tmp_path / "c"),
                      *args]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_bpe_round_trip_and_token_bytes(source_dir, tmp_path):
    corpus = build_corpus([str(source_dir)], tmp_path / "c", tokenizer="bpe", vocab_size=300,
                          log=lambda m: 0)
    tok = load_tokenizer(tmp_path / "c")
    assert tok.vocab_size <= 300 and corpus.vocab_size == tok.vocab_size
    text = "def f(x):\n    return  x**2  # caf\u00e9 \u65e5\u672c\t\n\n".encode()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text)  # merges were learnt
    assert int(tok.token_bytes[ids].sum()) == len(text)  # exact bytes for bits per byte
    # The stored documents decode back to the sources.
    docs = [tok.decode(corpus.train.tokens[a:b]) for a, b in
            zip(corpus.train.docs[:-1], corpus.train.docs[1:])]
    assert set(docs) <= {t.encode() for t in TEXTS.values()}
    with pytest.raises(ValueError, match="vocab_size=256 is invalid"):
        BPETokenizer.train([b"text"], 256)


def test_packed_batches_segments_and_weights(source_dir, tmp_path):
    corpus = build_corpus([str(source_dir)], tmp_path / "c", log=lambda m: 0)
    seq = 48
    batches = PackedBatches(corpus.train, seq, 4, seed=3, token_bytes=corpus.token_bytes)
    b = batches(5)
    assert b["tokens"].shape == (4, seq) and b["tokens"].dtype == np.int32
    assert np.array_equal(b["targets"][:, :-1], b["tokens"][:, 1:])
    # A pure function of (seed, index): the data position is the step.
    assert all(np.array_equal(b[k], batches(5)[k]) for k in b)
    # Segment ids are non-decreasing from 1 and weights are 0 exactly at document starts.
    starts = np.arange(batches.num_windows) * seq
    full = window_batch(corpus.train, starts, seq, corpus.token_bytes)
    seg, w = full["segment_ids"], full["weights"]
    assert (seg[:, 0] == 1).all() and (np.diff(seg, axis=1) >= 0).all()
    boundary = np.zeros_like(w, bool)
    boundary[:, :-1] = np.diff(seg, axis=1) > 0
    doc_starts = set(corpus.train.docs[1:-1].tolist())
    idx = starts[:, None] + np.arange(1, seq + 1)[None]
    assert np.array_equal(w == 0, np.isin(idx, list(doc_starts)))
    assert np.array_equal(boundary[:, :-1], (w == 0)[:, :-1])
    assert full["nbytes"] == w.sum()  # byte tokenizer: one byte per token
    held = heldout_batches(corpus.val, 16, 2, 3, corpus.token_bytes)
    assert len(held) >= 1 and all(h["tokens"].shape == held[0]["tokens"].shape for h in held)
    assert bits_per_byte(np.log(2) * 10.0, 10.0) == pytest.approx(1.0)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_synthetic_tasks_answers_follow_the_rules(task):
    b = make_batch(task, np.random.default_rng(0), 3, 64, 64)
    tok, tgt, w = b["tokens"], b["targets"], b["weights"]
    assert tok.shape == tgt.shape == w.shape == (3, 64) and w.sum() > 0
    assert np.array_equal(tgt[:, :-1], tok[:, 1:])
    for r in range(3):
        seq = np.concatenate([tok[r], tgt[r, -1:]])
        answers = [(t + 1, int(seq[t + 1])) for t in np.flatnonzero(w[r])]
        if task == "palindrome":
            n = 32
            assert all(v == seq[2 * n - p] for p, v in answers)
        elif task == "parity":
            assert all(v - 8 == (seq[0:p:2] - 8).sum() % 2 for p, v in answers)
        elif task == "mqar":
            pairs = dict(zip(seq[0:32:2].tolist(), seq[1:32:2].tolist()))
            assert all(pairs[int(seq[p - 1])] == v for p, v in answers)
        elif task == "stack":
            stacks = {}
            for t in range(0, len(seq) - 2, 3):
                op, s, x = seq[t:t + 3].tolist()
                if op == 2:
                    stacks.setdefault(s, []).append(x)
                elif op == 3:
                    assert stacks[s].pop() == x and w[r, t + 1] == 1
