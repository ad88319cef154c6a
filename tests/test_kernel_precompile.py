"""The module of a program's Mosaic GPU calls that is compiled ahead of the program
(``k3jax.parallel.kernel_precompile``): built from programs lowered for CUDA on any machine;
compiled and run on a Hopper GPU only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

from k3jax.devices import hopper_gpus
from k3jax.ops.activations import GLUSpec
from k3jax.ops.tolerance import BF16_OUT_TOL, rel_rms
from k3jax.parallel import kernel_precompile
from k3jax.parallel.kernel_precompile import (
    compile_kernels_async,
    kernel_calls,
    kernels_module_text,
)
from pallas_kernels import tiled_glu as kernels

ACT = GLUSpec("swiglu")
ROWS = 4 * kernels.BLOCK_M


def _three_calls(x, y, tiles, z):
    """Three Mosaic GPU calls at two widths, the second taking the first's result."""
    h = kernels.tiled_glu(x, y, tiles, act=ACT)
    return kernels.tiled_glu(h, x, tiles, act=ACT), kernels.tiled_glu(z, z, tiles, act=ACT)


def _abstract_args():
    wide = jax.ShapeDtypeStruct((ROWS, 256), jnp.bfloat16)
    narrow = jax.ShapeDtypeStruct((ROWS, 128), jnp.bfloat16)
    return wide, wide, jax.ShapeDtypeStruct((4,), jnp.int32), narrow


def _signature(op):
    config = ir.DictAttr(op.attributes["mhlo.backend_config"])
    return (bytes(ir.StringAttr(config["kernel_hash"]).value_bytes),
            [str(v.type) for v in op.operands], [str(r.type) for r in op.results])


def test_kernels_module_makes_every_call_of_the_program_on_its_own_parameters():
    program = jax.jit(_three_calls).trace(*_abstract_args()).lower(
        lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    calls = kernel_calls(program)
    assert len(calls) == 3
    with mlir.make_ir_context():  # parsed where XLA would compile it: a context of its own
        module = ir.Module.parse(kernels_module_text(program))
        copies = kernel_calls(module)
        # The hash is what jaxlib's kernel cache is keyed by: a copy must hit the program's entry.
        assert [_signature(c) for c in copies] == [_signature(c) for c in calls]
        main = module.body.operations[0]
        params = list(main.regions[0].blocks[0].arguments)
        assert [a for c in copies for a in c.operands] == params  # each its own parameters
        returned = list(main.regions[0].blocks[0].operations[-1].operands)
        assert returned == [r for c in copies for r in c.results]


def test_a_program_without_mosaic_calls_has_no_kernels_module():
    program = jax.jit(lambda x: jnp.tanh(x) @ x).lower(
        jax.ShapeDtypeStruct((8, 8), jnp.float32)).compiler_ir("stablehlo")
    assert kernel_calls(program) == [] and kernels_module_text(program) is None


@pytest.mark.parametrize("config, ahead", [
    ("uses_xla_collective_metadata = false", True),
    ("uses_xla_collective_metadata = true", False),
    ('uses_xla_collective_metadata = false, xla_replica_ids = "0,1"', False)])
def test_kernels_that_talk_to_other_devices_are_left_to_xla(config, ahead):
    """A kernel with collective metadata needs its devices' program around it: not copied."""
    text = f"""
    module @m {{
      func.func public @main(%x: tensor<8xf32>) -> tensor<8xf32> {{
        %y = stablehlo.custom_call @{kernel_precompile.MOSAIC_GPU_TARGET}(%x) {{
          mhlo.backend_config = {{kernel_hash = "h", module = "", {config}}}}}
          : (tensor<8xf32>) -> tensor<8xf32>
        return %y : tensor<8xf32>
      }}
    }}"""
    with mlir.make_ir_context():
        assert len(kernel_calls(ir.Module.parse(text))) == int(ahead)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU's case")
def test_nothing_is_compiled_ahead_without_a_gpu(monkeypatch):
    monkeypatch.setattr(kernel_precompile, "kernels_module_text",
                        lambda module: pytest.fail("a module was built for a CPU"))
    lowered = jax.jit(_three_calls).trace(*_abstract_args()).lower(lowering_platforms=("cuda",))
    assert compile_kernels_async(lowered) is None


@pytest.mark.skipif(not hopper_gpus(), reason="Mosaic GPU kernels run on Hopper GPUs")
def test_program_runs_after_its_kernels_were_compiled_ahead():
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in _abstract_args()]
    args[2] = jnp.arange(4, dtype=jnp.int32) % 2
    lowered = jax.jit(_three_calls).lower(*args)
    seconds = compile_kernels_async(lowered).result()
    assert seconds is not None and seconds > 0  # None: it failed (and warned)
    outs = lowered.compile()(*args)
    refs = jax.jit(lambda x, y, t, z: (
        kernels.tiled_glu_reference(kernels.tiled_glu_reference(x, y, t, ACT), x, t, ACT),
        kernels.tiled_glu_reference(z, z, t, ACT)))(*args)
    for ref, out in zip(refs, outs):
        assert rel_rms(np.asarray(ref, np.float32), np.asarray(out, np.float32)) <= BF16_OUT_TOL


def test_every_program_the_step_and_evaluation_compile_gets_its_kernels_compiled_ahead(
        monkeypatch):
    """Both programs of a train step, and a program compiled in the background, pass through
    the kernel compile as soon as each is lowered, before XLA's compile is handed it."""
    from helpers import least_squares_args, least_squares_step

    from k3jax.config.mesh import MeshConfig
    from k3jax.parallel import make_mesh
    from k3jax.parallel import step as parallel_step

    seen = []
    monkeypatch.setattr(parallel_step, "compile_kernels_async",
                        lambda lowered: seen.append(lowered.as_text()))
    rules = MeshConfig().rules
    mesh = make_mesh(MeshConfig())
    _, abstract = least_squares_args(mesh, rules)
    step = parallel_step.MeshStep(least_squares_step(), abstract[0], mesh, rules)
    step.compile_async(*abstract).result()
    assert len(seen) == 2 and "jit_gradients" in seen[0] and "jit_update" in seen[1]
    x = jax.ShapeDtypeStruct((8, 4), jnp.float32)
    parallel_step.compile_in_background(jax.jit(jnp.tanh), mesh, rules, x).result()
    assert len(seen) == 3 and "jit_tanh" in seen[2]
