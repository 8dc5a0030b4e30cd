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
from .lattice import LATTICE, lattice_points, to_lattice

__all__ = [
    "GRID_DIMS",
    "GRID_POINTS",
    "HiggsQuantizer",
    "LATTICE",
    "QuantizedVectors",
    "check_tables",
    "gaussian_grid",
    "higgs_quantizer",
    "lattice_points",
    "to_lattice",
]
