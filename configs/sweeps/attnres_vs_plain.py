"""IsoFLOP comparison on one H200: Block AttnRes against the plain residual, both in the 3:1 hybrid.

The ladder, budgets, data and recipe of ``hybrid_vs_mla.py``; blocks of one decoder layer (two
sub-layers), four blocks in the four-layer model. ``plain`` is the baseline: a multiplier above 1
for ``attnres`` means Block AttnRes reaches the plain residual's loss with less compute.
"""

import dataclasses

from configs.sweeps.hybrid_vs_mla import get_sweep as hybrid_vs_mla
from k3jax.sweep import Sweep, Variant


def get_sweep() -> Sweep:
    return dataclasses.replace(
        hybrid_vs_mla(), name="attnres_vs_plain", baseline="plain",
        variants=(Variant("plain"), Variant("attnres", ("model.residual.kind=attnres",
                                                        "model.residual.block_size_layers=1"))))
