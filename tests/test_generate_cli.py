"""``python -m k3jax.generate``: newest checkpoint + the run's tokenizer; clear errors."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from helpers import host_variables, small_config

from k3jax.generate import forward_logits

PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A run directory as training leaves it: config.json (recording its byte corpus) and one
    checkpoint."""
    import jax

    from configs.k3_tiny import get_config
    from k3jax.data import build_corpus, make_data
    from k3jax.model import logical_axes
    from k3jax.train.checkpoint import Checkpointer
    from k3jax.train.loop import _recorded_config
    from k3jax.train.optim import build_optimizer
    from k3jax.train.step import init_state

    root = tmp_path_factory.mktemp("gen_cli")
    docs = root / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    build_corpus([str(docs)], root / "corpus", tokenizer="byte", heldout_fraction=0.34,
                 log=lambda m: None)
    base = get_config()
    cfg = dataclasses.replace(
        base, model=small_config(vocab_size=256, num_layers=2, mla_every=2, first_k_dense=2,
                                 scan_layers=False),
        data=dataclasses.replace(base.data, data_dir=str(root / "corpus"), seq_len=16,
                                 batch_size=2))
    run = root / "run"
    run.mkdir()
    config = _recorded_config(cfg, make_data(cfg.data, 256, run, 1, log=lambda m: None))
    (run / "config.json").write_text(json.dumps(config, indent=1))
    v = host_variables(cfg.model, cfg.train.seed)
    opt = build_optimizer(cfg.optim, cfg.train.steps, v["params"],
                          logical_axes(cfg.model)["params"])
    # init_state jitted: one compile instead of one per optimizer-state leaf
    state = jax.jit(init_state, static_argnums=(2, 3))(v["params"], v.get("balance", {}), opt,
                                                       cfg.train.seed)
    ckpt = Checkpointer(run / "checkpoints", 1, async_save=False, log=lambda m: None)
    ckpt.save(3, state, {"config": config, "step": 3})
    ckpt.close()
    # committed to the device like the restored checkpoint, so generate() below reuses the
    # programs the command line compiled (jit keys its cache on committedness too)
    variables = {"params": state["params"], "balance": state["balance"]}
    return run, cfg, jax.device_put(variables, jax.devices()[0])


def _main(capsys, *argv):
    from k3jax.generate.__main__ import main

    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_greedy_text_streams_and_is_the_forward_arg_max(workdir, capsys):
    from k3jax.generate.loop import generate
    from k3jax.generate.sampling import SamplingConfig

    run, cfg, variables = workdir
    rc, out, err = _main(capsys, "--workdir", str(run), "--prompt", PROMPT,
                         "--max-new-tokens", "5", "--temperature", "0")
    assert rc == 0, err
    assert "checkpoint step 3" in err
    prompt = list(PROMPT.encode())  # the byte tokenizer: one token per byte
    new = generate(cfg.model, variables, [prompt], 5, SamplingConfig(temperature=0.0))[0]
    # an untrained model emits arbitrary bytes: the stream shows them as a batch prints them
    assert out == PROMPT + bytes(new).decode("utf-8", errors="replace") + "\n"
    logits = forward_logits(cfg.model, variables, np.asarray([prompt + new], np.int32))
    n = len(prompt)
    np.testing.assert_array_equal(np.argmax(logits[0, n - 1:-1], -1), new)  # teacher forcing
    assert len(new) == 5


def _streamed(tok, ids, capsys) -> list[str]:
    """What a stream prints after each token, then at the end."""
    from k3jax.generate.__main__ import _Stream

    stream, pieces = _Stream(tok), []
    for i in ids:
        stream(np.asarray([i]), np.asarray([True]))
        pieces.append(capsys.readouterr().out)
    stream.finish()
    return pieces + [capsys.readouterr().out]


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_a_stream_holds_back_characters_until_their_bytes_are_complete(kind, capsys):
    from k3jax.data import BPETokenizer, ByteTokenizer

    tok = (ByteTokenizer() if kind == "byte"
           else BPETokenizer.train([b"hello world, hello there"] * 20, 260))
    ids = tok.encode("hé€".encode())
    assert len(ids) == 6  # one token per byte: both characters arrive split
    pieces = _streamed(tok, ids, capsys)
    assert "".join(pieces) == "hé€" and pieces[:3] == ["h", "", "é"]


def test_a_stream_ending_inside_a_character_shows_it_replaced(capsys):
    from k3jax.data import ByteTokenizer

    pieces = _streamed(ByteTokenizer(), list(b"a\xe2\x82"), capsys)
    assert pieces == ["a", "", "", "\ufffd"]  # as a batch prints the same tokens


