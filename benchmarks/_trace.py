"""Reading ``jax.profiler`` traces: the device's kernels, each tied to the HLO instruction that
launched it, and that instruction's category and source (the model code it was traced from).

A kernel event in an ``.xplane.pb`` file carries the names of its HLO module and instruction (the
``hlo_module`` and ``hlo_op`` stats); the compiled modules' text (``compiled.as_text()``) gives that
instruction's opcode, fusion kind, custom-call target and ``op_name`` metadata, i.e. the JAX name
stack of the code it came from. Instruction names are unique within a module only: a step compiled
as two programs has fusions of the same name in both, so instructions are looked up in the
kernel's own module. On the CPU the "kernels" are the XLA runtime's thunks, which carry the same
stats, so the whole path runs (and is tested) without a GPU.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import math
import os
import re
from dataclasses import dataclass

from jax.profiler import ProfileData


@dataclass(frozen=True)
class Kernel:
    """One kernel execution on the device (or one thunk on the CPU)."""

    name: str
    start_ns: float
    duration_ns: float
    hlo_op: str | None
    module: str | None = None  # the HLO module's name (``jit_update``)


@dataclass(frozen=True)
class Instr:
    """What the compiled HLO says of one instruction."""

    opcode: str
    kind: str | None  # fusion kind (kLoop, kInput, kOutput, kCustom)
    target: str | None  # custom-call target
    op_name: str  # JAX name stack, '' when XLA made the instruction itself
    # Bytes of its operands and results: what one run of the instruction moves, reading each
    # operand once (an upper bound for one that reads a slice of an operand).
    bytes: int = 0
    # A fusion's module and computation, names and metadata left out: XLA compiles fusions of
    # equal code in one module into one kernel, named after the first of them.
    code: str | None = None


def trace_files(paths: list[str]) -> list[str]:
    """Files as given, directories searched for ``*.xplane.pb``."""
    found = []
    for p in paths:
        found += (sorted(glob.glob(os.path.join(p, "**", "*.xplane.pb"), recursive=True))
                  if os.path.isdir(p) else [p])
    return found


def device_kernels(path: str) -> dict[str, list[Kernel]]:
    """``{plane: kernels}`` of one trace: every GPU's stream lines, or, in a CPU trace, the XLA
    runtime's thunks (the events that name an HLO instruction)."""
    data = ProfileData.from_file(path)
    gpus = {p.name: p for p in data.planes if p.name.startswith("/device:GPU")}
    if gpus:
        return {name: [_kernel(e) for line in plane.lines if "stream" in line.name.lower()
                       for e in line.events]
                for name, plane in gpus.items()}
    cpu = [p for p in data.planes if p.name == "/host:CPU"]
    kernels = [k for p in cpu for line in p.lines for k in map(_kernel, line.events) if k.hlo_op]
    return {"/host:CPU": kernels} if kernels else {}


def host_events(path: str) -> list[tuple[str, str, float]]:
    """``(thread, event name, seconds)`` of every host event of one trace: on the host, XLA names
    its compiler passes and stages (``HLO Transforms``, ``config-assigner`` for the autotuner,
    ``CompileModuleToLlvmIr``, ...), which nest."""
    return [(line.name, e.name, e.duration_ns / 1e9)
            for p in ProfileData.from_file(path).planes if p.name.startswith("/host")
            for line in p.lines for e in line.events]


def _kernel(event) -> Kernel:
    stats = dict(event.stats)
    return Kernel(event.name, event.start_ns, event.duration_ns, stats.get("hlo_op"),
                  stats.get("hlo_module"))


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
# The opcode follows the result shape: "f32[8]{0} fusion(" or "(f32[2], s32[]) while(".
_OPCODE = re.compile(r"^(?:\(.*?\)|\S+)\s+([a-z][\w\-]*)\(")


_MODULE = re.compile(r"^HloModule\s+([^\s,]+)")


