"""Typed, frozen configuration of the K3 model (math §1-6).

Every dataclass validates itself on construction. ``ModelConfig`` derives the hybrid schedule
(which layer is KDA or MLA, dense or MoE) so a field can be followed from ``configs/`` to the code
that uses it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from k3jax.config.base import (
    ConfigError,
    check_literals,
    fail,
    positive,
    power_of_two,
    require,
)
from k3jax.config.moe import Activation, MoEConfig

# "reference": token by token (the oracle); "chunked": the chunked form in JAX; "pallas": the Mosaic
# GPU kernels; "auto": the kernels where they support the call, else "chunked".
KDAImpl = Literal["auto", "reference", "chunked", "pallas"]
Remat = Literal["none", "full", "dots"]   # dots: keep the matmul outputs, recompute the rest
# How MLA's training attention takes packed documents (k3jax/ops/attention.py): "auto" checks each
# batch on the device; "single", "packed" and "masked" take one kernel unchecked (the training
# loop's choice, made per batch on the host).
Documents = Literal["auto", "single", "packed", "masked"]


@dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention layer (math §3.1). ``head_dim`` is K = V."""

    num_heads: int = 4
    head_dim: int = 64
    conv_size: int = 4
    gate: Literal["softplus", "lower_bound"] = "lower_bound"
    lower_bound: float = -5.0
    gate_rank: int = 128
    output_gate: Literal["full", "low_rank"] = "full"
    output_gate_rank: int = 128
    allow_neg_eigval: bool = False
    chunk_size: int = 64
    impl: KDAImpl = "auto"

    def __post_init__(self):
        check_literals(self)
        positive(self, "num_heads", "head_dim", "conv_size", "gate_rank", "output_gate_rank")
        power_of_two(self, "chunk_size")
        require(self.chunk_size >= 16, self, "chunk_size", "expected a power of two >= 16")
        if self.gate == "lower_bound" and not self.lower_bound < 0:
            fail(self, "lower_bound", self.lower_bound, "expected a negative log-decay bound")


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (math §4). NoPE by default; ``rope=True`` rotates the 64 dims.

    ``latent_norm_eps`` is the epsilon of both latent RMSNorms (``q_a`` and ``kv_a``): the released
    models build them with the RMSNorm default 1e-6, not the model's ``rms_eps``.

    ``documents`` is how the training attention treats packed documents (``segment_ids``) on a
    Hopper GPU. ``"auto"`` checks every batch on the device: cuDNN's packed layout when each row's
    ids are runs of at most 16 documents, else cuDNN's kernel under the mask (a ``lax.cond``).
    ``"packed"`` promises such rows and skips the check (rows that break the promise give NaN
    outputs, not attention across documents); ``"single"`` promises one document a row and takes
    the plain causal kernel (at ``k3_small``'s shape half the time of the packed layout; NaN
    likewise where a row holds more); ``"masked"`` always takes the mask. The training loop sets
    one of the last three per batch from the batch itself, on the host: the ``lax.cond``'s
    predicate, read by the host, cost ``k3_small`` 3.1 ms a step on an H200. Elsewhere the
    mask is the only form and all are the same computation.
    """

    num_heads: int = 4
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    output_gate: bool = False
    rope: bool = False
    rope_theta: float = 10000.0
    latent_norm_eps: float = 1e-6
    documents: Documents = "auto"

    def __post_init__(self):
        check_literals(self)
        require(self.latent_norm_eps > 0, self, "latent_norm_eps", "expected > 0")
        positive(self, "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                 "v_head_dim")
        if self.q_lora_rank is not None:
            positive(self, "q_lora_rank")
        if self.rope and self.qk_rope_head_dim % 2:
            fail(self, "qk_rope_head_dim", self.qk_rope_head_dim, "RoPE needs an even width")
        require(not self.rope or 0 < self.rope_theta < math.inf, self, "rope_theta",
                "expected a finite number > 0")
        if self.v_head_dim > self.qk_head_dim:
            fail(self, "v_head_dim", self.v_head_dim,
                 f"at most qk_nope_head_dim + qk_rope_head_dim = {self.qk_head_dim} (XLA's "
                 "attention pads values to the query width)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class FFNConfig:
    """Dense gated MLP (SwiGLU or SiTU-GLU, math §6)."""

    intermediate_size: int = 512
    activation: Activation = "situ_glu"
    situ_beta_gate: float = 4.0
    situ_beta_up: float = 25.0

    def __post_init__(self):
        check_literals(self)
        positive(self, "intermediate_size")
        require(self.situ_beta_gate > 0, self, "situ_beta_gate", "expected > 0")
        require(self.situ_beta_up > 0, self, "situ_beta_up", "expected > 0")


@dataclass(frozen=True)
class ResidualConfig:
    """The residual rule: plain pre-norm sum, or Attention Residuals (math §5).

    The AttnRes block size may be given in sub-layers (the paper's unit; Full AttnRes is 1) or in
    decoder layers (K3's config unit, two sub-layers each); ``block_sublayers`` is the resolved
    value.
    """

    kind: Literal["plain", "attnres"] = "plain"
    block_size_sublayers: int | None = None
    block_size_layers: int | None = None

    def __post_init__(self):
        check_literals(self)
        n_sub, n_layers = self.block_size_sublayers, self.block_size_layers
        if n_sub is not None and n_layers is not None and n_sub != 2 * n_layers:
            fail(self, "block_size_sublayers", n_sub,
                 f"conflicts with block_size_layers={n_layers} "
                 "(one decoder layer is two sub-layers)")
        for name in ("block_size_sublayers", "block_size_layers"):
            if getattr(self, name) is not None:
                positive(self, name)
        if self.kind == "attnres" and n_sub is None and n_layers is None:
            fail(self, "block_size_sublayers", None,
                 "attnres needs a block size (block_size_sublayers=1 is Full AttnRes)")

    @property
    def block_sublayers(self) -> int | None:
        if self.block_size_sublayers is not None:
            return self.block_size_sublayers
        return None if self.block_size_layers is None else 2 * self.block_size_layers


@dataclass(frozen=True)
class ModelConfig:
    """The whole decoder-only K3 model.

    Layer ``i`` (0-based) is MLA when ``(i + 1) % mla_every == 0`` or it is the last layer, unless
    ``mla_layers`` lists the MLA layers explicitly. Its FFN is dense for ``i < first_k_dense``,
    otherwise MoE (when ``moe`` is set).
    """

    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 4
    mla_every: int = 4
    mla_layers: tuple[int, ...] | None = None
    first_k_dense: int = 1
    kda: KDAConfig = field(default_factory=KDAConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    dense_ffn: FFNConfig = field(default_factory=FFNConfig)
    moe: MoEConfig | None = None
    residual: ResidualConfig = field(default_factory=ResidualConfig)
    rms_eps: float = 1e-5
    init_std: float = 0.02
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    scan_layers: bool = True
    remat: Remat = "none"

    def __post_init__(self):
        check_literals(self)
        positive(self, "vocab_size", "d_model", "num_layers", "mla_every")
        require(self.rms_eps > 0, self, "rms_eps", "expected > 0")
        require(self.init_std > 0, self, "init_std", "expected > 0")
        if not (0 <= self.first_k_dense <= self.num_layers):
            fail(self, "first_k_dense", self.first_k_dense,
                 f"expected 0..num_layers={self.num_layers}")
        if self.mla_layers is not None:
            # A list would make the config unhashable, and configs are jit's static arguments.
            object.__setattr__(self, "mla_layers", tuple(self.mla_layers))
            bad = [i for i in self.mla_layers if not (0 <= i < self.num_layers)]
            if bad:
                fail(self, "mla_layers", self.mla_layers,
                     f"layer indices are 0-based and must lie in [0, {self.num_layers}); "
                     f"out of range: {bad}")
        if self.moe is not None:
            if self.moe.latent_dim is not None and self.moe.latent_dim > self.d_model:
                fail(self, "moe.latent_dim", self.moe.latent_dim,
                     f"the latent width must not exceed d_model={self.d_model}")

    # -- the hybrid schedule (math §2) -------------------------------------------------------
    @property
    def layer_types(self) -> tuple[str, ...]:
        if self.mla_layers is not None:
            mla = set(self.mla_layers)
        else:
            mla = {i for i in range(self.num_layers) if (i + 1) % self.mla_every == 0}
            mla.add(self.num_layers - 1)
        return tuple("mla" if i in mla else "kda" for i in range(self.num_layers))

    @property
    def dense_layers(self) -> int:
        """How many layers, from the first, have a dense FFN: all of them without ``moe`` (so an
        MoE set later, by ``replace`` or ``--set``, starts after ``first_k_dense`` as given)."""
        return self.num_layers if self.moe is None else self.first_k_dense

    @property
    def mlp_types(self) -> tuple[str, ...]:
        return tuple("dense" if i < self.dense_layers else "moe" for i in range(self.num_layers))

    @property
    def num_sublayers(self) -> int:
        return 2 * self.num_layers

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


__all__ = ["ConfigError", "Documents", "FFNConfig", "KDAConfig", "MLAConfig", "ModelConfig",
           "ResidualConfig"]
