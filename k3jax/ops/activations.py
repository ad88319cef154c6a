"""Gated activations of the feed-forward blocks (math §6), computed in fp32."""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp

from k3jax.config.moe import Activation

ACTIVATIONS = typing.get_args(Activation)


def situ_glu(gate: jax.Array, up: jax.Array, beta_gate: float = 4.0,
             beta_up: float = 25.0) -> jax.Array:
    """SiTU-GLU: ``[beta_g tanh(a / beta_g) sigmoid(a)] * [beta_u tanh(b / beta_u)]``.

    The soft caps bound both branches, which is what keeps K3's FFN outputs from spiking.
    Shapes: ``gate``, ``up`` ``[..., m]`` -> ``[..., m]`` in the input dtype.
    """
    a, b = gate.astype(jnp.float32), up.astype(jnp.float32)
    y = beta_gate * jnp.tanh(a / beta_gate) * jax.nn.sigmoid(a) * (beta_up * jnp.tanh(b / beta_up))
    return y.astype(gate.dtype)


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU: ``silu(a) * b`` in fp32, cast back. Shapes as :func:`situ_glu`."""
    y = jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)
    return y.astype(gate.dtype)


def _check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is invalid: expected one of "
                         f"{', '.join(map(repr, ACTIVATIONS))}")


def glu(gate: jax.Array, up: jax.Array, activation: str, beta_gate: float = 4.0,
        beta_up: float = 25.0) -> jax.Array:
    """The gated activation named by a config (``"swiglu"`` or ``"situ_glu"``): ``gate``, ``up``
    ``[..., m]`` -> ``[..., m]`` in ``gate``'s dtype, computed in fp32. ``beta_gate``, ``beta_up``:
    SiTU-GLU's soft caps (unused by SwiGLU)."""
    _check_activation(activation)
    if activation == "swiglu":
        return swiglu(gate, up)
    return situ_glu(gate, up, beta_gate, beta_up)


def glu_recomputed(gate: jax.Array, up: jax.Array, activation: str, beta_gate: float = 4.0,
                   beta_up: float = 25.0) -> jax.Array:
    """:func:`glu`, differentiated by computing it again in the backward from ``gate`` and ``up``.

    The inputs are the products' outputs, which are kept anyway. Autodiff of :func:`glu` would
    keep its fp32 intermediates instead (the tanh and sigmoid values: in a GPU step, two
    ``[..., m]`` fp32 arrays the forward writes and the backward reads, twice the bytes of the
    bf16 inputs); recomputing them inside the backward's fusion is a few elementwise ops.
    ``jax.checkpoint``, not a custom VJP through :func:`glu_vjp`: the checkpoint's barrier keeps
    XLA from merging the backward's recomputation with the forward's values (with a custom VJP it
    did, and the fp32 arrays came back)."""
    return jax.checkpoint(glu, static_argnums=(2, 3, 4))(gate, up, activation, beta_gate, beta_up)


def glu_vjp(gate: jax.Array, up: jax.Array, dh: jax.Array, activation: str,
            beta_gate: float = 4.0, beta_up: float = 25.0) -> tuple[jax.Array, jax.Array]:
    """The input gradients of :func:`glu` written out, ``(dgate, dup)`` in fp32, from fp32 ``gate``,
    ``up`` and output gradient ``dh`` (all ``[..., m]``).

    Written by hand (a test holds it to ``jax.vjp`` of :func:`glu`) because kernels that fuse it
    cannot lower the accumulation primitives autodiff emits; only elementwise ops appear here.
    With ``G(a) = beta_g tanh(a / beta_g) sigmoid(a)`` and ``U(b) = beta_u tanh(b / beta_u)``:
    ``dgate = dh U(b) G'(a)``, ``dup = dh G(a) U'(b)``; SwiGLU: ``dgate = dh b silu'(a)``,
    ``dup = dh silu(a)``.
    """
    _check_activation(activation)
    s = jax.nn.sigmoid(gate)
    if activation == "swiglu":
        return dh * up * s * (1.0 + gate * (1.0 - s)), dh * gate * s
    tg, tu = jnp.tanh(gate / beta_gate), jnp.tanh(up / beta_up)
    g_val, u_val = beta_gate * tg * s, beta_up * tu
    g_grad = (1.0 - tg * tg) * s + g_val * (1.0 - s)
    return dh * u_val * g_grad, dh * g_val * (1.0 - tu * tu)


class GLUSpec(typing.NamedTuple):
    """A gated activation, ``"swiglu"`` or ``"situ_glu"`` with its two soft caps, as one hashable
    value: what the kernels take as a static argument (they call it and its :meth:`vjp`)."""

    name: str = "situ_glu"
    beta_gate: float = 4.0
    beta_up: float = 25.0

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        return glu(gate, up, self.name, self.beta_gate, self.beta_up)

    def vjp(self, gate: jax.Array, up: jax.Array, dh: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(dgate, dup)`` in fp32 at fp32 ``gate``, ``up`` for the output gradient ``dh``
        (:func:`~k3jax.ops.activations.glu_vjp`: elementwise, so kernels can fuse it)."""
        return glu_vjp(gate, up, dh, self.name, self.beta_gate, self.beta_up)

    @classmethod
    def from_config(cls, moe_cfg) -> "GLUSpec":
        return cls(moe_cfg.activation, moe_cfg.situ_beta_gate, moe_cfg.situ_beta_up)