# A computation's first line, "%fused_computation.3 (param_0: f32[8]) -> f32[8] {", or
# "ENTRY %main.5 (...) -> ... {".
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([^\s(=]+)\s*\(.*\{\s*$")
_METADATA = re.compile(r",?\s*metadata=\{[^}]*\}")
_NAMES = re.compile(r"%[^\s,()=]+")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([^\s,(){}]+)")
_ARRAY = re.compile(r"\b(pred|bf16|[fsu]\d+|f8\w*)\[([\d,]*)\]")
_OPERAND = re.compile(r"%([^\s,()]+)")


def _array_bytes(shape_text: str) -> int:
    """Bytes of the arrays in an HLO shape (``f32[8,4]{1,0}`` or a tuple of them)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        bits = 8 if dtype == "pred" or dtype.startswith("f8") else int(re.sub(r"\D", "", dtype))
        total += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    return total


def hlo_instructions(hlo_text: str) -> dict[str, dict[str, Instr]]:
    """``{module name: {instruction name: Instr}}`` of every instruction in the text of one or
    more HLO modules (each begins with its ``HloModule NAME`` line)."""
    modules: dict[str, dict[str, tuple]] = {}
    bodies: dict[str, dict[str, list[str]]] = {}
    out = modules.setdefault("", {})  # instructions before any module line
    body = bodies.setdefault("", {})
    lines: list[str] = []
    for line in hlo_text.splitlines():
        module = _MODULE.match(line)
        if module:
            out = modules.setdefault(module.group(1), {})
            body = bodies.setdefault(module.group(1), {})
            continue
        computation = _COMPUTATION.match(line)
        if computation:
            lines = body.setdefault(computation.group(1), [])
            continue
        m = _INSTR.match(line)
        if not m or line.lstrip().startswith("//"):
            continue
        rest = m.group(2)
        lines.append(_METADATA.sub("", rest))
        op = _OPCODE.match(rest)
        if op is None:
            continue
        operands = _OPERAND.findall(rest[op.end():].split(")", 1)[0])
        out[m.group(1)] = (Instr(op.group(1), _field(r"kind=(k\w+)", rest),
                                 _field(r'custom_call_target="([^"]+)"', rest),
                                 _field(r'op_name="([^"]*)"', rest) or "",
                                 code=_field(r"calls=%?([^\s,]+)", rest)),
                           _array_bytes(rest[:op.start(1)]), operands)
    memos: dict[str, dict[str, str]] = collections.defaultdict(dict)  # a module's codes
    return {name: {i: dataclasses.replace(
                       instr, bytes=own + sum(parsed[o][1] for o in operands if o in parsed),
                       code=(None if instr.opcode != "fusion" or instr.code is None else
                             f"{name}\n{_code(instr.code, bodies[name], memos[name])}"))
                   for i, (instr, own, operands) in parsed.items()}
            for name, parsed in modules.items() if parsed}


def _code(computation: str, bodies: dict[str, list[str]], memo: dict[str, str]) -> str:
    """A computation's instructions without their names (and metadata), with the code of each
    computation they call (a fusion's, a reduction's reducer) in place of its name: reductions
    by ``add`` and by ``max`` are different code."""
    if computation not in memo:
        lines = []
        for rest in bodies.get(computation, [computation]):
            called = [_code(c, bodies, memo) for c in _CALLED.findall(rest)]
            lines.append(_NAMES.sub("%", _CALLED.sub("", rest)) + "".join(
                f"{{{c}}}" for c in called))
        memo[computation] = "\n".join(lines)
    return memo[computation]


def instructions_of(kernel: Kernel, modules: dict[str, dict[str, Instr]],
                    kernel_names: set[str], by_code: dict[str, list[tuple[str, Instr]]]
                    ) -> list[Instr]:
    """The instructions ``kernel`` may have run: :func:`instruction_of`'s, and where that is a
    fusion found by the kernel's name (inside a command buffer) and the first of its code whose
    kernel ran, also the fusions of equal code whose own kernels never ran (``kernel_names``:
    every kernel name of the trace): XLA compiled those into this kernel, so its runs are theirs
    too, one each a step. Empty when unknown. ``by_code``: :func:`fusions_by_code` of
    ``modules``."""
    instr = instruction_of(kernel, modules)
    if instr is None or instr.code is None or kernel.hlo_op in modules.get(kernel.module, {}):
        return [] if instr is None else [instr]
    equal = by_code[instr.code]
    ran = [other for name, other in equal if _kernel_name(name) in kernel_names]
    if ran and ran[0] is not instr:  # the kernel is named after the first fusion it runs
        return [instr]
    return [instr] + [other for name, other in equal
                      if other is not instr and _kernel_name(name) not in kernel_names]


def fusions_by_code(modules: dict[str, dict[str, Instr]]) -> dict[str, list[tuple[str, Instr]]]:
    """``{code: [(name, Instr)]}`` of the fusions of ``modules``, in their text's order."""
    out: dict[str, list[tuple[str, Instr]]] = collections.defaultdict(list)
    for table in modules.values():
        for name, instr in table.items():
            if instr.code is not None:
                out[instr.code].append((name, instr))
    return out


def _kernel_name(instruction: str) -> str:
    """The kernel XLA compiles for a fusion (``loop_add_fusion.3`` -> ``loop_add_fusion_3``)."""
    return instruction.replace(".", "_")


def _field(pattern: str, text: str) -> str | None:
    m = re.search(pattern, text)
    return m.group(1) if m else None


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all")
_WRAPPER = re.compile(r"^(jit|pjit|jvp|transpose|vmap|remat|checkpoint|rematted_computation|"
                      r"custom_jvp_call|custom_vjp_call|while|body|cond|scan|shard_map|closed_call|"
                      r"core_call|named|eval_jaxpr)\b")
_LAYER = re.compile(r"^(layer_\d+|block_\d+_scan|scanned_layers|K3Model.*|LayerGroup.*)$")


def instruction_of(kernel: Kernel, modules: dict[str, dict[str, Instr]]) -> Instr | None:
    """The HLO instruction that launched ``kernel``, looked up in the kernel's module, or, for a
    kernel that names none, in the one module that has it. Inside a command buffer (a CUDA graph
    XLA records for a run of thunks) the ``hlo_op`` stat names the buffer, not the instruction;
    the kernel of a fusion is then named after it, ``.`` written as ``_`` (``loop_add_fusion_3``
    for ``loop_add_fusion.3``)."""
    tables = ([modules[kernel.module]] if kernel.module in modules else list(modules.values()))
    for name in (kernel.hlo_op, kernel.name, re.sub(r"_(\d+)$", r".\1", kernel.name)):
        found = [t[name] for t in tables if name and name in t]
        if len(found) == 1:
            return found[0]
    return None


# Library matmul kernels by name (cuBLAS, cuBLASLt's nvjet, CUTLASS): in a command buffer they
# have no instruction to look up.
_GEMM_KERNEL = re.compile(r"gemm|nvjet|cutlass|xmma")


def category(kernel: Kernel, instr: Instr | None) -> str:
    """``matmul``, ``attention``, ``mosaic:<kernel>``, ``triton:<kernel>``, ``fusion``, ``copy``,
    ``memset``, ``collective``, ``custom:<target>`` or ``other:<opcode>``."""
    name = kernel.name.lower()
    if "memset" in name:
        return "memset"
    if "memcpy" in name:
        return "copy"
    if name.endswith("_mosaic_gpu_kernel"):
        return f"mosaic:{kernel.name[:-len('_mosaic_gpu_kernel')]}"
    triton = re.sub(r"__\d+$", "", kernel.name)  # XLA numbers kernels of one name: NAME__1
    if triton.endswith("_triton"):  # k3jax names its Pallas Triton kernels so
        return f"triton:{triton[:-len('_triton')]}"
    if "sdpa" in name or "flash" in name or "cudnn::fusion" in name:
        return "attention"  # cuDNN's fused attention (no instruction to look up in a buffer)
    if instr is None:
        return "matmul" if _GEMM_KERNEL.search(name) else "other"
    op, target = instr.opcode, (instr.target or "").lower()
    if op.startswith(COLLECTIVES) or "nccl" in name:
        return "collective"
    if op == "custom-call":
        if "mosaic" in target:
            return f"mosaic:{_short(kernel.name)}"
        if "fmha" in target or "attention" in target:
            return "attention"
        if "gemm" in target or "cublas" in target or "cudnn" in target:
            return "matmul"
        return f"custom:{target}"
    if op in ("dot", "convolution") or (op == "fusion" and ("gemm" in name or "dot" in name
                                                           or instr.kind == "kCustom")):
        return "matmul"
    if op == "fusion":
        return "fusion"
    if op in ("copy", "copy-start", "copy-done", "transpose", "dynamic-update-slice"):
        return "copy"
    return f"other:{op}"


def _short(kernel_name: str) -> str:
    return re.sub(r"[_.]?\d+$", "", kernel_name)[:60]


def source(op_name: str) -> tuple[str, str]:
    """``(pass, scope)`` of a JAX name stack: ``bwd`` when it runs inside a transpose (the
    backward pass), and the outermost model scope (the layer kind: ``kda``, ``mla``, ``moe``,
    ``dense``, or e.g. ``final_residual``) with the innermost scope and the primitive, transforms
    and layer indices dropped (``mla/kv_norm/mul``), so every layer's copy adds up."""
    if not op_name:
        return "-", "(made by XLA)"
    parts = op_name.split("/")
    backward = any(p.startswith("transpose(") for p in parts)
    kept = [p for p in parts if not _WRAPPER.match(p) and not _LAYER.match(p)]
    scope = kept if len(kept) <= 3 else [kept[0], *kept[-2:]]
    return ("bwd" if backward else "fwd"), "/".join(scope) or parts[-1]


def busy_ns(kernels: list[Kernel]) -> float:
    """Time during which at least one kernel ran (overlapping kernels counted once)."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k.start_ns):
        stop = k.start_ns + k.duration_ns
        if stop > end:
            total += stop - max(k.start_ns, end)
            end = stop
    return total


def summarize(kernels: list[Kernel], instrs: dict[str, dict[str, Instr]]) -> dict:
    """Totals by category and by (category, pass, source), over all ``kernels`` (``instrs``: of
    :func:`hlo_instructions`):
    ``{"kernel_ns", "busy_ns", "span_ns", "categories": Counter, "sources": Counter,
    "source_bytes": Counter (the bytes their instructions move), "programs": Counter (by HLO
    module), "ops": {(kernel, hlo_op, module, source): [ns, calls, category, pass, source,
    bytes]}}``; a kernel that ran fusions of equal code (:func:`instructions_of`) is split
    evenly over their sources, calls included."""
    cats, srcs, moved, programs, ops = (collections.Counter(), collections.Counter(),
                                        collections.Counter(), collections.Counter(), {})
    names, by_code = {k.name for k in kernels}, fusions_by_code(instrs)
    for k in kernels:
        # A kernel XLA compiled for several fusions of equal code: its time is theirs in equal
        # parts (equal code, equal shapes: equal work).
        found = instructions_of(k, instrs, names, by_code) or [None]
        for instr in found:
            share = 1 / len(found)
            cat = category(k, instr)
            where, scope = (source(instr.op_name) if instr else
                            ("-", "(in a command buffer)") if (k.hlo_op or "").startswith(
                                "command_buffer") else source(""))
            nbytes = (instr.bytes if instr else 0) * share
            cats[cat] += k.duration_ns * share
            programs[k.module or "(unnamed)"] += k.duration_ns * share
            key = (cat.split(":")[0], where, scope)
            srcs[key] += k.duration_ns * share
            moved[key] += nbytes
            row = ops.setdefault((k.name, k.hlo_op, k.module, scope),
                                 [0.0, 0.0, cat, where, scope, 0])
            row[0] += k.duration_ns * share
            row[1] += share
            row[5] += nbytes
    span = (max(k.start_ns + k.duration_ns for k in kernels) - min(k.start_ns for k in kernels)
            if kernels else 0.0)
    return {"kernel_ns": sum(cats.values()), "busy_ns": busy_ns(kernels), "span_ns": span,
            "categories": cats, "sources": srcs, "source_bytes": moved, "programs": programs,
            "ops": ops}
