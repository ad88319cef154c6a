"""Typed configuration of the MoE feed-forward and its load balancing (math §6-8)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from k3jax.config.base import check_literals, fail, positive, require

Activation = Literal["swiglu", "situ_glu"]   # the gated activations (math §6)
# "quantile": exact Quantile Balancing (sort); "quantile_hist": K3's histogram version.
Balancing = Literal["quantile", "quantile_hist", "aux_free", "aux_loss", "none"]
# Single device: "ragged" (grouped matmul), "dense" (test oracle); expert-parallel: the rest.
Dispatch = Literal["ragged", "dense", "all_to_all", "ring", "ragged_all_to_all"]
GroupedMatmul = Literal["ragged_dot", "mosaic"]   # XLA's ragged_dot, or the Hopper tile kernels


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts plus an optional shared MLP.

    ``latent_dim`` set: Stable LatentMoE (K3) with experts at latent width between ``W_down`` and
    ``W_up``; ``latent_norm`` is the RMSNorm before ``W_up``. ``latent_dim=None``: the plain K2 /
    Kimi Linear MoE with experts at full width. ``shared_intermediate=0`` means no shared MLP.
    ``aux_loss_alpha`` is used only by ``balancing="aux_loss"``, ``aux_free_gamma`` only by
    ``"aux_free"``, ``qb_bins`` only by ``"quantile_hist"``; ``capacity_factor`` only by the
    expert-parallel dispatches (``None`` = dropless).
    """

    num_experts: int = 8
    top_k: int = 2
    expert_intermediate: int = 128
    latent_dim: int | None = None
    latent_norm: bool = True
    shared_intermediate: int = 0
    routed_scaling_factor: float = 1.0
    activation: Activation = "situ_glu"
    situ_beta_gate: float = 4.0
    situ_beta_up: float = 25.0
    balancing: Balancing = "quantile_hist"
    qb_bins: int = 1000
    aux_free_gamma: float = 1e-3
    aux_loss_alpha: float = 1e-4
    aux_loss_per_sequence: bool = False
    dispatch: Dispatch = "ragged"
    grouped_matmul: GroupedMatmul = "ragged_dot"
    capacity_factor: float | None = None

    def __post_init__(self):
        check_literals(self)
        positive(self, "num_experts", "top_k", "expert_intermediate", "qb_bins")
        if self.top_k > self.num_experts:
            fail(self, "top_k", self.top_k,
                 f"cannot route to more experts than exist (num_experts={self.num_experts})")
        if self.balancing in ("quantile", "quantile_hist") and self.top_k == self.num_experts:
            fail(self, "top_k", self.top_k,
                 "Quantile Balancing needs top_k < num_experts (its cutoff is the (k+1)-th score)")
        if self.latent_dim is not None:
            positive(self, "latent_dim")
        require(self.shared_intermediate >= 0, self, "shared_intermediate", "expected >= 0")
        require(self.routed_scaling_factor > 0, self, "routed_scaling_factor", "expected > 0")
        require(self.situ_beta_gate > 0, self, "situ_beta_gate", "expected > 0")
        require(self.situ_beta_up > 0, self, "situ_beta_up", "expected > 0")
        require(self.qb_bins >= 2, self, "qb_bins", "expected at least 2 histogram bins")
        require(self.aux_free_gamma > 0, self, "aux_free_gamma", "expected > 0")
        require(self.aux_loss_alpha >= 0, self, "aux_loss_alpha", "expected >= 0")
        if self.capacity_factor is not None and not 0 < self.capacity_factor < math.inf:
            fail(self, "capacity_factor", self.capacity_factor,
                 "expected None (dropless) or a finite number > 0")

    @property
    def is_latent(self) -> bool:
        return self.latent_dim is not None
