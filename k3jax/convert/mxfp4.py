"""MXFP4 (OCP microscaling FP4) decoding of compressed-tensors' ``mxfp4-pack-quantized`` experts.

A quantised ``[out, in]`` weight is stored as two tensors:

* ``weight_packed`` ``[out, in / 2]`` uint8: two FP4 E2M1 codes per byte, the even column in the low
  nibble, the odd column in the high nibble. A code is ``s e e m`` (sign, two exponent bits, one
  mantissa bit); its eight magnitudes are ``0, 0.5, 1, 1.5, 2, 3, 4, 6``.
* ``weight_scale`` ``[out, in / 32]`` uint8: one E8M0 exponent per group of 32 consecutive values
  along the input dimension; the group's scale is ``2 ** (e - 127)``.

The value is ``E2M1(code) * scale``. Every E2M1 magnitude times a power of two is exact in bf16 and
fp32 (the scale's exponent permitting), so decoding adds no rounding.
"""

from __future__ import annotations

import numpy as np

from k3jax.convert.errors import ConversionError

GROUP = 32
E8M0_BIAS = 127
E8M0_NAN = 255
# Magnitudes of the E2M1 codes 0..7; codes 8..15 are their negatives.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """``[..., n / 2]`` uint8 -> ``[..., n]`` fp32 E2M1 values (low nibble first)."""
    if packed.dtype != np.uint8:
        raise ConversionError(f"weight_packed must be uint8; got {packed.dtype}")
    codes = np.stack([packed & 0x0F, packed >> 4], axis=-1)
    return E2M1_VALUES[codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1])]


def e8m0_scales(scale: np.ndarray) -> np.ndarray:
    """uint8 E8M0 exponents -> fp32 scales ``2 ** (e - 127)`` (``e = 255`` is NaN)."""
    if scale.dtype != np.uint8:
        raise ConversionError(f"weight_scale must be uint8 E8M0 exponents; got {scale.dtype}")
    out = np.ldexp(np.float32(1.0), scale.astype(np.int32) - E8M0_BIAS).astype(np.float32)
    return np.where(scale == E8M0_NAN, np.float32(np.nan), out)


def dequantize(packed: np.ndarray, scale: np.ndarray, dtype=np.float32, name: str = "weight"):
    """``weight_packed [out, in/2]``, ``weight_scale [out, in/32]`` -> ``[out, in]`` ``dtype``.

    ``name`` (the tensor's checkpoint name) makes a shape error say which tensor is wrong.
    """
    values = unpack_e2m1(packed)
    n = values.shape[-1]
    want = (*packed.shape[:-1], n // GROUP)
    if n % GROUP or tuple(scale.shape) != want:
        raise ConversionError(f"{name}: weight_scale has shape {tuple(scale.shape)}; a packed "
                              f"weight {tuple(packed.shape)} ({n} values per row) needs {want} "
                              f"(one scale per {GROUP} values)")
    grouped = values.reshape(*want, GROUP) * e8m0_scales(scale)[..., None]
    return grouped.reshape(values.shape).astype(dtype)


__all__ = ["E2M1_VALUES", "GROUP", "dequantize", "e8m0_scales", "unpack_e2m1"]
