"""Timing-only ablations of a Pallas kernel module, shared by the per-kernel benchmarks.

A variant swaps attributes of the kernel module (helpers, launch options) while its kernels are
traced: each kernel is then timed alone, or, with ``--lower-only`` (no GPU needed), lowered for
sm_90 and the size of its module printed. Ablations that take a part out give **wrong results**:
they show what that part costs, nothing else. One JSON line per variant and kernel:
``{"variant", "kernel", "shape", "ms" | "module_chars" | "error"}``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from types import ModuleType

from _timing import error_text, output, timed

from pallas_kernels._mgpu import CHUNK, HEAD_DIMS

# kernel name -> (a freshly jitted function, its arguments): fresh, so no trace is reused
Kernels = dict[str, tuple[Callable, tuple]]


@contextlib.contextmanager
def swapped(module: ModuleType, attrs: dict):
    """``module`` with ``attrs`` replaced (while a variant is traced and compiled)."""
    saved = {name: getattr(module, name) for name in attrs}
    for name, value in attrs.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def run_variant(module: ModuleType, variant: str, attrs: dict, kernels: Kernels, shape,
                lower_only: bool) -> list[dict]:
    """One record per kernel of ``kernels``, traced with ``attrs`` swapped into ``module``."""
    out = []
    with swapped(module, attrs):
        for kernel, (fn, args) in kernels.items():
            rec = {"variant": variant, "kernel": kernel, "shape": list(shape)}
            try:
                if lower_only:
                    lowered = fn.trace(*args).lower(lowering_platforms=("cuda",))
                    rec["module_chars"] = len(lowered.as_text())  # a rough measure of code size
                else:
                    rec["ms"] = round(timed(fn, args, iters=10, repeats=5), 4)
            except Exception as e:  # a variant that does not lower or run: say why, go on
                rec["error"] = error_text(e, 300)
            out.append(rec)
    return out


def _shape(p: argparse.ArgumentParser, text: str) -> tuple[int, ...]:
    """``--shape`` as ``(B, T, H, D)``, or the parser's error naming what was expected."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1 or shape[1] % CHUNK or shape[3] not in HEAD_DIMS:
        p.error(f"--shape: expected B,T,H,D with T a multiple of {CHUNK} and D in {HEAD_DIMS}, "
                f"got {text!r}")
    return shape


def main(description: str, module: ModuleType, ablations: dict[str, dict],
         make_kernels: Callable[[tuple[int, ...]], Kernels], argv=None) -> int:
    """The command line of a per-kernel benchmark: ``--shape B,T,H,D``, ``--variants``,
    ``--lower-only``, ``--out``. Exit status 1 if a variant failed to lower."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--shape", default="8,4096,16,128",
                   help="B,T,H,D (T a multiple of 64, D 64 or 128)")
    p.add_argument("--variants", default=",".join(ablations))
    p.add_argument("--lower-only", action="store_true",
                   help="check lowering for sm_90 (no GPU needed)")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    a = p.parse_args(argv)
    shape = _shape(p, a.shape)
    unknown = set(a.variants.split(",")) - set(ablations)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; known: {sorted(ablations)}")
    failed = False
    with output(a.out) as emit:
        for name in a.variants.split(","):
            kernels = make_kernels(shape)
            for rec in run_variant(module, name, ablations[name], kernels, shape, a.lower_only):
                emit(rec)
                failed |= "error" in rec
    return 1 if failed and a.lower_only else 0