def test_a_batch_of_prompts_from_a_file(workdir, capsys, tmp_path):
    from k3jax.generate.loop import generate
    from k3jax.generate.sampling import SamplingConfig

    run, cfg, variables = workdir
    prompts = ["ab", "xyz1"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    rc, out, err = _main(capsys, "--workdir", str(run), "--prompts-file", str(tmp_path / "p.txt"),
                         "--max-new-tokens", "3", "--top-k", "5", "--seed", "1")
    assert rc == 0, err
    # the new bytes may hold line breaks: the whole output is each prompt's text, in order
    new = generate(cfg.model, variables, [list(p.encode()) for p in prompts], 3,
                   SamplingConfig(top_k=5, seed=1))
    assert len(new) == len(prompts)
    assert out == "".join(p + bytes(n).decode("utf-8", errors="replace") + "\n"
                          for p, n in zip(prompts, new))


@pytest.mark.parametrize("flag, value, expected", [
    ("--temperature", "-1", "expected >= 0"), ("--temperature", "nan", "expected >= 0"),
    ("--top-k", "-2", "expected >= 0"), ("--top-p", "0", r"expected in \(0, 1\]"),
    ("--top-p", "1.5", r"expected in \(0, 1\]"), ("--repetition-penalty", "0", "expected > 0"),
    ("--max-new-tokens", "0", "expected >= 1"), ("--max-len", "-4", "expected >= 1"),
])
def test_bad_flags_are_named_before_anything_is_read(capsys, tmp_path, flag, value, expected):
    rc, out, err = _main(capsys, "--workdir", str(tmp_path / "absent"), "--prompt", "a",
                         flag, value)
    assert rc == 2 and out == ""
    assert re.fullmatch(rf"error: {flag}=\S+ is invalid: {expected}.*\n", err), err


def test_clear_errors(workdir, capsys, tmp_path):
    run, _, _ = workdir
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((run / "config.json").read_text())
    rc, _, err = _main(capsys, "--workdir", str(empty), "--prompt", "a")
    assert rc == 2 and "no checkpoint in this workdir" in err
    rc, _, err = _main(capsys, "--workdir", str(run), "--prompt", "a" * 20, "--max-len", "8",
                       "--max-new-tokens", "2")
    assert rc == 2 and "needs a cache of 21 tokens; --max-len=8" in err
    assert "checkpoint step" not in err  # refused before the checkpoint is restored
    from k3jax.data import BPETokenizer

    BPETokenizer.train([b"hello world, hello there"] * 20, 260).save(tmp_path)
    rc, _, err = _main(capsys, "--workdir", str(run), "--prompt", "a", "--tokenizer",
                       str(tmp_path))
    assert rc == 2 and "tokenizer mismatch" in err and "'bpe'" in err


def _workdir_with(run, directory, change) -> str:
    """A copy of ``run`` whose config.json, and the config its checkpoint records with it, are
    changed by ``change(config)``, as a run made with that config would have left them."""
    import shutil

    from k3jax.train.checkpoint import write_manifest

    shutil.copytree(run / "checkpoints", directory / "checkpoints")
    config = json.loads((run / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))
    for step in (directory / "checkpoints").iterdir():
        meta = step / "meta" / "metadata"
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "config": config}))
        write_manifest(step)
    return str(directory)


def test_the_tokenizer_is_the_recorded_corpus_s_and_nothing_is_built(workdir, capsys, tmp_path,
                                                                     monkeypatch):
    run, _, _ = workdir
    monkeypatch.delenv("K3JAX_DATA_CACHE", raising=False)  # a build would land under tmp_path

    def from_sources(config):  # as a run whose corpus was built into a cache from its sources
        config["data"].update(data_dir=None, sources=[str(run.parent / "docs")])

    moved = _workdir_with(run, tmp_path / "run", from_sources)
    rc, out, err = _main(capsys, "--workdir", moved, "--prompt", PROMPT, "--max-new-tokens", "2",
                         "--temperature", "0")
    assert rc == 0, err
    assert not (tmp_path / ".data").exists()  # where a corpus would have been built


@pytest.mark.parametrize("change, message", [
    (lambda c, gone: c["data"].pop("corpus"), r"no data.corpus .*pass --tokenizer DIR"),
    (lambda c, gone: c["data"]["corpus"].update(corpus=str(gone)),
     r"data.corpus of .*no tokenizer saved with this corpus; pass --tokenizer"),
    (lambda c, gone: c["data"]["corpus"].update(vocab_size=300),
     r"recorded a byte tokenizer of 300 ids in .*which now holds a byte tokenizer of 256"),
], ids=["absent", "gone", "changed"])
def test_a_missing_or_changed_recorded_corpus_is_named(workdir, capsys, tmp_path, change,
                                                       message):
    run, _, _ = workdir
    moved = _workdir_with(run, tmp_path, lambda c: change(c, tmp_path / "gone"))
    rc, out, err = _main(capsys, "--workdir", moved, "--prompt", "a")
    assert rc == 2 and re.search(message, err), err
    assert out == "" and "checkpoint step" not in err  # refused before restoring anything
