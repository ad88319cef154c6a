"""The benchmark scripts still run: each on toy shapes on the CPU, every JSON line without an error.

They are timed on GPUs only (docs/benchmarks.md); this guards them against bit rot between GPU
runs, and checks the lines carry the fields the docs read from them.
"""

from __future__ import annotations

import collections
import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from suite_env import subprocess_env, xla_flags

from k3jax.ops.tolerance import BF16_OUT_TOL

ROOT = Path(__file__).resolve().parents[1]
# k3_tiny cut to one KDA and one MLA layer (dense FFN, then MoE; one AttnRes block) with KDA chunks
# of 16, so a 32-token sequence still spans two chunks: every part, half the compile time.
TINY_MODEL = ["--set", "model.num_layers=2", "--set", "model.mla_every=2",
              "--set", "model.kda.chunk_size=16"]
# k3_tiny cut to its MLA layer with an MoE FFN (the router's balancing state, the dispatch) and a
# plain residual, for the scripts whose checks do not depend on the layer kinds: a KDA layer
# doubles the CPU compile, and AttnRes's depth mixing adds to it.
MOE_LAYER = ["--set", "model.num_layers=1", "--set", "model.first_k_dense=0",
             "--set", "model.residual.kind=plain"]
# k3_tiny cut to its MLA layer with a dense FFN, for compile_time.py, whose checks depend on no
# part of the model: its step compiles in about half the time of MOE_LAYER's on the CPU.
DENSE_LAYER = ["--set", "model.num_layers=1"]


