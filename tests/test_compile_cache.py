"""The compilation cache runs use, and the XLA autotuning results k3jax ships for it: the tables
are XLA's own files, seeding copies the missing ones byte for byte and keeps what a machine wrote
itself, and packing a cache back into tables loses nothing.

What the results buy (XLA reads them instead of tuning) needs a GPU: docs/benchmarks.md has the
measured compile times.
"""

import base64
import json

import jax
import pytest

from k3jax.parallel import compile_cache
from k3jax.parallel.compile_cache import (
    AUTOTUNE_DIR,
    SHIPPED,
    pack,
    seed,
    seed_cache_in_use,
    use_compilation_cache,
)


def _files(root):
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _cache_with(tmp_path, name, files):
    folder = tmp_path / name / AUTOTUNE_DIR / "gpu0"
    folder.mkdir(parents=True)
    for file, data in files.items():
        (folder / file).write_bytes(data)
    return tmp_path / name


def test_shipped_tables_are_xla_results_for_their_subdirectory():
    tables = sorted(SHIPPED.glob("*.json"))
    assert tables, f"no autotuning tables in {SHIPPED}"
    for table in tables:
        record = json.loads(table.read_text())
        assert table.stem == record["subdirectory"]
        assert record["device"] and record["versions"]["jax"] == jax.__version__
        for name, data in record["results"].items():
            raw = base64.b64decode(data, validate=True)
            # XLA's result names the subdirectory (the GPU model) and the fusion it is for.
            assert record["subdirectory"].encode() in raw, name
            assert name.removesuffix(".pb").encode() in raw, name


def test_pack_then_seed_gives_the_same_files(tmp_path):
    cache = _cache_with(tmp_path, "run", {"a.pb": b"\x00\x01 first", "b.pb": b"second"})
    [table] = pack(cache, tmp_path / "tables", device="GPU X")
    assert json.loads(table.read_text())["device"] == "GPU X"
    assert seed(tmp_path / "other", "GPU Y", tmp_path / "tables") == 0  # tuned on another GPU
    assert seed(tmp_path / "new", "GPU X", tmp_path / "tables") == 2
    assert _files(tmp_path / "new") == _files(cache)
    assert seed(tmp_path / "new", "GPU X", tmp_path / "tables") == 0  # nothing missing any more


def test_pack_adds_to_a_table_and_seed_keeps_local_results(tmp_path):
    tables = tmp_path / "tables"
    pack(_cache_with(tmp_path, "one", {"a.pb": b"A", "b.pb": b"old"}), tables, device="GPU X")
    pack(_cache_with(tmp_path, "two", {"b.pb": b"new", "c.pb": b"C"}), tables)
    [table] = tables.glob("*.json")
    record = json.loads(table.read_text())
    assert record["device"] == "GPU X"
    assert {k: base64.b64decode(v) for k, v in record["results"].items()} == {
        "a.pb": b"A", "b.pb": b"new", "c.pb": b"C"}

    local = _cache_with(tmp_path, "local", {"a.pb": b"this machine's"})
    assert seed(local, tables=tables) == 2
    assert (local / AUTOTUNE_DIR / "gpu0" / "a.pb").read_bytes() == b"this machine's"


def test_pack_names_a_directory_without_results(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=rf"cache=.*no {AUTOTUNE_DIR}"):
        pack(tmp_path, tmp_path / "tables")
    with pytest.raises(SystemExit, match="error: cache="):
        compile_cache.main(["pack", str(tmp_path), "--tables", str(tmp_path / "tables")])


def _shipped(device: str) -> int:
    """How many results the shipped tables hold for ``device``."""
    records = [json.loads(t.read_text()) for t in SHIPPED.glob("*.json")]
    return sum(len(r["results"]) for r in records if r["device"] == device)


@pytest.mark.parametrize("from_env", [False, True])
def test_the_cache_in_use_is_seeded_on_a_gpu_with_its_tables(tmp_path, monkeypatch, from_env,
                                                             restore_cache_config):
    if from_env:
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
    else:
        monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    cache = use_compilation_cache(tmp_path / "default")
    assert cache == (tmp_path / ("env" if from_env else "default")).resolve()
    assert jax.config.jax_compilation_cache_dir == str(cache)
    assert not cache.exists()  # nothing written until something compiles
    assert seed_cache_in_use() == 0  # no table was tuned on this CPU
    assert not cache.exists()
    monkeypatch.setattr(compile_cache, "_device_kind", lambda: "NVIDIA H200")
    assert seed_cache_in_use() == _shipped("NVIDIA H200") > 0
    assert len(list((cache / AUTOTUNE_DIR).rglob("*.pb"))) == _shipped("NVIDIA H200")


def test_an_unwritable_cache_costs_a_warning_not_the_run(tmp_path, monkeypatch,
                                                         restore_cache_config):
    (tmp_path / "a_file").write_text("x")
    use_compilation_cache(tmp_path / "a_file" / ".jax_cache")
    monkeypatch.setattr(compile_cache, "_device_kind", lambda: "NVIDIA H200")
    with pytest.warns(UserWarning, match=r"autotuning results were not copied into .*a_file"):
        assert seed_cache_in_use() == 0
