"""The 1/32 lattice of 4-D grids, and the grid as the int8 operands of the integer tensor cores (design.md §4).

The points of YAKV's scoring grid (256 points of 4 coordinates, quant/higgs.py) are multiples of 1/`LATTICE`
within +-127/`LATTICE`, so `LATTICE * g` is an int8 exactly: the scoring kernels (kernels/score_codes.cu) multiply a
code's point by the query on integer tensor cores and compute what the twin's float products compute. Rounding the
Lloyd fit onto the lattice moves each coordinate by at most 1/64, which raises the grid's distortion by 0.02%
(0.09991 against 0.09989 per coordinate).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["LATTICE", "lattice_points", "to_lattice"]

LATTICE = 32

# The int8 form of each grid tensor handed to `lattice_points`: {id(grid): (weakref to grid, words)}.
_WORDS: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def to_lattice(grid: torch.Tensor) -> torch.Tensor:
    """`grid` (any shape) rounded to the nearest multiples of 1/`LATTICE` within +-127/`LATTICE`."""
    return (grid * LATTICE).round().clamp(-127, 127) / LATTICE


def lattice_points(grid: torch.Tensor) -> torch.Tensor:
    """`[256]` int32 on the grid's device: point j of a 4-D lattice grid `[256, 4]` as four int8 `LATTICE * g`
    (coordinate i in byte i), the kernels' operand words; made once per grid tensor.

    Raises `ValueError` for a grid off the lattice, which the integer kernels would read otherwise than the twin."""
    held = _WORDS.get(id(grid))
    if held is not None and held[0]() is grid:
        return held[1]
    scaled = grid.float() * LATTICE
    ints = scaled.round()
    if grid.shape != (256, 4) or not (torch.equal(ints, scaled) and bool(ints.abs().max() <= 127)):
        raise ValueError(
            f"The integer tensor-core scoring kernels take a [256, 4] grid of multiples of 1/{LATTICE} within "
            f"+-{127 / LATTICE} (HiggsQuantizer's at grid_dim=4); got a {tuple(grid.shape)} grid off that lattice. "
            "Pass tensor_cores=False (the fp32 kernel) for another grid."
        )
    words = ints.to(torch.int8).contiguous().view(torch.int32).view(256)
    key = id(grid)
    _WORDS[key] = (weakref.ref(grid, lambda _, key=key: _WORDS.pop(key, None)), words)
    return words
