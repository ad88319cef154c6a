"""The tiles of the experts' kernels: the row layout the tile kernels
(:mod:`pallas_kernels.tiled_gmm`, :mod:`pallas_kernels.tiled_glu`) share with the dispatch that
lays rows out for them, and the width of the grouped matmuls' output tiles.

Every group of rows starts on a multiple of ``TILE_ROWS``, so each tile of ``TILE_ROWS`` rows holds
one group's rows or only padding. A module of its own so that the ops can lay rows out and pick
tiles without importing Mosaic GPU.
"""

TILE_ROWS = 128
# Output tiles 192 columns wide where the width allows, else 128: a CTA's prologue and store then
# serve 1.5x the products. At k3_small's expert products (384 x 384) on an H100
# (docs/benchmarks.md) the tile matmul took 10-20% less time, and jax's transposed kernel for the
# weight gradient 30% less.
WIDE_COLUMNS, COLUMNS = 192, 128


def column_tile(n: int) -> int:
    """Width of the output tiles of a grouped matmul ``N`` columns wide (a multiple of 128)."""
    return WIDE_COLUMNS if n % WIDE_COLUMNS == 0 else COLUMNS


__all__ = ["COLUMNS", "TILE_ROWS", "WIDE_COLUMNS", "column_tile"]
