"""Kimi Delta Attention: the public op (math §3.2-3.4) and its fail-closed dispatch.

Three implementations compute the same thing:

- ``"reference"``: token-by-token recurrence (:mod:`k3jax.ops.kda_reference`), the test oracle;
- ``"chunked"``: the chunked algorithm in pure JAX (:mod:`k3jax.ops.kda_chunked`), any backend;
- ``"pallas"``: Mosaic GPU kernels (:mod:`pallas_kernels.kda`, imported lazily).

``"auto"`` takes the kernel only on an sm_90 GPU and only for calls its own ``supports`` accepts
(the shapes and options its GPU tests cover); everything else runs the chunked path -- slower,
never wrong.
Arguments are validated here, in Python, before anything is traced or compiled.
"""

from __future__ import annotations

import math
import numbers
import typing

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from k3jax.config.model import KDAImpl
from k3jax.devices import hopper_gpus
from k3jax.ops.kda_chunked import kda_chunked
from k3jax.ops.kda_gate import bounded_gate
from k3jax.ops.kda_reference import kda_decode_step, kda_reference
from k3jax.ops.per_device import on_own_rows

IMPLS = typing.get_args(KDAImpl)
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
L2_EPS = 1e-6  # math §3.1 step 3: added to the sum of squares


def l2_normalize(x, eps=L2_EPS):
    """``x / sqrt(sum(x^2, -1) + eps)`` over the last axis (math §3.1 step 3).

    Computed in fp32 and cast back to x's dtype. Shapes: ``[..., D]`` -> ``[..., D]``.
    """
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


# ----------------------------------------------------------------------------------- validation
def _fail(fn, arg, got, expected):
    raise ValueError(f"{fn}: {arg}={got} is invalid: expected {expected}")


def _check_array(fn, name, x, rank, dims, float_dtype=True):
    """``x`` must be an array of ``rank`` with a float (or integer) dtype and shape ``dims``.

    ``dims`` is a tuple of (label, size or None); None means any size >= 1.
    """
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    layout = "[" + ", ".join(label for label, _ in dims) + "]"
    if shape is None or dtype is None:
        _fail(fn, name, type(x).__name__, f"an array of shape {layout}")
    if len(shape) != rank:
        _fail(fn, f"{name}.shape", tuple(shape), f"rank {rank}: {layout}")
    want = tuple(size if size is not None else "*" for _, size in dims)
    if any(size is not None and s != size for s, (_, size) in zip(shape, dims)) or 0 in shape:
        _fail(fn, f"{name}.shape", tuple(shape), f"{layout} = {want} (non-empty, matching q)")
    if float_dtype and not any(dtype == d for d in FLOAT_DTYPES):
        _fail(fn, f"{name}.dtype", str(dtype), "float32, bfloat16 or float16")
    if not float_dtype and not jnp.issubdtype(dtype, jnp.integer):
        _fail(fn, f"{name}.dtype", str(dtype), "an integer dtype")


def _check_inputs(fn, q, k, v, g, beta, initial_state, segment_ids, token_axis):
    """Shapes: with ``token_axis`` q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``,
    segment_ids ``[B, T]``; without it the same minus T. initial_state ``[B, H, K, V]``."""
    lead = ("B", "T", "H") if token_axis else ("B", "H")
    _check_array(fn, "q", q, len(lead) + 1, tuple((a, None) for a in lead + ("K",)))
    sizes = dict(zip(lead + ("K",), q.shape))
    _check_array(fn, "v", v, len(lead) + 1, tuple((a, sizes[a]) for a in lead) + (("V", None),))
    sizes["V"] = v.shape[-1]
    spec = lambda *axes: tuple((a, sizes[a]) for a in axes)
    _check_array(fn, "k", k, len(lead) + 1, spec(*lead, "K"))
    _check_array(fn, "g", g, len(lead) + 1, spec(*lead, "K"))
    _check_array(fn, "beta", beta, len(lead), spec(*lead))
    if k.dtype != q.dtype or v.dtype != q.dtype:
        _fail(fn, "k.dtype/v.dtype", f"{k.dtype}/{v.dtype}", f"q's dtype {q.dtype}")
    if initial_state is not None or not token_axis:    # a decode step needs its state
        _check_array(fn, "initial_state" if token_axis else "state", initial_state, 4,
                     spec("B", "H", "K", "V"))
    if segment_ids is not None:
        _check_array(fn, "segment_ids", segment_ids, 2, spec("B", "T"), float_dtype=False)


