"""A program's Mosaic GPU kernels compiled ahead of XLA's compile of the program.

XLA compiles the Mosaic GPU kernels a program calls when it emits the program's thunks, at the end
of its compile, one after another: jaxlib compiles each kernel under one process-wide lock and
keeps it in an in-process cache under the call's ``kernel_hash`` attribute. For ``k3_small``'s
gradient program that is 14 kernels and 20-23 s of an H200 host's time, while XLA's own work on
the program takes about 30 s. :func:`compile_kernels_async` compiles a small module that calls
each of the program's kernels once (the calls copied, attributes and all, so each has the hash XLA
looks up) on a thread of its own, started when the program is lowered: the kernels compile while
XLA runs its HLO passes, and XLA finds them in the cache when it gets there.

Nothing changes in what runs: the kernels are the same objects either way. Where anything here
fails, XLA compiles the kernels itself, as without it.
"""

from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import Future

import jax
from jax._src import compiler
from jax._src.interpreters import mlir
from jax._src.lib import xla_client as xc
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import func

MOSAIC_GPU_TARGET = "mosaic_gpu_v2"
# A copied call runs on one device in the kernels' module: sharding annotations do not apply.
_DROPPED_ATTRIBUTES = ("mhlo.sharding",)


def kernel_calls(module: ir.Module) -> list[ir.Operation]:
    """The Mosaic GPU custom calls of ``module`` (a lowered program) that run on one device, in
    program order (a kernel that talks to other devices needs their program around it). Each call
    site is a kernel of its own (jax names every lowered kernel with a counter, which enters its
    hash); a function lowered once and called many times, as flax's lifted ``jit`` makes each kind
    of layer, holds one call."""
    calls = []

    def visit(op: ir.Operation):
        if (op.name == "stablehlo.custom_call" and _target(op) == MOSAIC_GPU_TARGET
                and not _collective(op)):
            calls.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return calls


def kernels_module_text(module: ir.Module) -> str | None:
    """A module whose public ``main`` makes each Mosaic GPU call of ``module`` once, on its own
    parameters (every call's operands, in order), and returns every result; as text, to be parsed
    in a context of its own (XLA's compile of ``module`` may be reading the one it came from).
    None when ``module`` calls no Mosaic GPU kernel."""
    calls = kernel_calls(module)
    if not calls:
        return None
    inputs = [v.type for op in calls for v in op.operands]
    outputs = [r.type for op in calls for r in op.results]
    with module.context, ir.Location.unknown():
        kernels = ir.Module.create()
        kernels.operation.attributes["sym_name"] = ir.StringAttr.get("mosaic_kernels")
        with ir.InsertionPoint(kernels.body):
            main = func.FuncOp("main", (inputs, outputs))
            main.attributes["sym_visibility"] = ir.StringAttr.get("public")
            block = main.add_entry_block()
        with ir.InsertionPoint(block):
            params = iter(block.arguments)
            results = []
            for op in calls:
                copy = ir.Operation.create(
                    "stablehlo.custom_call", results=[r.type for r in op.results],
                    operands=[next(params) for _ in op.operands], attributes=_attributes(op))
                results.extend(copy.results)
            func.ReturnOp(results)
        return str(kernels)


def compile_kernels(text: str, device: jax.Device) -> float:
    """Compile :func:`kernels_module_text`'s module for ``device``, which leaves its kernels in
    jaxlib's cache; returns the seconds it took. The executable itself is dropped: it only ever
    served to compile the kernels."""
    t0 = time.perf_counter()
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
        compiler.backend_compile_and_load(device.client, module, xc.DeviceList((device,)),
                                          options, [])
    return time.perf_counter() - t0


def compile_kernels_async(lowered: jax.stages.Lowered) -> Future | None:
    """Start compiling ``lowered``'s Mosaic GPU kernels on a thread of their own (this process's
    first GPU; jaxlib shares compiled kernels among its devices): a future of the seconds it took,
    or None when there is nothing to compile (no kernel, or no GPU). A failure is a warning; XLA
    then compiles the kernels with the program, as it would without this."""
    device = jax.local_devices()[0]
    if device.platform != "gpu":
        return None
    try:
        text = kernels_module_text(lowered.compiler_ir("stablehlo"))
    except Exception as e:  # noqa: BLE001 - an unexpected program form: XLA does the work
        warnings.warn(f"the program's Mosaic GPU kernels were not compiled ahead ({e!r})")
        return None
    if text is None:
        return None
    done: Future = Future()

    def work():
        try:
            done.set_result(compile_kernels(text, device))
        except Exception as e:  # noqa: BLE001 - XLA compiles them with the program instead
            warnings.warn(f"the program's Mosaic GPU kernels were not compiled ahead ({e!r})")
            done.set_result(None)

    threading.Thread(target=work, name="compile-kernels", daemon=True).start()
    return done


def _target(op: ir.Operation) -> str:
    return ir.StringAttr(op.attributes["call_target_name"]).value


def _collective(op: ir.Operation) -> bool:
    config = ir.DictAttr(op.attributes["mhlo.backend_config"])
    uses = "uses_xla_collective_metadata" in config and ir.BoolAttr(
        config["uses_xla_collective_metadata"]).value
    return uses or "xla_replica_ids" in config


def _attributes(op: ir.Operation) -> dict[str, ir.Attribute]:
    return {n: op.attributes[n] for n in op.attributes if n not in _DROPPED_ATTRIBUTES}
