"""How the decoder stack is compiled: which layers run unrolled and which as a scanned group.

Deep hybrids must not unroll every layer (compile time grows with depth), so the stack is split
into an unrolled prefix, ``n`` repeats of one period of the hybrid schedule compiled once as a
``scan``, and an unrolled suffix.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3jax.config import ModelConfig

LayerSpec = tuple[str, str]  # (mixer, ffn)


@dataclass(frozen=True)
class StackPlan:
    """``layers[:scan_start]`` unrolled, then ``repeats`` x ``group`` scanned, then the rest."""

    specs: tuple[LayerSpec, ...]
    scan_start: int
    group: tuple[LayerSpec, ...]
    repeats: int

    @property
    def scan_stop(self) -> int:
        return self.scan_start + len(self.group) * self.repeats

    @property
    def prefix(self) -> range:
        return range(0, self.scan_start)

    @property
    def suffix(self) -> range:
        return range(self.scan_stop, len(self.specs))


def _repeats(specs, start: int, period: int) -> int:
    group = specs[start:start + period]
    n = 0
    while specs[start + n * period: start + (n + 1) * period] == group and len(group) == period:
        n += 1
    return n


def plan_stack(cfg: ModelConfig) -> StackPlan:
    """The plan covering the most layers with one repeated group (at least two repeats)."""
    specs = tuple(zip(cfg.layer_types, cfg.mlp_types))
    best = StackPlan(specs, len(specs), (), 0)
    if not cfg.scan_layers:
        return best
    periods = [cfg.mla_every] + [p for p in range(1, 9) if p != cfg.mla_every]
    for period in periods:
        for start in range(0, min(len(specs), cfg.first_k_dense + period + 1)):
            n = _repeats(specs, start, period)
            if n >= 2 and n * period > len(best.group) * best.repeats:
                best = StackPlan(specs, start, specs[start:start + period], n)
    return best


def unroll_params(cfg: ModelConfig, tree: dict) -> dict:
    """Rewrite a scanned variable tree (``scanned_layers/layer_k`` stacked on axis 0) into the
    unrolled layout (``layer_i`` for every layer), e.g. to compare or convert checkpoints."""
    plan = plan_stack(cfg)
    out = {k: v for k, v in tree.items() if k != "scanned_layers"}
    if "scanned_layers" not in tree:
        return out
    period = len(plan.group)
    for r in range(plan.repeats):
        for k in range(period):
            sub = tree["scanned_layers"].get(f"layer_{k}")
            if sub is not None:
                out[f"layer_{plan.scan_start + r * period + k}"] = _index(sub, r)
    return out


def _index(tree, r: int):
    import jax
    return jax.tree.map(lambda a: a[r], tree)
