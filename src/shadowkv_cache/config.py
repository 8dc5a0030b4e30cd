"""ShadowKV configuration: one dataclass, validated at construction, resolved per prompt.

Legend: S prompt tokens of one row, c chunk size, Hkv KV heads, D head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

__all__ = ["RANK_RULES", "ResolvedSizes", "ShadowKVConfig", "VALUE_FORMATS"]

# How the host value store encodes values (stores/value_codecs.py): the KV dtype unchanged, fp8, ~4-bit HIGGS.
VALUE_FORMATS = ("native", "fp8", "higgs4")

# The paper's settings for Llama-3.1-8B (Hkv*D = 1024) at 128K, expressed as shares so they scale.
# rank="auto": per layer (and row), the smallest rank (a multiple of 8) whose rebuilt keys keep the attention logits
# of the prompt's last queries within `auto_rank_error` (relative) and `auto_rank_shift` (nats, where attention
# looks), clamped to [floor, ceiling] shares of Hkv*D (docs/design.md §2; calibrated in
# benchmarks/results/defaults_*.md and accuracy_smollm2_*.md).
_AUTO_FLOOR_SHARE = 0.125
_AUTO_CEILING_SHARE = 0.75
AUTO_QUERIES = 32  # the last prompt queries the rule measures against
RANK_RULES = ("auto",)
_BUDGET_SHARE = 0.015625  # 2048 / 131072
# Below 128K tokens the paper's share gives fewer than 2048 tokens, where landmark selection loses needles on small
# models: with exact keys SmolLM2 at 8K agrees with full attention on 0.94 of tokens at 1024, 0.96 at 2048; Gemma 3
# 270M at 16K on 0.92 at 2048 (docs/design.md §2).
_BUDGET_FLOOR = 2048
_OUTLIER_SHARE = 0.003  # ~48 chunks of 16384
_OUTLIER_FLOOR = 4
# YAKV fetches ~4-bit keys and values (~1.03*D bytes per token and head at D = 128) where ShadowKV fetches bf16
# values (2*D bytes), so about twice the tokens move the same PCIe bytes: the study's 3.125% (its Appendix G).
_YAKV_BUDGET_SHARE = 0.03125
_YAKV_BUDGET_FLOOR = 512
MODES = ("shadowkv", "yakv")
_GRID_DIMS = (2, 4, 8)  # as shadowkv_cache.quant.GRID_DIMS (not imported: the config stays free of torch)
# Per mode, the settings of the other mode that it does not read, with the fix its error gives.
_OTHER_MODES_SETTINGS = {
    "shadowkv": {
        "recent_window": "it is YAKV's exact recent tokens; ShadowKV keeps `local_window` tokens exact: set that, "
        "or use mode='yakv'.",
        "host_grid_dim": "it sets YAKV's host records; ShadowKV's values take `value_format`: set that, or use "
        "mode='yakv'.",
        "score_grid_dim": "it sets YAKV's scoring codes; ShadowKV scores chunk landmarks: leave it, or use "
        "mode='yakv'.",
    },
    "yakv": {
        "chunk_size": "YAKV mode selects tokens, not chunks; leave it at its default.",
        "local_window": "YAKV mode keeps `recent_window` tokens exact (default 64): set that instead.",
    },
}


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class ShadowKVConfig:
    """Settings of the ShadowKV cache, immutable once validated (`dataclasses.replace` makes a changed copy). `None`
    means the paper's setting scaled to the model and prompt.

    Args:
        rank (`str`, `int` or `float`, *optional*, defaults to `"auto"`):
            Rank of the joint low-rank factorisation of the pre-RoPE keys. `"auto"` (or `None`): per layer, the
            smallest rank (a multiple of 8) whose rebuilt keys keep the attention logits of the prompt's last 32
            queries within `auto_rank_error` (7.5%, relative, logits centred) and `auto_rank_shift` (0.2 nats where
            attention looks), clamped to [12.5%, 75%] of `Hkv*D`;
            the rank each layer chose is in `memory_report()`. An int is absolute and must be `<= Hkv*D`; a float in
            (0, 1] is that share of `Hkv*D`. Capped at the number of compressed tokens.
        chunk_size (`int`, *optional*, defaults to 8):
            Tokens per chunk; one landmark (mean post-RoPE key) per chunk.
        sparse_budget (`int` or `float`, *optional*):
            Tokens selected per KV head, per row, per layer and step (outliers, local window and generated tokens
            come on top). A float in (0, 1) is that share of the prompt. Defaults to `max(2048, 1.5625% of S)`, at most
            a quarter of the prompt.
            Rounded up to whole chunks and clamped to the selectable chunks.
        outlier_chunks (`int` or `float`, *optional*):
            Chunks per KV head kept exact on the accelerator because their keys disagree most with their
            landmark. A float in (0, 1) is that share of the chunks. Defaults to `max(4, ceil(0.3% of S/c))`.
        local_window (`int`, *optional*, defaults to 32):
            Last prompt tokens kept exact (at least the ragged tail that does not fill a chunk).
        min_compress_len (`int`, *optional*, defaults to 4096):
            Prompts (per row, real tokens) shorter than this stay exact and are never compressed.
        dense_multi_token_steps (`bool`, *optional*, defaults to `True`):
            Steps with several new tokens after the compressed prompt (a new chat turn, a question after a loaded
            prefix) attend over every chunk (all keys rebuilt, all values fetched) instead of the sparse
            selection; single-token decode steps stay sparse. Measured on the prefix-reuse example: 3/3 answers
            at a 1024-token budget, against 0/3 with sparse question steps.
        pin_memory (`bool`, *optional*, defaults to `True`):
            Pin the host value store when the model runs on CUDA (needed for fast, asynchronous fetches).
        cuda_graphs (`bool`, *optional*, defaults to `True`):
            On CUDA with the kernels, capture the one-token decode step as a CUDA graph and replay it: the whole
            model's step when every layer is compressed and on one GPU (one launch per step), otherwise each layer's
            attention step (one launch instead of ~40 per layer and step). Captured again when rows are reordered
            or the buffer of new tokens grows (design.md §3).
        compile_model_ops (`bool`, *optional*, defaults to `True`):
            On CUDA, compile the model's own norms, dense MLPs and RoPE with `torch.compile` for one-token decode
            steps of a compressed cache on one GPU (eager or captured), so that each is one or two fused kernels
            instead of up to ten small ones (~1.5 ms of an 11.6 ms step at batch 1 on Llama-3.1-8B, 128K). Compiled
            once per process and shape, at the first such step (seconds); prefill and multi-token steps are
            unchanged. `False` keeps the model's own kernels.
        value_format (`str`, *optional*, defaults to `"native"`):
            How the offloaded values are stored in host memory: `"native"` in the KV dtype (16 bits per value in
            bf16), `"fp8"` as float8 e4m3 with one bf16 scale per value vector (`8 + 16/D` bits), `"higgs4"`
            ~4-bit HIGGS codes (2-D grid, `4 + 16/D` bits). Fetched values are decoded to the KV dtype; the
            outlier, local and generated values stay exact. See `stores/value_codecs.py`.
        mode (`str`, *optional*, defaults to `"shadowkv"`):
            `"shadowkv"` (low-rank keys, chunk landmarks, outliers, values on the host) or `"yakv"` (the
            context-intensive mode, design.md §4: keys and values quantised ~4-bit on the host, a ~2-bit copy of every
            key on the device scores each token, the top `sparse_budget` tokens per KV head are fetched). In
            YAKV mode `rank`, `outlier_chunks`, `chunk_size` and `local_window` do not apply; `sparse_budget`
            counts tokens (not rounded to chunks) and defaults to `max(512, 3.125% of S)`, the same PCIe bytes
            per step as ShadowKV's default at bf16.
        host_grid_dim (`int`, *optional*, defaults to 2):
            YAKV: grid dimension p of the host copy of keys and values, `8/p + 16/D` bits per value (2 -> ~4 bits).
        score_grid_dim (`int`, *optional*, defaults to 4):
            YAKV: grid dimension of the device copy of the keys that scores every token (4 -> ~2 bits).
        recent_window (`int`, *optional*, defaults to 64):
            YAKV: last prompt tokens kept exact on the device.
        device_record_share (`float`, *optional*, defaults to 0.0):
            YAKV: share of each row's quantised tokens (its first ones) whose host records are also kept in GPU
            memory, in [0, 1]. A step then reads those records at HBM speed and only the rest cross PCIe: for a
            GPU with memory to spare beside the batch (each mirrored token costs `2*D/host_grid_dim + 4` bytes per
            KV head and layer). At 1 a step reads the selected records in place and holds no dequantised tokens
            (less memory, no fetch; keys and values unrounded, so outputs differ by round-off); below 1 it changes no
            result. May change at `load_prefix`.
        auto_rank_error (`float`, *optional*, defaults to 0.075):
            `rank="auto"`: the relative error of the attention logits (the prompt's last queries against keys
            rebuilt from the factors, logits centred) that each layer's rank must stay within. Lower keeps more rank
            (more device memory, closer to full attention).
        auto_rank_shift (`float`, *optional*, defaults to 0.2):
            `rank="auto"`: the error of the attention logits where attention looks, in nats (each query's logit
            errors, as attention scales them, averaged under its exact attention) that each layer's rank must also
            stay within: what keeps the rare keys a question attends to (a needle in repetitive text). Lower keeps
            more rank.

    >>> ShadowKVConfig(sparse_budget=0.05, min_compress_len=1024).chunk_size
    8
    """

    rank: int | float | str | None = "auto"
    chunk_size: int = 8
    sparse_budget: int | float | None = None
    outlier_chunks: int | float | None = None
    local_window: int = 32
    min_compress_len: int = 4096
    dense_multi_token_steps: bool = True
    pin_memory: bool = True
    cuda_graphs: bool = True
    compile_model_ops: bool = True
    value_format: str = "native"
    mode: str = "shadowkv"
    host_grid_dim: int = 2
    score_grid_dim: int = 4
    recent_window: int = 64
    device_record_share: float = 0.0
    auto_rank_error: float = 0.075
    auto_rank_shift: float = 0.2

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def validate(self, key_dim: int | None = None, head_dim: int | None = None) -> None:
        """Raise `ValueError` naming the bad field and the fix; `key_dim` (`Hkv*D`) checks the rank bound and
        `head_dim` (`D`) what YAKV's quantiser needs."""

        def bad(name: str, value: object, fix: str) -> ValueError:
            return ValueError(f"ShadowKVConfig.{name}={value!r} is invalid: {fix}")

        if not isinstance(self.chunk_size, int) or isinstance(self.chunk_size, bool) or self.chunk_size < 1:
            raise bad("chunk_size", self.chunk_size, "use a positive int (the paper uses 8).")
        if not isinstance(self.local_window, int) or isinstance(self.local_window, bool) or self.local_window < 0:
            raise bad("local_window", self.local_window, "use an int >= 0 (the paper uses 32).")
        if (
            not isinstance(self.min_compress_len, int)
            or isinstance(self.min_compress_len, bool)
            or self.min_compress_len < 1
        ):
            raise bad("min_compress_len", self.min_compress_len, "use a positive int (default 4096).")
        if self.rank is not None and self.rank not in RANK_RULES:
            if not _is_number(self.rank) or not 0 < self.rank < math.inf:
                raise bad("rank", self.rank, "use 'auto' (the default), a positive int or a float in (0, 1].")
            if isinstance(self.rank, float) and self.rank > 1:
                raise bad("rank", self.rank, "a float rank is a share of Hkv*D and must be in (0, 1].")
            if isinstance(self.rank, int) and key_dim is not None and self.rank > key_dim:
                raise bad("rank", self.rank, f"it must be <= Hkv*D = {key_dim} for this model.")
        if self.sparse_budget is not None:
            if not _is_number(self.sparse_budget) or not 0 < self.sparse_budget < math.inf:
                raise bad(
                    "sparse_budget", self.sparse_budget, "use a positive int (tokens), a float in (0, 1), or None."
                )
            if isinstance(self.sparse_budget, float) and self.sparse_budget >= 1:
                raise bad("sparse_budget", self.sparse_budget, "a float budget is a share of the prompt, in (0, 1).")
        if self.outlier_chunks is not None:
            if not _is_number(self.outlier_chunks) or not 0 <= self.outlier_chunks < math.inf:
                raise bad("outlier_chunks", self.outlier_chunks, "use an int >= 0, a float in [0, 1), or None.")
            if isinstance(self.outlier_chunks, float) and self.outlier_chunks >= 1:
                raise bad("outlier_chunks", self.outlier_chunks, "a float is a share of the chunks, in [0, 1).")
        if not isinstance(self.dense_multi_token_steps, bool):
            raise bad("dense_multi_token_steps", self.dense_multi_token_steps, "use True or False.")
        if not isinstance(self.pin_memory, bool):
            raise bad("pin_memory", self.pin_memory, "use True or False.")
        if not isinstance(self.cuda_graphs, bool):
            raise bad("cuda_graphs", self.cuda_graphs, "use True or False.")
        if not isinstance(self.compile_model_ops, bool):
            raise bad("compile_model_ops", self.compile_model_ops, "use True or False.")
        if self.value_format not in VALUE_FORMATS:
            raise bad("value_format", self.value_format, f"use one of {', '.join(map(repr, VALUE_FORMATS))}.")
        if self.mode not in MODES:
            raise bad("mode", self.mode, f"use one of {MODES}.")
        for name in ("host_grid_dim", "score_grid_dim"):
            if type(getattr(self, name)) is not int or getattr(self, name) not in _GRID_DIMS:
                raise bad(name, getattr(self, name), f"use one of {_GRID_DIMS} (~4 / 2 / 1 bits per value).")
        if not _is_number(self.auto_rank_error) or not 0 < self.auto_rank_error < math.inf:
            raise bad("auto_rank_error", self.auto_rank_error, "use a positive number (the default is 0.075).")
        if not _is_number(self.auto_rank_shift) or not 0 < self.auto_rank_shift < math.inf:
            raise bad("auto_rank_shift", self.auto_rank_shift, "use a positive number of nats (the default is 0.2).")
        if not isinstance(self.recent_window, int) or isinstance(self.recent_window, bool) or self.recent_window < 0:
            raise bad("recent_window", self.recent_window, "use an int >= 0 (the YAKV study uses 64).")
        share = self.device_record_share
        if not _is_number(share) or not 0 <= share <= 1:
            raise bad("device_record_share", share, "use a share of the prompt's tokens in [0, 1] (0: none mirrored).")
        if self.mode != "yakv" and share:
            raise bad("device_record_share", share, "it mirrors YAKV's host records on the GPU: use mode='yakv', or 0.")
        if self.mode == "yakv":
            if self.rank not in (None, *RANK_RULES):
                raise bad("rank", self.rank, "YAKV mode has no low-rank keys; leave it at its default.")
            if self.outlier_chunks is not None:
                raise bad(
                    "outlier_chunks", self.outlier_chunks, "YAKV mode has no low-rank keys or outliers; leave it None."
                )
            if self.value_format != "native":
                raise bad(
                    "value_format",
                    self.value_format,
                    "YAKV mode stores keys and values as its own ~4-bit records (set by host_grid_dim), so "
                    "value_format does not apply; leave value_format='native', or use mode='shadowkv' for fp8/higgs4.",
                )
            if head_dim is not None:
                for name in ("host_grid_dim", "score_grid_dim"):
                    if head_dim & (head_dim - 1) or head_dim % getattr(self, name):
                        raise bad(
                            "mode",
                            self.mode,
                            f"YAKV's Hadamard quantiser needs a power-of-two head dim divisible by {name}="
                            f"{getattr(self, name)}; this model's is {head_dim}. Use mode='shadowkv'.",
                        )
        # A setting of the other mode, changed from its default, would be ignored: refused so that none is silent.
        for name, fix in _OTHER_MODES_SETTINGS[self.mode].items():
            if getattr(self, name) != _DEFAULTS[name]:
                raise bad(name, getattr(self, name), fix)

    def resolve(self, num_tokens: int, key_dim: int) -> ResolvedSizes:
        """Sizes for one row of `num_tokens` real prompt tokens and a key dim of `key_dim = Hkv*D`.

        In YAKV mode a "chunk" is one token: `num_chunks` counts the quantised tokens, `budget_chunks` the
        tokens selected per KV head, `local` the exact recent tokens.
        """
        c = self.chunk_size
        if num_tokens < self.min_compress_len:
            return ResolvedSizes(num_chunks=0, rank=0, budget_chunks=0, outliers=0, local=num_tokens)
        if self.mode == "yakv":
            local = min(self.recent_window, num_tokens)
            quantised = num_tokens - local
            if self.sparse_budget is None:
                budget = max(_YAKV_BUDGET_FLOOR, math.ceil(_YAKV_BUDGET_SHARE * num_tokens))
            elif isinstance(self.sparse_budget, float):
                budget = math.ceil(self.sparse_budget * num_tokens)
            else:
                budget = self.sparse_budget
            return ResolvedSizes(quantised, 0, min(budget, quantised), 0, local)
        # The ragged tail joins the local window, so every chunk is full.
        num_chunks = max(num_tokens - self.local_window, 0) // c
        local = num_tokens - num_chunks * c
        compressed = num_chunks * c

        max_error = max_shift = None
        if self.rank is None or self.rank in RANK_RULES:
            max_error, max_shift = self.auto_rank_error, self.auto_rank_shift
            floor, rank = math.ceil(_AUTO_FLOOR_SHARE * key_dim), math.ceil(_AUTO_CEILING_SHARE * key_dim)
        elif isinstance(self.rank, float):
            rank = max(1, math.ceil(self.rank * key_dim))
        else:
            rank = self.rank
        rank = min(rank, key_dim, compressed)
        floor = min(floor, rank) if max_error is not None else rank

        if self.outlier_chunks is None:
            outliers = max(_OUTLIER_FLOOR, math.ceil(_OUTLIER_SHARE * num_tokens / c))
        elif isinstance(self.outlier_chunks, float):
            outliers = math.ceil(self.outlier_chunks * num_chunks)
        else:
            outliers = self.outlier_chunks
        outliers = min(outliers, num_chunks)

        if self.sparse_budget is None:
            # The floor would select most of a short prompt (which only compresses when min_compress_len is
            # lowered): a quarter of the prompt at most.
            budget = min(max(_BUDGET_FLOOR, math.ceil(_BUDGET_SHARE * num_tokens)), num_tokens // 4)
        elif isinstance(self.sparse_budget, float):
            budget = math.ceil(self.sparse_budget * num_tokens)
        else:
            budget = self.sparse_budget
        budget_chunks = min(math.ceil(budget / c), num_chunks - outliers)
        return ResolvedSizes(num_chunks, rank, budget_chunks, outliers, local, floor, max_error, max_shift)


_DEFAULTS = {f.name: f.default for f in fields(ShadowKVConfig)}


@dataclass(frozen=True)
class ResolvedSizes:
    """What `ShadowKVConfig.resolve` decided for one row: chunks, rank, selected chunks, outliers, local tokens.

    `rank` is the rank of the key factors, or, when `max_logit_error` is set (`rank="auto"`), the largest rank
    allowed: the factorisation then keeps the smallest rank in `[min_rank, rank]` whose keys keep the attention
    logits of the prompt's last queries within that relative error and within `max_logit_shift` nats where
    attention looks.
    """

    num_chunks: int
    rank: int
    budget_chunks: int
    outliers: int
    local: int
    min_rank: int = 0
    max_logit_error: float | None = None
    max_logit_shift: float | None = None
