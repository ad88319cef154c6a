"""How the decoder stack is compiled: which layers run unrolled and which as scanned groups.

Deep hybrids must not unroll every layer (compile time grows with depth), so a range of layers is
split into an unrolled prefix, ``n`` repeats of one period of the hybrid schedule compiled once as a
``scan``, and an unrolled suffix (:func:`plan_stack`).

The stack is one such range with the plain residual. With Block AttnRes and an even block size
``S`` (in sub-layers), it is one range per block of ``S / 2`` decoder layers
(:func:`plan_segments`): the completed blocks grow from block to block, so they cannot be part of a
scan's carry; inside a block they are a loop-invariant input (see ``k3jax/layers/attnres.py``). With
an odd ``S`` a block boundary falls between a layer's mixer and its FFN, and every layer runs
unrolled.
"""

from __future__ import annotations

from dataclasses import dataclass

from k3jax.config import ModelConfig

LayerSpec = tuple[str, str]  # (mixer, ffn)


@dataclass(frozen=True)
class StackPlan:
    """Layers ``[start, stop)``: ``[start, scan_start)`` unrolled, then ``repeats`` x ``group``
    scanned (module ``name``), then ``[scan_stop, stop)`` unrolled. ``specs`` covers the whole
    stack (indices are global layer indices)."""

    specs: tuple[LayerSpec, ...]
    scan_start: int
    group: tuple[LayerSpec, ...]
    repeats: int
    start: int
    stop: int
    name: str = "scanned_layers"

    @property
    def scan_stop(self) -> int:
        return self.scan_start + len(self.group) * self.repeats

    @property
    def prefix(self) -> range:
        return range(self.start, self.scan_start)

    @property
    def suffix(self) -> range:
        return range(self.scan_stop, self.stop)


def _repeats(specs, start: int, stop: int, period: int) -> int:
    group = specs[start:start + period]
    n = 0
    while (start + (n + 1) * period <= stop
           and specs[start + n * period: start + (n + 1) * period] == group):
        n += 1
    return n


def plan_stack(cfg: ModelConfig, start: int = 0, stop: int | None = None,
               name: str = "scanned_layers") -> StackPlan:
    """The plan of layers ``[start, stop)`` covering the most layers with one repeated group (at
    least two repeats); all unrolled when ``cfg.scan_layers`` is off."""
    specs = tuple(zip(cfg.layer_types, cfg.mlp_types))
    stop = len(specs) if stop is None else stop
    best = StackPlan(specs, stop, (), 0, start, stop, name)
    if not cfg.scan_layers:
        return best
    periods = [cfg.mla_every] + [p for p in range(1, 9) if p != cfg.mla_every]
    for period in periods:
        # the group starts within one period after the dense layers (or the range's start)
        for s in range(start, min(stop, max(start, cfg.dense_layers) + period + 1)):
            n = _repeats(specs, s, stop, period)
            if n >= 2 and n * period > len(best.group) * best.repeats:
                best = StackPlan(specs, s, specs[s:s + period], n, start, stop, name)
    return best


def block_layers(cfg: ModelConfig) -> int | None:
    """Decoder layers per AttnRes block when the stack runs block by block (even ``S``), else
    None."""
    s = cfg.residual.block_sublayers
    if cfg.residual.kind == "attnres" and s is not None and s % 2 == 0:
        return s // 2
    return None


def plan_segments(cfg: ModelConfig) -> tuple[StackPlan, ...]:
    """The stack as consecutive plans: one for the whole stack, or one per AttnRes block (even
    ``S``; scanned groups named ``block_{b}_scan``), or all layers unrolled (AttnRes, odd ``S``)."""
    n = cfg.num_layers
    if cfg.residual.kind != "attnres":
        return (plan_stack(cfg),)
    per_block = block_layers(cfg)
    if per_block is None:  # a block boundary inside a layer: no scan can avoid crossing it
        return (plan_stack(cfg.replace(scan_layers=False)),)
    return tuple(plan_stack(cfg, lo, min(lo + per_block, n), f"block_{b}_scan")
                 for b, lo in enumerate(range(0, n, per_block)))


def unroll_params(cfg: ModelConfig, tree: dict) -> dict:
    """Rewrite a scanned variable tree (each scanned group's ``layer_k`` stacked on axis 0) into
    the unrolled layout (``layer_i`` for every layer), e.g. to compare or convert checkpoints."""
    plans = plan_segments(cfg)
    names = {p.name for p in plans if p.repeats}
    out = {k: v for k, v in tree.items() if k not in names}
    for plan in plans:
        if not plan.repeats or plan.name not in tree:
            continue
        period = len(plan.group)
        for r in range(plan.repeats):
            for k in range(period):
                sub = tree[plan.name].get(f"layer_{k}")
                if sub is not None:
                    out[f"layer_{plan.scan_start + r * period + k}"] = _index(sub, r)
    return out


def _index(tree, r: int):
    import jax
    return jax.tree.map(lambda a: a[r], tree)
