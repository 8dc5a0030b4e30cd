"""Query-key dot products from quantised keys through a lookup table (YAKV token scoring).

Legend: B batch, Hq/Hkv query/KV heads, G = Hq/Hkv, T query tokens, Q query rows per KV head (G x T), N tokens,
M sub-vectors per key, p grid dim, D head dim, 256 grid points.

`table[b, h, q, m, j]` is the dot of sub-vector `m` of rotated query row `q` with grid point `j`
(`HiggsQuantizer.lookup_table`), so `q . k_hat = norm(k) / sqrt(D) * sum_m table[q, m, code(k)_m]`. This is
the PyTorch twin that defines the meaning; it works on blocks of tokens so that the gathered `[N, M, Q]`
block stays bounded whatever N.

`code_scores` is what `QuantizedKeyTopK` ranks tokens by: the softmax over tokens of those logits, summed over
query tokens, max over the query heads of each GQA group. `code_scores_reference` defines it. For one query token
on CUDA, `kernels/score_codes.cu` computes it: on integer tensor cores (sm_80+, grid dim 4, whose points are
multiples of 1/32, D in {64, 128, 256}) in one pass over the codes that keeps per-tile softmax states and each logit
as an fp16 exponential relative to its 16-token group's max (2^-11 relative), then a kernel that turns those into
the scores, with no fp32 logits in HBM; otherwise an fp32 kernel writes fp32 logits with per-tile states and
`softmax_group_max` (softmax_group_max.cu) normalises them and takes the group max.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from ..quant import HiggsQuantizer, lattice_points
from .library import define_op
from .loader import kernels_available, load_kernels, multiprocessors

__all__ = ["attention_scores", "code_scores", "code_scores_op", "code_scores_reference", "score_codes"]

# Elements of the gathered block per step: 2^24 float32 = 64 MiB.
_BLOCK_ELEMENTS = 1 << 24


def score_codes(table: torch.Tensor, codes: torch.Tensor, norms: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Scores `[B, Hkv, Q, N]` float32 of every token for every query row.

    Args:
        table (`torch.Tensor`): `[B, Hkv, Q, M, 256]` float32 lookup table of the rotated queries.
        codes (`torch.Tensor`): `[B, Hkv, N, M]` uint8 grid indices of the rotated, scaled keys; rows sharing
            one document may be stride-0 views.
        norms (`torch.Tensor`): `[B, Hkv, N]` fp16 key norms.
        head_dim (`int`): D, for the `norm / sqrt(D)` scale.
    """
    batch, heads, rows, m, points = table.shape
    num = codes.shape[2]
    # Sub-vector m's codes index the m-th block of 256 entries of the flattened table.
    flat = table.float().permute(0, 1, 3, 4, 2).reshape(batch, heads, m * points, rows)  # [B, Hkv, M*256, Q]
    offsets = torch.arange(m, device=codes.device) * points
    out = table.new_empty((batch, heads, num, rows), dtype=torch.float32)
    step = max(1, _BLOCK_ELEMENTS // max(1, m * rows * batch * heads))
    for start in range(0, num, step):
        block = codes[:, :, start : start + step]
        n = block.shape[2]
        index = (block.long() + offsets).reshape(batch, heads, n * m, 1).expand(-1, -1, -1, rows)
        dots = flat.gather(2, index).view(batch, heads, n, m, rows).sum(dim=3)  # [B, Hkv, n, Q]
        out[:, :, start : start + n] = dots
    out *= (norms.float() / math.sqrt(head_dim))[..., None]
    return out.transpose(2, 3)


def code_scores_reference(
    query: torch.Tensor,
    codes: torch.Tensor,
    norms: torch.Tensor,
    selectable: torch.Tensor,
    quantizer: HiggsQuantizer,
    scaling: float,
) -> torch.Tensor:
    """`[B, Hkv, N]` fp32: `max_g sum_t softmax_n(scaling * q_{g,t} . k_hat_n)` over selectable tokens, 0 elsewhere.

    Args:
        query (`torch.Tensor`): `[B, Hq, T, D]`, any float dtype.
        codes (`torch.Tensor`): `[B, Hkv, N, M]` uint8 scoring codes (`quantizer`'s); stride-0 rows allowed.
        norms (`torch.Tensor`): `[B, Hkv, N]` fp16 key norms.
        selectable (`torch.Tensor`): `[B, Hkv, N]` bool.
        quantizer (`HiggsQuantizer`): the scoring grid's quantiser (head dim D).
    """
    batch, heads, num, _ = codes.shape
    q_heads, q_len, dim = query.shape[1:]
    groups = q_heads // heads
    q = query.reshape(batch, heads, groups * q_len, dim)  # rows g*T + t of each KV head
    # The query is rotated once per step; the table then scores every code of its KV head.
    table = quantizer.lookup_table(quantizer.rotate(q))  # [B, Hkv, G*T, M, 256]
    logits = score_codes(table, codes, norms, dim) * scaling  # [B, Hkv, G*T, N]
    return attention_scores(logits, selectable, groups)


def attention_scores(logits: torch.Tensor, selectable: torch.Tensor, groups: int) -> torch.Tensor:
    """Approximate attention `[B, Hkv, N]` from approximate logits `[B, Hkv, G*T, N]` (rows ordered head-major,
    as `grouped_query(...).flatten(2, 3)`): softmax over the selectable tokens of each query head and token,
    summed over query tokens, max over the `G` query heads of each KV head. Zero where not selectable."""
    batch, heads, rows, num = logits.shape
    logits = logits.masked_fill(~selectable[:, :, None, :], float("-inf"))
    # A row with nothing selectable has an all -inf softmax (NaN); it selects nothing anyway.
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0).view(batch, heads, groups, rows // groups, num)
    return probs.sum(dim=3).amax(dim=2)  # [B, Hkv, N]


_MAX_GROUP = 8
_MAX_DIM = 256
_THREADS, _TILE, _SOFTMAX_TILE = 256, 1024, 1024
# Tensor-core kernels: 4 warps per block (D = 128: MMA_K8_GRID's), 2048 tokens per block (score_codes.cu's MMA_TILE);
# the scores from their exponentials: 256 threads, 2048 tokens per block (FINISH_TILE).
_MMA_THREADS, _MMA_TILE = 128, 2048
_FINISH_THREADS, _FINISH_TILE = 256, 2048
_MMA_CODES_PER_THREAD = (4, 8, 16)  # M / 4 for D = 64, 128, 256 at grid dim 4
# D = 128's tensor-core grid: (blocks per SM its registers are budgeted for, stages of its code ring, warps per block),
# compiled in (score_codes.cu's MMA_MIN_BLOCKS_K8, MMA_DEPTH_K8, MMA_WARPS_K8); benchmarks/scoring.py compares settings.
# 4 blocks and 3 stages scored 128K tokens at batch 23 in 0.863 ms per layer against 0.911 with 5 stages and 0.871 at
# 5 blocks and 3 stages on an H200 machine (results/scoring_cuda_imma.md); 8 warps per block sharing one table took
# 0.94-1.04 ms against 0.80 at batch 22 on an H100 machine (results/scoring_128k_grids_warps_h100.md).
MMA_K8_GRID = (4, 3, 4)


def check_mma_k8_grid(grid: tuple[int, ...]) -> None:
    """Refuse a D = 128 tensor-core grid that does not compile: (blocks per SM 1-8, code-ring stages 2-5, warps per
    block 4 or 8); more stages, or more than 2 with 8 warps, overflow static shared memory."""
    ok = len(grid) == 3 and 1 <= grid[0] <= 8 and grid[2] in (4, 8) and 2 <= grid[1] <= (5 if grid[2] == 4 else 2)
    if not ok:
        raise ValueError(
            "MMA_K8_GRID takes (blocks per SM 1-8, code-ring stages 2-5, warps per block 4 or 8; 2 stages at most "
            f"with 8 warps), e.g. (4, 3, 4); got {grid!r}."
        )


def _kernels(device: torch.device):
    check_mma_k8_grid(MMA_K8_GRID)
    blocks, depth, warps = MMA_K8_GRID
    defines = (("MMA_MIN_BLOCKS_K8", blocks), ("MMA_DEPTH_K8", depth), ("MMA_WARPS_K8", warps))
    return load_kernels("score_codes", device, defines)


@functools.cache
def _has_mma(index: int) -> bool:
    """Whether CUDA device `index` runs `mma.sync.m16n8k16` with fp16 operands (sm_80 and later)."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


def _tensor_cores(device: torch.device, grid_dim: int, m: int, codes: torch.Tensor) -> bool:
    per_thread = m // 4
    return (
        grid_dim == 4
        and m % 4 == 0
        and per_thread in _MMA_CODES_PER_THREAD
        and all(x % per_thread == 0 for x in (codes.data_ptr(), codes.stride(0)))
        and _has_mma(device.index if device.index is not None else torch.cuda.current_device())
    )


def _codes_per_thread(group: int, grid_dim: int) -> int:
    """Codes one kernel thread reads per token (`CodesPerThread` in score_codes.cu): <= 64 query registers."""
    budget = 64 // (group * grid_dim)
    return next((n for n in (16, 8, 4, 2) if budget >= n), 1)


def code_scores(
    query: torch.Tensor,
    codes: torch.Tensor,
    norms: torch.Tensor,
    selectable: torch.Tensor,
    quantizer: HiggsQuantizer,
    scaling: float,
    tensor_cores: bool = True,
    masked: bool = False,
) -> torch.Tensor:
    """Same as `code_scores_reference`; the kernels for one query token on CUDA, the twin otherwise. `masked`: -inf
    instead of 0 where not selectable (what a top-k takes; the tensor-core kernels write it with no extra pass).

    The kernels sum each dot product in another order than the twin's table (fp32 round-off of a D-term sum)
    and exponentiate with `__expf`: the fp32 kernel is equal to ~1e-5 relative. The tensor-core kernels round each
    query head to a 24-bit integer (2^-24 of its largest coordinate) and keep each logit as an fp16 exponential
    relative to its 16-token group's max: 2^-11 relative (plus `ex2`'s ~1e-6) where that exponential is at least
    2^-29, within 2^-39 absolute below. `tensor_cores=False` keeps to the fp32 kernel (the tests compare both with
    the twin).
    """
    batch, heads, num, m = codes.shape
    q_heads, q_len, dim = query.shape[1:]
    group = q_heads // heads
    p = quantizer.grid_dim
    cpt = _codes_per_thread(max(group, 1), p)
    if not (
        kernels_available(query.device)
        and q_len == 1
        and 1 <= group <= _MAX_GROUP
        and q_heads == group * heads
        and dim == quantizer.head_dim <= _MAX_DIM
        and m == quantizer.num_subvectors
        and m % cpt == 0
        and m // cpt <= 32
        and num > 0
        and codes.dtype == torch.uint8
        and codes.stride()[1:] == (num * m, m, 1)
        and all(x % cpt == 0 for x in (codes.data_ptr(), codes.stride(0)))
        and norms.dtype == torch.float16
        and norms.stride()[1:] == (num, 1)
        and selectable.dtype == torch.bool
        and selectable.stride(2) == 1
    ):
        scores = code_scores_reference(query, codes, norms, selectable, quantizer, scaling)
        return scores.masked_fill(~selectable, float("-inf")) if masked else scores
    rotated = quantizer.rotate(query.reshape(batch, heads, group, dim)).contiguous()  # [B, Hkv, G, D] fp32
    grid, _ = quantizer.device_tables(query.device)
    mma = tensor_cores and _tensor_cores(query.device, p, m, codes)
    fill = float("-inf") if masked else 0.0
    return code_scores_op(rotated, codes, norms, selectable, grid, scaling, mma, fill)


def _code_scores_twin(
    rotated: torch.Tensor,
    codes: torch.Tensor,
    norms: torch.Tensor,
    selectable: torch.Tensor,
    grid: torch.Tensor,
    scaling: float,
    tensor_cores: bool,
    fill: float = 0.0,
) -> torch.Tensor:
    """`code_scores_reference` from the rotated queries and the grid (one query token), `fill` where not
    selectable."""
    group, dim = rotated.shape[2:]
    table = rotated.float().unflatten(-1, (dim // grid.shape[-1], grid.shape[-1])) @ grid.float().T
    scores = attention_scores(score_codes(table, codes, norms, dim) * scaling, selectable, group)
    return scores if fill == 0.0 else scores.masked_fill(~selectable, fill)


def _scores_like(rotated, codes, norms, selectable, grid, scaling, tensor_cores, fill=0.0) -> torch.Tensor:
    return torch.empty(codes.shape[:3], dtype=torch.float32, device=codes.device)


@define_op(
    "code_scores(Tensor rotated, Tensor codes, Tensor norms, Tensor selectable, Tensor grid, float scaling, "
    "bool tensor_cores, float fill=0.) -> Tensor",
    cpu=_code_scores_twin,
    fake=_scores_like,
)
def code_scores_op(
    rotated: torch.Tensor,
    codes: torch.Tensor,
    norms: torch.Tensor,
    selectable: torch.Tensor,
    grid: torch.Tensor,
    scaling: float,
    tensor_cores: bool,
    fill: float = 0.0,
) -> torch.Tensor:
    """`torch.ops.shadowkv.code_scores`: scores `[B, Hkv, N]` fp32 through the kernels, on what `code_scores`
    checked: `rotated` `[B, Hkv, G, D]` fp32 contiguous (the rotated queries of one token), `grid` `[256, p]` on the
    device; the tensor-core kernels where `tensor_cores` (a 4-D grid on the 1/32 lattice: `lattice_points`), else the
    fp32 kernel and `softmax_group_max`. `fill` is the score of tokens that are not selectable (0, or -inf for a
    top-k)."""
    batch, heads, group, dim = rotated.shape
    num, m = codes.shape[2:]
    inputs = _input_args(rotated, codes, norms, selectable, grid, scaling, dim)
    if tensor_cores:
        inputs[8] = lattice_points(grid)  # the integer kernels read the grid as int8 points
        return _code_scores_mma(inputs, (batch, heads, group, num, m), rotated.device, fill)
    p = grid.shape[-1]
    device = rotated.device
    tiles = -(-num // _TILE)
    logits = torch.empty((batch, heads, group, num), dtype=torch.float32, device=device)
    part_max = torch.empty((batch, heads, group, tiles), dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    scores = torch.empty((batch, heads, num), dtype=torch.float32, device=device)
    i32 = ctypes.c_int
    _kernels(device).launch(
        f"code_logits_p{p}_g{group}",
        grid=(tiles, heads, batch),
        block=(_THREADS, 1, 1),
        args=[logits, part_max, part_sum, *inputs, (heads, i32), (num, i32), (m, i32), (_TILE, i32)],
    )
    load_kernels("softmax_group_max", device).launch(
        "softmax_group_max",
        grid=(-(-num // _SOFTMAX_TILE), heads, batch),
        block=(_THREADS, 1, 1),
        args=[scores, logits, part_max, part_sum, (heads, i32), (group, i32), (num, i32), (tiles, i32)],
    )
    return scores if fill == 0.0 else scores.masked_fill_(~selectable, fill)


def _code_scores_mma(
    inputs: list, shape: tuple[int, int, int, int, int], device: torch.device, fill: float = 0.0
) -> torch.Tensor:
    """The tensor-core kernels' scores `[B, Hkv, N]` fp32 (`fill` where not selectable) from the launch arguments
    `_input_args` built of what `code_scores` checked, the grid replaced by `lattice_points`; `shape` is
    `(B, Hkv, G, N, M)`. One pass over the codes writes per-tile states and fp16 exponentials relative to each 16-token
    group's max; the second kernel reads those, not the codes."""
    batch, heads, group, num, m = shape
    tiles = -(-num // _MMA_TILE)
    pairs = -(-group // 2)  # query heads rounded up to even, as pairs of fp16 in int32 words
    part_max = torch.empty((batch, heads, group, tiles), dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    exps = torch.empty((batch, heads, num, pairs), dtype=torch.int32, device=device)  # fp16 pairs
    group_max = torch.empty((batch, heads, -(-num // 16), 2 * pairs), dtype=torch.float32, device=device)
    scores = torch.empty((batch, heads, num), dtype=torch.float32, device=device)
    i32 = ctypes.c_int
    kernels = _kernels(device)
    name = f"code_states_mma_k{m // 4}_g{4 if group <= 4 else 8}"  # two MMAs per k-tile up to 4 query heads, else 3
    threads = 32 * MMA_K8_GRID[2] if m == 32 else _MMA_THREADS
    # The blocks that fit at once, each over a contiguous share of the tiles (its grid table made once).
    blocks = min(batch * heads * tiles, kernels.resident_blocks(name, threads) * multiprocessors(device))
    kernels.launch(
        name,
        grid=(blocks, 1, 1),
        block=(threads, 1, 1),
        args=[part_max, part_sum, exps, group_max, *inputs, *((x, i32) for x in (batch, heads, group, num))],
    )
    fill32 = (float(fill), ctypes.c_float)
    kernels.launch(
        f"code_scores_finish_p{pairs}",
        grid=(-(-num // _FINISH_TILE), heads, batch),
        block=(_FINISH_THREADS, 1, 1),
        args=[*(scores, exps, group_max, part_max, part_sum), *((x, i32) for x in (heads, group, num, tiles)), fill32],
    )
    return scores


def _input_args(
    rotated: torch.Tensor,
    codes: torch.Tensor,
    norms: torch.Tensor,
    selectable: torch.Tensor,
    grid: torch.Tensor,
    scaling: float,
    dim: int,
) -> list:
    """The launch arguments every scoring kernel takes in this order, from the rotated queries to `sqrt(D)`."""
    i64 = ctypes.c_longlong
    return [
        rotated,
        codes,
        (codes.stride(0), i64),
        norms,
        (norms.stride(0), i64),
        selectable,
        (selectable.stride(0), i64),
        (selectable.stride(1), i64),
        grid,
        (float(scaling), ctypes.c_float),
        (math.sqrt(dim), ctypes.c_float),
    ]
