"""The row layout the experts' tile kernels (:mod:`pallas_kernels.tiled_gmm`,
:mod:`pallas_kernels.tiled_glu`) share with the dispatch that lays rows out for them.

Every group of rows starts on a multiple of ``TILE_ROWS``, so each tile of ``TILE_ROWS`` rows holds
one group's rows or only padding. A module of its own so that the ops can lay rows out without
importing Mosaic GPU.
"""

TILE_ROWS = 128

__all__ = ["TILE_ROWS"]