def _real_between(x, low, high) -> bool:
    """``x`` is a real number (not a bool) with ``low < x < high``."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and low < x < high


def _check_gate(fn, gate_lower_bound, gate_bias, q):
    """``gate_bias`` is ``[H, K]`` of ``q [..., H, K]``."""
    if gate_lower_bound is not None and not _real_between(gate_lower_bound, -math.inf, 0):
        _fail(fn, "gate_lower_bound", gate_lower_bound, "None or a finite negative real number")
    if gate_bias is None:
        return
    if gate_lower_bound is None:
        _fail(fn, "gate_bias", "given", "None without gate_lower_bound (it biases that gate)")
    _check_array(fn, "gate_bias", gate_bias, 2, (("H", q.shape[-2]), ("K", q.shape[-1])))


def _log_decay(g, gate_lower_bound, gate_bias):
    """The log-decay the recurrence takes: ``g`` itself, or under ``gate_lower_bound`` K3's gate
    of the logits ``g`` and their ``gate_bias`` (:func:`~k3jax.ops.kda_gate.bounded_gate`)."""
    if gate_lower_bound is None:
        return g
    z = g.astype(jnp.float32)
    return bounded_gate(z if gate_bias is None else z + gate_bias, gate_lower_bound)


def _check_options(fn, scale, use_qk_l2norm, chunk_size=None, impl=None):
    if scale is not None and not _real_between(scale, 0, math.inf):
        _fail(fn, "scale", scale, "None or a finite positive real number")
    if not isinstance(use_qk_l2norm, bool):     # it picks the program: a static Python bool
        _fail(fn, "use_qk_l2norm", use_qk_l2norm, "a bool")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                   or chunk_size < 16 or chunk_size & (chunk_size - 1)):
        _fail(fn, "chunk_size", chunk_size, "a power of two >= 16")
    if impl is not None and impl not in IMPLS:
        _fail(fn, "impl", repr(impl), "one of " + ", ".join(map(repr, IMPLS)))


# ------------------------------------------------------------------------------------- dispatch
def _pallas_module():
    """The Mosaic GPU kernels' module, or ImportError when it is absent or cannot load."""
    import pallas_kernels.kda as module  # lazy: GPU-only dependencies stay out of CPU imports

    return module


def _select(impl, q, k, v, g, beta, initial_state, segment_ids, chunk_size):
    """``"reference"``, ``"chunked"`` or ``"pallas"`` (fail-closed for ``"auto"``)."""
    if impl == "pallas":
        try:
            _pallas_module()
        except ImportError as e:
            raise ImportError(f"kda: impl='pallas' needs the module pallas_kernels.kda, which "
                              f"could not be imported ({e}); use impl='chunked' or impl='auto'"
                              ) from e
        return "pallas"
    if impl == "auto" and hopper_gpus():
        try:
            module = _pallas_module()
        except ImportError:
            return "chunked"
        if module.supports(q, k, v, g, beta, initial_state=initial_state, segment_ids=segment_ids,
                           chunk_size=chunk_size):
            return "pallas"
    return "reference" if impl == "reference" else "chunked"


