"""Numerical tolerance policy of math §10, shared by every test that compares two paths.

The metric is the relative RMS error ``rms(ref - out) / rms(ref)``, computed in fp64 on the host so
the comparison itself adds no rounding.
"""

from __future__ import annotations

import numpy as np

# math §10: same math in a different order (chunked vs recurrent, kernel vs chunked), fp32 inputs.
FP32_TOL = 1e-4
# math §10: bf16 inputs against an fp32 (or fp64) reference -- outputs and states.
BF16_OUT_TOL = 5e-3
# math §10: bf16 inputs -- gradients w.r.t. q, k, v and the initial state.
BF16_GRAD_QKV_TOL = 8e-3
# math §10: bf16 inputs -- gradients w.r.t. the gate (log-decay) and beta.
BF16_GRAD_GATE_TOL = 2e-2


def rel_rms(ref, out) -> float:
    """Relative RMS error ``rms(ref - out) / rms(ref)`` of two arrays of one shape (any dtype).

    Returns 0.0 when both are exactly zero, ``inf`` when only ``ref`` is zero, and ``nan`` when
    either holds a non-finite value (so a ``<=`` tolerance check fails on NaN/Inf).
    """
    ref = np.asarray(ref, dtype=np.float64)
    out = np.asarray(out, dtype=np.float64)
    if ref.shape != out.shape:
        raise ValueError(f"rel_rms: shapes differ, ref {ref.shape} vs out {out.shape}")
    if not (np.all(np.isfinite(ref)) and np.all(np.isfinite(out))):
        return float("nan")
    err = np.sqrt(np.mean((ref - out) ** 2)) if ref.size else 0.0
    scale = np.sqrt(np.mean(ref**2)) if ref.size else 0.0
    if scale == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return float(err / scale)