def _call(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    # One device: the script sets its own device count where it needs more.
    env = subprocess_env(PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _run(args: list[str], timeout: int = 600) -> list[dict]:
    out = _call(args, timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    # stdout is JSON lines alone (tables and progress go to stderr)
    assert all(line.startswith("{") for line in out.stdout.splitlines() if line.strip())
    return _rows(out.stdout)


def _rows(out: str) -> list[dict]:
    """The JSON lines of a benchmark's stdout, each checked for an error."""
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert rows, out[-2000:]
    errors = [r for r in rows if "error" in r]
    assert not errors, errors
    return rows


def _main(capsys, name: str, argv: list[str]) -> list[dict]:
    """``benchmarks/NAME.py``'s ``main(argv)`` run in this process, its JSON lines (``_rows``).
    In this process, the programs the benchmark shares with others (its inputs' random draws,
    say) compile once, and jax is imported once. compile_time's and attnres's ``main`` switch
    the persistent cache off (every compile they time is XLA's): their tests take
    ``restore_cache_config``."""
    capsys.readouterr()
    assert not _benchmark(name).main(argv)  # None or 0
    return _rows(capsys.readouterr().out)


def _benchmark(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` imported into this process: the scripts import their helpers as
    top-level modules, so the folder is on the path while it loads."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture()
def point_env(monkeypatch):
    """The environment scale_out.py's points inherit from this process: the suite's compile flags
    without this process's device count (the script gives each point its own)."""
    monkeypatch.setenv("XLA_FLAGS", xla_flags(None))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")


@pytest.fixture(scope="module")
def sampled_profile(tmp_path_factory):
    """``(rows, out)``: one run of the step profiler under the host sampler (which runs the script
    as ``__main__``) with ``--out out``, read by the step profiler's test and the sampler's.
    Sampled every 20 ms: the initialiser's trace lasts a few tenths of a second on this toy
    model, where 0.1 s would leave it a couple of samples on a loaded machine."""
    out = tmp_path_factory.mktemp("step_profile") / "profile"  # made by the script
    rows = _run(["benchmarks/host_timeline.py", "--interval", "0.02", "--min-s", "0", "--",
                 "benchmarks/step_profile.py", "--config", "k3_tiny", *TINY_MODEL, "--batch", "2",
                 "--seq", "32", "--docs", "3", "--warmup", "0", "--steps", "1",
                 "--trace-steps", "1", "--out", str(out)])
    return rows, out


def test_step_profile_sorts_the_steps_kernels_by_category_and_source(sampled_profile):
    """The step profiler on the CPU's thunks: every kernel found in the compiled module, the
    layer kinds' named scopes in the sources, and the files it writes. (Its run under the host
    sampler; test_scale_out_runs_each_layout_on_its_own_devices runs it as a process of its own.)"""
    rows, out = sampled_profile
    (head,) = [r for r in rows if r.get("bench") == "step_profile"]
    assert head["tokens_per_s"] > 0 and head["busy_ms"] > 0 and head["compile_s"] > 0
    assert head["docs_per_row"] == 3
    cats = {r["category"]: r for r in rows if "category" in r and "source" not in r}
    assert {"matmul", "fusion"} <= set(cats)
    assert "other" not in cats  # no kernel without its instruction
    assert abs(sum(r["share"] for r in cats.values()) - 1) < 1e-3
    assert any("source" in r for r in rows)
    programs = {r["program"]: r["ms"] for r in rows if "program" in r}
    assert set(programs) == {"jit_gradients", "jit_update"}, programs  # the step's two programs
    ops = [json.loads(line) for line in (out / "ops.jsonl").read_text().splitlines()]
    assert ops and all(op["calls"] >= 1 for op in ops)
    assert {op["module"] for op in ops} == set(programs)
    assert any(op.get("GB", 0) > 0 for op in ops if op["category"] == "fusion")
    # From every kernel, not the printed top sources: their order follows timings, which a
    # loaded machine shuffles.
    scopes = {op["source"].split("/")[0] for op in ops}
    assert {"kda", "mla", "moe"} <= scopes, scopes
    assert (out / "hlo.txt.gz").stat().st_size > 0


def test_host_timeline_splits_a_runs_main_thread_into_phases(sampled_profile):
    """The step profiler under the host sampler: its own lines, then stretches and totals; the
    initialiser's trace is found at its entry into the library."""
    rows, _ = sampled_profile
    assert any(r.get("bench") == "step_profile" for r in rows)
    spans = [r for r in rows if r.get("bench") == "host_timeline" and "start_s" in r]
    totals = {r["activity"]: r for r in rows if "total_s" in r}
    assert {"trace", "lower", "compile"} <= set(totals), totals
    assert any(s["activity"] == "trace" and s["entry"] == "model.py:abstract_variables_and_axes"
               for s in spans), spans


def test_host_timeline_names_a_missing_script():
    out = _call(["benchmarks/host_timeline.py", "--", "benchmarks/no_such_script.py"])
    assert out.returncode == 2 and "no such file" in out.stderr


def test_moe_benchmark_dispatch_and_step_run_on_two_cpu_devices(capsys):
    """The dispatch alone and the step benchmark on 1 and 2 devices with one dispatch (every
    dispatch runs the same benchmark code; each dispatch is checked against one device in
    tests/test_ep_dispatch.py) and its capacity-factor suffix."""
    dispatches = ("ring@1.125",)
    rows = _main(capsys, "moe", ["--tiny", "--skip", "grouped_matmul", "--gmm", "ragged_dot",
                                 "--dispatches", ",".join(dispatches), "--iters", "1",
                                 "--repeats", "1"])
    for bench in ("dispatch", "moe_step"):
        lines = [r for r in rows if r.get("bench") == bench]
        for dispatch in dispatches:
            assert {r["devices"] for r in lines if r["dispatch"] == dispatch} == {1, 2}, bench
    for line in (r for r in rows if r.get("bench") == "dispatch"):
        assert line["fwd_ms"] > 0 and line["fwd_bwd_ms"] > 0
        assert line["dropped_fraction"] > 0 or line["rel_rms_vs_ragged"] <= BF16_OUT_TOL, line
    assert all(r["tokens_per_s"] > 0 for r in rows if r.get("bench") == "moe_step")
    (summary,) = [r for r in rows if r.get("bench") == "summary"]
    assert summary["speedup"] > 0 and set(summary) == {
        "bench", "best_1gpu_tokens_per_s", "best_2gpu_tokens_per_s", "speedup"}


def test_scale_out_runs_each_layout_on_its_own_devices(tmp_path, capsys, point_env):
    """Weak scaling on simulated CPU devices: one device, and two holding one expert half each
    (the expert layout takes the ring dispatch); each point's batch is per device, its
    collectives and the MoE dispatch's kernels are found, and efficiencies are against the
    best point on one and on two devices."""
    rows = _main(capsys, "scale_out", [
        "--platform", "cpu", "--cpus", "3", "--config", "k3_tiny", *MOE_LAYER,
        "--per-device-batch", "2", "--seq", "32", "--layouts", "data=1", "expert=2",
        "--warmup", "0", "--steps", "1", "--out", str(tmp_path)])
    points = {r["layout"]: r for r in rows if r.get("bench") == "scale_out"}
    assert set(points) == {"data=1", "expert=2"}
    one, two = points["data=1"], points["expert=2"]
    assert (one["devices"], one["batch"], two["devices"], two["batch"]) == (1, 2, 2, 4)
    assert one["collective_ms"] == 0 < two["collective_ms"]
    assert one["dispatch_ms"] > 0 and two["dispatch_ms"] > 0
    assert one["efficiency"]["1"] == two["efficiency"]["2"] == 1.0
    assert two["efficiency"]["1"] == pytest.approx(
        two["tokens_per_s_per_device"] / one["tokens_per_s_per_device"], rel=1e-2)
    ring = (tmp_path / "expert=2" / "stdout.jsonl").read_text()
    assert '"model.moe.dispatch=ring"' in ring


def test_scale_out_stops_a_point_past_its_time_limit(capsys, point_env):
    _benchmark("scale_out").main(["--platform", "cpu", "--config", "k3_tiny",
                                  "--per-device-batch", "2", "--layouts", "data=1",
                                  "--point-timeout", "1"])
    (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert line["layout"] == "data=1" and "exited with -9 after" in line["error"], line


def test_scale_out_names_a_bad_layout(capsys):
    """Refused before any point starts, by the script's ``main`` with argparse's exit status
    2."""
    scale_out = _benchmark("scale_out")
    for layout, expected in [("pipeline=2", "is not a mesh"), ("data=9", "more devices")]:
        with pytest.raises(SystemExit) as refused:
            scale_out.main(["--platform", "cpu", "--config", "k3_tiny", "--per-device-batch", "2",
                            "--layouts", layout])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and expected in err, err[-500:]


def test_compile_time_reports_each_stage_and_the_compilers_events(tmp_path, capsys,
                                                                   restore_cache_config):
    rows = _main(capsys, "compile_time", ["--config", "k3_tiny", *DENSE_LAYER, "--batch", "1",
                                          "--seq", "32", "--parts", "forward", "--phases",
                                          str(tmp_path), "--top", "20"])
    (row,) = [r for r in rows if "compile_s" in r]
    assert row["part"] == "forward" and row["compile_s"] > 0 and row["temp_GiB"] is not None
    events = {r["event"]: r for r in rows if "event" in r}
    assert len(events) == 20 and all(e["part"] == "forward" and e["n"] >= 1
                                     for e in events.values())
    # jax's own event around XLA's compile: the stage the row timed.
    whole = events["backend_compile_and_load"]
    assert whole["n"] == 1 and abs(whole["s"] - row["compile_s"]) < 0.1 * row["compile_s"] + 0.5


@pytest.mark.parametrize("how", [[], ["--one-program"]], ids=["as_the_loop", "one_program"])
def test_compile_time_of_the_train_step(how, capsys, restore_cache_config):
    """``--parts step``: the loop's two programs compiled at once, or the step as one program.
    The loop's mesh takes every device, which in this process are eight: that one runs in a
    process of one device."""
    args = ["--config", "k3_tiny", *DENSE_LAYER, "--batch", "2", "--seq", "32", "--parts", "step",
            "--optimizers", "adamw", *how]
    rows = _main(capsys, "compile_time", args) if how else _run(["benchmarks/compile_time.py",
                                                                 *args])
    (row,) = [r for r in rows if "compile_s" in r]
    assert row["part"] == "step" and "error" not in row
    assert min(row["trace_s"], row["lower_s"], row["compile_s"]) > 0
    assert row["total_s"] >= row["compile_s"] and row["temp_GiB"] is not None


def test_compile_time_finds_each_distinct_kernel_of_the_gradient(capsys, restore_cache_config):
    """``--parts kernels`` on the Pallas KDA path: its nine kernels (forward and backward) found
    in the gradient, each once, and the short convolutions' (q and k normalising, v not; the
    input gradient shared), each lowered for sm_90 (compiled only where there is a GPU)."""
    rows = _main(capsys, "compile_time", [
        "--config", "k3_tiny", "--set", "model.num_layers=1",
        "--set", "model.mla_layers=()",  # k3_tiny's KDA layer alone
        "--set", "model.kda.impl=pallas", "--set", "model.kda.chunk_size=64",
        "--batch", "1", "--seq", "64", "--parts", "kernels"])
    found = [r for r in rows if "kernel" in r]  # a kernel once per distinct signature
    calls = collections.Counter()
    for r in found:
        calls[r["kernel"]] += r["calls"]
    kda = {f"kda_{part}" for part in (
        "cumsum_gates", "scores_fwd", "wy_fwd", "state_fwd", "state_bwd", "state_grads",
        "wy_bwd", "scores_bwd", "cumsum_bwd")}
    # The convolutions' input gradients: the first part's into a new buffer, the others' into it.
    conv = {"conv_silu_l2_triton": 2, "conv_silu_triton": 1, "conv_silu_dy_l2_triton": 2,
            "conv_silu_dy_triton": 1, "conv_silu_dx_triton": 3}
    assert set(calls) == kda | set(conv), sorted(calls)
    assert {name: calls[name] for name in conv} == conv
    assert all(calls[name] == 1 for name in kda)
    assert all(r["module_chars"] > 0 and r["lower_s"] > 0 for r in found)
    (total,) = [r for r in rows if "kernels" in r]
    assert total["kernels"] == len(found) and total["compile_s"] is None  # nothing compiled
    assert total["lower_s"] == pytest.approx(sum(r["lower_s"] for r in found), abs=0.01)


def test_kda_benchmark_times_and_profiles_the_chunked_op(tmp_path, capsys):
    """The KDA benchmark's JAX path on the CPU (our chunked op at a toy shape), with the profiler
    traces of the forward alone and with the backward where ``profile_top.py DIR/NAME/PART``
    looks for them (a CPU trace has no GPU kernels to sum)."""
    rows = _main(capsys, "kda", ["--impls", "ours_chunked_jax", "--shapes", "1,128,2,64",
                                 "--iters", "1", "--repeats", "1", "--profile", str(tmp_path)])
    (timed,) = [r for r in rows if "fwd_ms" in r]
    assert timed["impl"] == "ours_chunked_jax" and timed["fwd_bwd_ms"] > 0
    (profiled,) = [r for r in rows if "profile" in r]
    assert profiled["calls"] == 5  # what profile_top.py --calls needs for per-call times
    for part in ("forward", "forward_backward"):
        assert list((tmp_path / "ours_chunked_jax" / part).glob("**/*.xplane.pb")), part


def test_kda_scores_variants_lower_for_sm90(capsys):
    """Variants of the scores-kernel benchmark lower for an sm_90 target, and an ablation (a helper
    of the kernel module swapped while tracing) changes the kernel it lowers. (The kernels
    lower in tests/test_pallas_kda_scores.py; two variants here keep CI short.)"""
    variants = {"kernels", "no_exp"}
    rows = _main(capsys, "kda_scores", ["--lower-only", "--shape", "1,128,2,64",
                                        "--variants", ",".join(sorted(variants))])
    sizes = {(r["variant"], r["kernel"]): r["module_chars"] for r in rows}
    assert len(sizes) == 2 * len(variants)
    for kernel in ("fwd", "bwd"):
        assert len({size for (_, k), size in sizes.items() if k == kernel}) == len(variants)


def test_kda_inverse_variants_lower_for_sm90(capsys):
    """The inverse-kernel benchmark's kernels lower for an sm_90 target, and taking out the
    elimination changes the two kernels that invert (the backward does not invert)."""
    rows = _main(capsys, "kda_inverse", ["--lower-only", "--shape", "1,128,2,64",
                                         "--variants", "kernels,no_pivots"])
    sizes = {(r["variant"], r["kernel"]): r["module_chars"] for r in rows}
    assert {k for _, k in sizes} == {"scaled_inverse", "wy_fwd", "wy_bwd"} and len(sizes) == 6
    for kernel in ("scaled_inverse", "wy_fwd"):
        assert sizes["no_pivots", kernel] < sizes["kernels", kernel]


def test_expert_tiles_lower_each_tiling_and_mark_the_shipped_one(capsys):
    """Each tiling of the tile matmul lowers for sm_90 (here in this process), the tile width and
    K step swapped in change the kernel it lowers, and exactly the tiling the library picks is
    marked shipped."""
    bench = _benchmark("expert_tiles")
    assert bench.main(["--lower-only", "--rows", "512", "--groups", "2", "--dims", "128x384"]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    for kernel in ("tile_matmul", "tile_matmul_transposed"):
        sizes = {tuple(r["tiling"]): r["module_chars"] for r in rows if r["kernel"] == kernel}
        assert set(sizes) == set(bench.TILE_MATMUL)  # 384 columns take both widths
        # the swapped width and K step reach the kernel (with two K steps the slots may not)
        assert sizes[128, 2, 64] != sizes[192, 2, 64] != sizes[192, 2, 128]
        assert [r["tiling"] for r in rows if r["kernel"] == kernel and r["shipped"]] == [
            [192, 2, 64]]
    with pytest.raises(SystemExit) as refused:
        bench.main(["--lower-only", "--dims", "384x100"])
    assert refused.value.code == 2 and "--dims" in capsys.readouterr().err


def test_kernel_benchmarks_name_a_bad_shape(capsys):
    """A shape the kernels cannot take is refused by name before anything is traced (by the
    script's ``main``, in this process, with argparse's exit status)."""
    with pytest.raises(SystemExit) as refused:
        _benchmark("kda_inverse").main(["--lower-only", "--shape", "1,100,2,64"])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--shape" in err and "1,100,2,64" in err


def test_profiled_kernels_are_looked_up_in_their_own_module(tmp_path):
    """Two programs whose fusions have the same instruction names (a step compiled as its
    gradient and update programs): each kernel's source comes from its own module's text."""
    import jax
    import jax.numpy as jnp

    trace = _benchmark("_trace")

    def scoped(name):  # module jit_<name>, its fusion under the scope <name>
        def f(x):
            with jax.named_scope(name):
                return jnp.sin(x) * 2.0 + 1.0
        f.__name__ = name
        return jax.jit(f)

    first, second = scoped("first_program"), scoped("second_program")
    x = jnp.ones((4096,))
    compiled = [f.lower(x).compile() for f in (first, second)]
    hlo = "\n".join(c.as_text() for c in compiled)
    with jax.profiler.trace(str(tmp_path)):
        jax.block_until_ready(compiled[1](compiled[0](x)))
    (kernels,) = [k for path in trace.trace_files([str(tmp_path)])
                  for k in trace.device_kernels(path).values()]
    modules = trace.hlo_instructions(hlo)
    assert len(modules) == 2
    shared = set.intersection(*(set(m) for m in modules.values()))
    assert any("fusion" in name for name in shared)  # the collision this guards against
    scopes = {scope.split("/")[0] for (_, _, scope) in trace.summarize(kernels, modules)["sources"]}
    assert {"first_program", "second_program"} <= scopes, scopes
    # A fusion moves its operand and its result once each: 2 x 4096 fp32 values.
    for instrs in modules.values():
        (fusion,) = [i for i in instrs.values() if i.opcode == "fusion"]
        assert fusion.bytes == 2 * 4096 * 4, fusion


def _fusion_module(name: str, fusions: list[tuple[str, str, str]]) -> str:
    """HLO text of a module whose entry runs ``fusions`` (instruction, computation, op_name),
    each a bf16[8] add, or for a computation named ``mul...`` a multiply, or for ``sum...`` and
    ``max...`` a reduction by a reducer computation (``add`` or ``maximum``) of its own."""
    comps = {comp for _, comp, _ in fusions}
    text = [f"HloModule {name}, is_scheduled=true", ""]
    for comp in sorted(comps):
        root = "multiply(%p0, %p1)" if comp.startswith("mul") else "add(%p0, %p1)"
        if comp[:3] in ("sum", "max"):
            op = "add" if comp.startswith("sum") else "maximum"
            text += [f"%{comp}_reducer (a: bf16[], b: bf16[]) -> bf16[] {{",
                     "  %a = bf16[] parameter(0)", "  %b = bf16[] parameter(1)",
                     f"  ROOT %c = bf16[] {op}(%a, %b)", "}", ""]
            root = f"reduce(%p0, %p1), dimensions={{0}}, to_apply=%{comp}_reducer"
        text += [f"%{comp} (p0: bf16[8], p1: bf16[8]) -> bf16[8] {{",
                 "  %p0 = bf16[8]{0} parameter(0)", "  %p1 = bf16[8]{0} parameter(1)",
                 f"  ROOT %r = bf16[8]{{0}} {root}, metadata={{op_name=\"{comp}\"}}",
                 "}", ""]
    text += ["ENTRY %main (x: bf16[8]) -> bf16[8] {", "  %x = bf16[8]{0} parameter(0)"]
    text += [f"  %{instr} = bf16[8]{{0}} fusion(%x, %x), kind=kLoop, calls=%{comp}, "
             f"metadata={{op_name=\"jit({name})/{op_name}\"}}" for instr, comp, op_name in fusions]
    return "\n".join(text + ["}"])


def test_a_kernel_xla_compiled_for_fusions_of_equal_code_is_split_between_them():
    """Inside a command buffer a kernel names no instruction, and XLA compiles fusions of equal
    code once, naming the kernel after the first: its runs are shared by all of them (but not
    by one whose own kernel ran, nor by equal code in another program, nor by a reduction whose
    reducer differs)."""
    trace = _benchmark("_trace")
    hlo = "\n".join([
        _fusion_module("grads", [("wrapped_add", "add_a", "first/add"),
                                 ("wrapped_add.1", "add_b", "second/add"),
                                 ("wrapped_add.2", "add_c", "own_kernel/add"),
                                 ("wrapped_multiply", "mul_a", "third/mul"),
                                 ("reduce_fusion", "sum_a", "fifth/sum"),
                                 ("reduce_fusion.1", "max_a", "sixth/max")]),
        _fusion_module("update", [("wrapped_add", "add_a", "other_program/add")])])
    run = lambda name, ns, module="grads": trace.Kernel(name, 0.0, ns, "command_buffer_1", module)  # noqa: E731
    kernels = [run("wrapped_add", 100.0), run("wrapped_add", 100.0), run("wrapped_add_2", 60.0),
               run("wrapped_multiply", 50.0), run("wrapped_add", 30.0, "update"),
               run("reduce_fusion", 40.0)]  # the max reduction never ran
    summary = trace.summarize(kernels, trace.hlo_instructions(hlo))
    by_scope = {scope: ns for (_, _, scope), ns in summary["sources"].items()}
    assert by_scope == {"first/add": 100.0, "second/add": 100.0, "own_kernel/add": 60.0,
                        "third/mul": 50.0, "other_program/add": 30.0, "fifth/sum": 40.0}, by_scope
    assert summary["kernel_ns"] == 380.0
    calls = {key[3]: row[1] for key, row in summary["ops"].items()}
    assert calls["first/add"] == calls["second/add"] == 1.0  # two runs, shared by two fusions
    # Each fusion moves its two operands and its result once a run: 3 x 8 bf16 values.
    assert summary["source_bytes"][("fusion", "fwd", "first/add")] == 2 * 3 * 8 * 2 / 2


def test_profile_diff_sorts_the_changes_and_totals_each_program(tmp_path):
    def ops(path, rows):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    kernel = {"module": "jit_gradients", "category": "fusion", "pass": "bwd"}
    before = ops(tmp_path / "a.jsonl", [
        {**kernel, "source": "kda/mixer/split", "ms": 6.0},
        {**kernel, "source": "kda/mixer/split", "ms": 1.0},  # two kernels of one source add up
        {**kernel, "source": "moe/norm", "ms": 2.0},
        {**kernel, "module": "jit_update", "source": "optimizer/add", "ms": 3.0}])
    after = ops(tmp_path / "b.jsonl", [
        {**kernel, "source": "kda/mixer/split", "ms": 2.5},
        {**kernel, "source": "moe/norm", "ms": 2.5},
        {**kernel, "source": "attnres/mix", "ms": 1.0}])
    rows = _run(["benchmarks/profile_diff.py", before, after])
    sources = [r for r in rows if r["source"] != "(all)"]
    assert [(r["source"], r["delta_ms"]) for r in sources] == [
        ("kda/mixer/split", -4.5), ("optimizer/add", -3.0), ("attnres/mix", 1.0),
        ("moe/norm", 0.5)]
    totals = {r["program"]: (r["before_ms"], r["after_ms"]) for r in rows
              if r["source"] == "(all)"}
    assert totals == {"jit_gradients": (9.0, 6.0), "jit_update": (3.0, 0.0)}


def test_attention_benchmark_times_each_path_and_compares_the_packed_ones(capsys):
    rows = _main(capsys, "attention", ["--batch", "2", "--seq", "64", "--heads", "2",
                                       "--head-dim", "16", "--v-head-dim", "8", "--iters", "1",
                                       "--repeats", "1"])
    assert [r["variant"] for r in rows] == ["masked", "packed", "checked", "single",
                                            "one_document"]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows)
    for packed in rows[1:3]:  # on the CPU all three are the masked XLA form
        assert packed["max_abs_diff_vs_masked"] == 0.0


def test_attnres_benchmark_compares_the_residual_rules(capsys, restore_cache_config):
    """Plain residual and AttnRes on one remat policy: each variant's compile stages, memory and
    step time, then AttnRes's extra parameters over plain."""
    # Two MLA layers: one AttnRes block of four sublayers without KDA's compile.
    rows = _main(capsys, "attnres", ["--config", "k3_tiny", "--set", "model.num_layers=2",
                                     "--set", "model.mla_every=1", "--no-moe", "--seq", "32",
                                     "--remat", "none", "--repeats", "1"])
    variants = {r["residual"]: r for r in rows if r["bench"] == "attnres"}
    assert set(variants) == {"plain", "attnres"}
    for line in variants.values():
        assert line["step_ms"] > 0 and line["temp_MiB"] > 0 and line["argument_MiB"] > 0
        assert 0 < line["compile_s"] <= line["total_s"]
    plain, attnres = variants["plain"], variants["attnres"]
    assert plain["block_sublayers"] is None and attnres["block_sublayers"] == 4
    (cmp,) = [r for r in rows if r["bench"] == "attnres_vs_plain"]
    assert cmp["extra_params"] == attnres["params"] - plain["params"] > 0


def test_serve_benchmark_prefills_decodes_and_hits_the_prefix_cache(capsys):
    """Both models' prefill, decode and time-to-first-token lines, run end to end on the two
    models' layer patterns. The prefill, the shared prompt and the requests go in whole chunks
    into caches of one length: one prefill program a model."""
    rows = _main(capsys, "serve", ["--config", "k3_tiny", "--seqs", "48", "--chunk", "16",
                                   "--batches", "2", "--context", "64", "--steps", "2",
                                   "--shared", "32", "--suffix", "16", "--repeats", "1"])
    lines = {(r["bench"], r.get("model")): r for r in rows}
    assert {r["layers"] for r in rows if r["bench"] == "init"} == {"KKKM", "MMMM"}
    for model in ("hybrid", "pure_mla"):
        prefill, decode, ttft = (lines[bench, model] for bench in ("prefill", "decode", "ttft"))
        assert prefill["T"] == 48 and prefill["prefill_s"] > 0 and prefill["cache_bytes"] > 0
        assert decode["batch"] == 2 and 0 < decode["step_ms"] < 1e3 * decode["first_call_s"]
        assert decode["weight_bytes"] > 0 and decode["cache_bytes"] > 0
        assert ttft["cold_ms"] > 0 and ttft["prefix_hit_ms"] > 0 and ttft["snapshot_bytes"] > 0


def test_kernels_are_sorted_into_categories_by_name():
    """Inside XLA's command buffers a kernel has no instruction to look up: Mosaic GPU kernels and
    k3jax's Triton kernels (also when XLA numbers a second kernel of one name) go by their names."""
    trace = _benchmark("_trace")

    def of(name):
        return trace.category(trace.Kernel(name, 0.0, 1.0, None), None)

    assert of("conv_silu_dy_triton") == "triton:conv_silu_dy"
    assert of("conv_silu_dy_triton__1") == "triton:conv_silu_dy"
    assert of("kda_wy_fwd_mosaic_gpu_kernel") == "mosaic:kda_wy_fwd"
    assert of("nvjet_sm90_tss_128x160_64x5_2x1_v_bz_NNT") == "matmul"
    assert of("sort_201_1") == "other"