# ---------------------------------------------------------------------------------- public ops
def kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
        segment_ids=None, chunk_size=64, impl="auto", use_qk_l2norm=False, gate_lower_bound=None,
        gate_bias=None):
    """Kimi Delta Attention over whole sequences (math §3.2), FLA layout.

    Args:
      q, k: ``[B, T, H, K]``, already L2-normalised per head unless ``use_qk_l2norm``.
      v: ``[B, T, H, V]``, same dtype as q and k (float32, bfloat16 or float16).
      g: ``[B, T, H, K]`` log-decay (``<= 0``), any of those float dtypes (fp32 recommended).
      beta: ``[B, T, H]`` write strength.
      scale: multiplies q inside the op; defaults to ``K ** -0.5``.
      initial_state: optional ``[B, H, K, V]``, cast to fp32.
      output_final_state: return the fp32 state after the last token.
      segment_ids: optional integer ``[B, T]``; the state resets to zero where the id changes.
      chunk_size: chunk length ``C`` of the chunked and kernel paths, a power of two >= 16.
      impl: ``"auto"``, ``"reference"``, ``"chunked"`` or ``"pallas"``.
      use_qk_l2norm: L2-normalise q and k per head first (math §3.1 step 3).
      gate_lower_bound: None, or the bound of K3's gate (< 0): then ``g`` holds the gate's logits
        ``z = exp(A_log) f`` less ``gate_bias`` and the log-decay is
        ``gate_lower_bound * sigmoid(z + gate_bias)`` (:func:`~k3jax.ops.kda_gate.bounded_gate`),
        formed inside the op; the kernel path forms it in the kernels that read ``g`` (fla's
        ``use_gate_in_kernel``), so neither the fp32 log-decay nor its gradient makes a trip
        through memory of its own, and the bias's gradient comes from their sums.
      gate_bias: optional ``[H, K]`` under ``gate_lower_bound`` (fp32; zero if None).

    Returns:
      ``(o [B, T, H, V] in q's dtype, final_state [B, H, K, V] fp32 or None)``.
    """
    _check_inputs("kda", q, k, v, g, beta, initial_state, segment_ids, token_axis=True)
    _check_options("kda", scale, use_qk_l2norm, chunk_size, impl)
    _check_gate("kda", gate_lower_bound, gate_bias, q)
    if not isinstance(output_final_state, bool):
        _fail("kda", "output_final_state", output_final_state, "a bool")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    path = _select(impl, q, k, v, g, beta, initial_state, segment_ids, chunk_size)
    # Called outside jit, the op would dispatch (and compile) each of its many small operations
    # one by one: it runs as one compiled program instead. Inside a trace it is inlined as it is,
    # so a model's program stays flat (a nested jit per layer slowed the H200 train step).
    traced = any(isinstance(x, jax.core.Tracer)
                 for x in (q, k, v, g, beta, initial_state, segment_ids, gate_bias))
    run = _kda_path if traced else _kda_compiled
    bound = None if gate_lower_bound is None else float(gate_lower_bound)
    o, final = run(q, k, v, g, beta, initial_state, segment_ids, gate_bias, path=path,
                   scale=scale, chunk_size=chunk_size, output_final_state=output_final_state,
                   use_qk_l2norm=use_qk_l2norm, gate_lower_bound=bound)
    return o, (final if output_final_state else None)


def _kda_path(q, k, v, g, beta, initial_state, segment_ids, gate_bias, *, path, scale,
              chunk_size, output_final_state, use_qk_l2norm, gate_lower_bound):
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if path == "pallas":
        return _pallas_on_own_rows(q, k, v, g, beta, initial_state, segment_ids, gate_bias,
                                   scale=scale, chunk_size=chunk_size,
                                   output_final_state=output_final_state,
                                   gate_lower_bound=gate_lower_bound)
    g = _log_decay(g, gate_lower_bound, gate_bias)
    if path == "reference":
        return kda_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                             segment_ids=segment_ids)
    return kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       segment_ids=segment_ids, chunk_size=chunk_size)


def _pallas_on_own_rows(q, k, v, g, beta, initial_state, segment_ids, gate_bias, **options):
    """:func:`pallas_kernels.kda.kda_pallas` with each device on its own rows of the batch
    (:func:`~k3jax.ops.per_device.on_own_rows`): every input and output is per row but the
    gate's bias, a parameter."""
    def on_rows(q, k, v, g, beta, initial_state, segment_ids, gate_bias):
        return _pallas_module().kda_pallas(q, k, v, g, beta, initial_state=initial_state,
                                           segment_ids=segment_ids, gate_bias=gate_bias,
                                           **options)

    return on_own_rows(on_rows, q.shape[0], lambda rows: (P(rows),) * 7 + (P(),),
                       lambda rows: (P(rows), P(rows)))(q, k, v, g, beta, initial_state,
                                                       segment_ids, gate_bias)


_kda_compiled = jax.jit(_kda_path, static_argnames=("path", "scale", "chunk_size",
                                                    "output_final_state", "use_qk_l2norm",
                                                    "gate_lower_bound"))


def kda_decode(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=False,
               gate_lower_bound=None, gate_bias=None):
    """One decode step (math §3.4): the recurrence step for one new token of every sequence.

    Args:
      q, k, g: ``[B, H, K]``; v: ``[B, H, V]``; beta: ``[B, H]``; state: ``[B, H, K, V]`` (cast to
        fp32). scale, use_qk_l2norm, gate_lower_bound and gate_bias as in :func:`kda`.

    Returns:
      ``(o [B, H, V] in q's dtype, new_state [B, H, K, V] fp32)``.
    """
    _check_inputs("kda_decode", q, k, v, g, beta, state, None, token_axis=False)
    _check_options("kda_decode", scale, use_qk_l2norm)
    _check_gate("kda_decode", gate_lower_bound, gate_bias, q)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return kda_decode_step(q, k, v, _log_decay(g, gate_lower_bound, gate_bias), beta,
                           state.astype(jnp.float32), scale=scale)


__all__ = ["IMPLS", "kda", "kda_decode", "l2_normalize"]
