"""Vector quantisers for KV storage (YAKV mode, design.md §4)."""

from .higgs import (
    GRID_DIMS,
    GRID_POINTS,
    HiggsQuantizer,
    QuantizedVectors,
    check_tables,
    gaussian_grid,
    higgs_quantizer,
)

__all__ = [
    "GRID_DIMS",
    "GRID_POINTS",
    "HiggsQuantizer",
    "QuantizedVectors",
    "check_tables",
    "gaussian_grid",
    "higgs_quantizer",
]
