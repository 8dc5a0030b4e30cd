"""Synthetic compressed caches: a `ShadowKVCache` holding random compressed prompts of a given length, built
without a prefill, for speed benchmarks and tests (speed does not depend on what the tensors hold).

Legend: B batch rows, R stored host rows (B, or 1 when rows share one), S context tokens, L layers, Hkv KV heads,
D head dim, c chunk size, C chunks, Tc = C*c compressed tokens, O outlier chunks, W local-window tokens, K selected
chunks (YAKV: tokens) per KV head, E YAKV record bytes.

A prefill of 128K tokens at batch 64 does not fit a GPU, but a decode step over such a batch does: these builders
give every compressed layer a prompt of the sizes `ShadowKVConfig.resolve` gives the context (same shapes, dtypes
and devices as a real prefill, so a decode step does the same work and the memory report the same sums), with
random content. Host memory comes from flat pinned blocks the caller pinned once (`host_blocks`), else from the
package's pinned pool (on CUDA with `pin_memory`), else from plain CPU tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import ResolvedSizes, ShadowKVConfig
from ..hf.cache import ShadowKVCache
from ..hf.layer import CompressedLayer
from ..model_keys import key_dims
from ..placement import attention_devices
from ..policies import LandmarkTopK, QuantizedKeyTopK, SelectionPolicy
from ..shadowkv.prompt import CompressedPrompt
from ..stores.pinned_pool import pinned_pool, use_huge_pages
from ..stores.quantized_store import QuantizedKVStore, mirrored_tokens, record_bytes
from ..stores.value_codecs import value_codec
from ..stores.value_store import HostValueStore
from ..yakv.prompt import QuantizedPrompt
from .hit_rate import ControlledHitRate

__all__ = ["LayerSizes", "layer_sizes", "pinned_blocks", "pinned_bytes", "release_pinned", "synthetic_cache"]

_SCALES_ALIGN = 256  # bytes between a block's payload and its scales (ShadowKV's quantised value formats)


@dataclass(frozen=True)
class LayerSizes:
    """What one compressed layer holds per row at a context length, in the config's mode.

    Attributes:
        mode (`str`): `"shadowkv"` or `"yakv"`.
        num_kv_heads, head_dim (`int`): Hkv and D.
        resolved (`ResolvedSizes`): `config.resolve(S, Hkv*D)` (YAKV: a chunk is one token).
        host_bytes_per_row (`int`): host bytes of one stored row: values in `value_format`, scales included
            (ShadowKV), or key and value records (YAKV).
        value_bits (`float` or `None`): ShadowKV: host bits per stored value, scales included.
        record_bytes (`int` or `None`): YAKV: E, bytes of one (head, token) record.
        mirrored_tokens (`int`): YAKV: tokens per head whose records a GPU mirror also holds (`device_record_share`
            of `resolved.num_chunks`).
    """

    mode: str
    num_kv_heads: int
    head_dim: int
    resolved: ResolvedSizes
    host_bytes_per_row: int
    value_bits: float | None
    record_bytes: int | None
    mirrored_tokens: int = 0


def layer_sizes(model, config: ShadowKVConfig, context: int, dtype: torch.dtype | None = None) -> LayerSizes:
    """Sizes of one compressed layer of `model` per row at `context` tokens (`dtype`: the KV dtype that the native
    value format stores, the model's by default)."""
    heads, dim = _kv_dims(model)
    resolved = config.resolve(context, heads * dim)
    if config.mode == "yakv":
        record = record_bytes(dim // config.host_grid_dim)
        host = resolved.num_chunks * heads * record
        mirrored = mirrored_tokens(config.device_record_share, resolved.num_chunks)
        return LayerSizes("yakv", heads, dim, resolved, host, None, record, mirrored)
    bits = value_codec(config.value_format, dim).bits_per_value(dtype or model.dtype)
    host = math.ceil(resolved.num_chunks * config.chunk_size * heads * dim * bits / 8)
    return LayerSizes("shadowkv", heads, dim, resolved, host, bits, None)


def synthetic_cache(
    model,
    batch: int,
    context: int,
    config: ShadowKVConfig | None = None,
    policy: SelectionPolicy | None = None,
    *,
    hit_rate: float | None = None,
    host_blocks: Sequence[torch.Tensor] | None = None,
    share_stored_row: bool = False,
    **overrides,
) -> ShadowKVCache:
    """A `ShadowKVCache` for `model` whose every layer holds a random compressed prompt of `context` tokens per row.

    ShadowKV mode (any `value_format`): per layer, factors `A` `[B, Tc, R]` and `B` `[B, R, Hkv, D]` (scaled so that
    rebuilt keys have unit variance), landmarks `[B, Hkv, C, D]` in the policy's format, positions `[B, Tc]`, the
    first O chunks of each head as outliers `[B, Hkv, O*c, D]`, a local window `[B, Hkv, W, D]` and host values
    `[R, Hkv, C, c, D]` encoded in the value format. YAKV mode: ~2-bit scoring codes `[B, Hkv, N, D/p]` with norms
    `sqrt(D)` on the device, a recent window `[B, Hkv, W, D]`, and host records `[R, Hkv, N, E]` of random codes
    with norms `sqrt(D)` (well-formed vectors once dequantised). Every token is real; the budget is the resolved
    one. Host rows differ from each other (one random row, rolled along the chunks), so a row that reads another's
    values is caught. With `rank="auto"` the factors take the largest rank the config allows (`resolved.rank`), the
    rank a real prefill picks for random keys, whose energy is spread evenly; pass `rank=` for another.

    The cache reports `S` tokens to `generate` (pass `S + 1` input ids: `generate` feeds the last one), and its
    `memory_report()` counts exactly these tensors (`layer_sizes(...).host_bytes_per_row` per stored row).

    Args:
        model: a supported causal LM without sliding-window layers; its dtype is used, and each layer is filled on
            the device its attention runs on (design.md §11).
        batch (`int`): B, the cache rows.
        context (`int`): S, prompt tokens per row (at least `min_compress_len`).
        config, policy, **overrides: as for `ShadowKVCache(model, ...)`. ShadowKV mode needs a `LandmarkTopK`
            (or subclass) policy, whose state is the landmarks; YAKV mode a `QuantizedKeyTopK`.
        hit_rate (`float`, *optional*): select through `ControlledHitRate(hit_rate, policy)` (`policy` defaults to
            the mode's own), so that each step keeps this share of the previous step's chunks (YAKV: tokens).
        host_blocks (sequence of `torch.Tensor`, *optional*): one flat uint8 CPU tensor per layer (pinned for zero-copy
            fetches) that the layer's host store is carved from (payload first, scales 256-byte aligned after it);
            the default draws from the pinned pool on CUDA with `pin_memory`, else plain CPU memory.
        share_stored_row (`bool`): every cache row reads stored row 0 (R = 1), so a large batch needs little host
            memory; each row still selects and fetches its own units.

    >>> cache = synthetic_cache(model, batch=32, context=131072, value_format="fp8", hit_rate=0.6)  # doctest: +SKIP
    >>> model(input_ids=token, past_key_values=cache)  # doctest: +SKIP
    """
    cache = ShadowKVCache(model, config, policy, **overrides)
    if hit_rate is not None:  # `policy`, or the mode's own (as the config sets it), wrapped
        cache = ShadowKVCache(model, cache.config, ControlledHitRate(hit_rate, cache.policy))
    config = cache.config
    layers = cache.layers
    if not all(isinstance(layer, CompressedLayer) for layer in layers):
        raise NotImplementedError("synthetic_cache builds models without sliding-window layers only.")
    sizes = layer_sizes(model, config, context)
    if sizes.resolved.num_chunks == 0:
        raise ValueError(f"context={context} is below min_compress_len={config.min_compress_len}: nothing to fill.")
    if host_blocks is not None and len(host_blocks) != len(layers):
        raise ValueError(f"host_blocks needs one block per layer ({len(layers)}); got {len(host_blocks)}.")
    filled = _state_policy(cache.policy)
    if config.mode == "yakv" and not isinstance(filled, QuantizedKeyTopK):
        raise TypeError(f"YAKV mode fills QuantizedKeyTopK's state; got {type(filled).__name__}.")
    if config.mode == "shadowkv" and not isinstance(filled, LandmarkTopK):
        raise TypeError(f"ShadowKV mode fills LandmarkTopK's state (landmarks); got {type(filled).__name__}.")
    dtype = next(model.parameters()).dtype
    devices = attention_devices(model)  # each layer on its own device in a model split by accelerate
    stored = 1 if share_stored_row else batch
    fill = _yakv_layer if config.mode == "yakv" else _shadowkv_layer
    for i, layer in enumerate(layers):
        device = devices[i]
        pin = device.type == "cuda" and config.pin_memory
        host = _HostMemory(host_blocks[i] if host_blocks is not None else None, pin)
        prompt = fill(cache, sizes, batch, stored, context, device, dtype, host)
        empty = torch.empty(batch, sizes.num_kv_heads, 0, sizes.head_dim, device=device, dtype=dtype)
        layer.set_prefix(prompt, empty, empty)
    return cache


def pinned_blocks(count: int, nbytes: int) -> list[torch.Tensor]:
    """`count` flat uint8 tensors of `nbytes` pinned host bytes each, from the package's pinned pool (CUDA only).

    Pass them as `synthetic_cache(..., host_blocks=...)` to pin once for many caches. A block returns to the pool
    when its tensor is collected, so dropping freshly allocated blocks also warms the pool for prefills of that size
    (a server pins once; pinning fresh memory is slow)."""
    return [pinned_pool().allocate((nbytes,), torch.uint8) for _ in range(count)]


def pinned_bytes() -> int:
    """Bytes the package's pinned pool holds pinned (in use or free)."""
    return pinned_pool().pinned_bytes


def pinned_huge_pages(enabled: bool) -> None:
    """Back the package's pinned pool's new blocks with 2 MiB pages (`enabled`, where the kernel's transparent huge
    pages allow) or with the allocator's pages (the default); blocks already pinned keep theirs."""
    use_huge_pages(enabled)


def release_pinned() -> int:
    """Unpin the pinned pool's free blocks; returns the bytes released."""
    return pinned_pool().release_cached()


def _kv_dims(model) -> tuple[int, int]:
    return key_dims(model.config.get_text_config())


class _HostMemory:
    """Hands out host tensors one after the other from a flat uint8 `block`, or from the pool / plain memory."""

    def __init__(self, block: torch.Tensor | None, pin: bool):
        self.block, self.pin, self.offset = block, pin, 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, align: int = 1) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if self.block is None:
            return pinned_pool().allocate(shape, dtype) if self.pin else torch.empty(shape, dtype=dtype)
        start = -(-self.offset // align) * align
        if start + nbytes > self.block.numel():
            raise ValueError(
                f"host block of {self.block.numel()} bytes is too small: needs {start + nbytes} bytes for this layer."
            )
        self.offset = start + nbytes
        return self.block[start : start + nbytes].view(dtype).view(shape)


def _random_landmarks(policy: LandmarkTopK, batch: int, hkv: int, n: int, d: int, device, dtype) -> dict:
    """`policy`'s state of random landmarks `[B, Hkv, C, D]`, made a row at a time: quantising a whole batch at once
    would leave fp32 temporaries of every row in the peak memory the benchmarks record."""

    def row() -> dict[str, torch.Tensor]:
        return policy.state_of(torch.randn(1, hkv, n, d, device=device, dtype=dtype), dtype)

    first = row()
    state = {name: t.new_empty((batch, *t.shape[1:])) for name, t in first.items()}
    for r in range(batch):
        for name, t in (first if r == 0 else row()).items():
            state[name][r : r + 1] = t
    return state


def _state_policy(policy: SelectionPolicy) -> SelectionPolicy:
    """The policy whose state a layer holds: a `ControlledHitRate`'s inner one."""
    return policy.inner if isinstance(policy, ControlledHitRate) else policy


def _rows_map(batch: int, stored: int) -> torch.Tensor:
    return torch.zeros(batch, dtype=torch.int64) if stored < batch else torch.arange(batch)


def _shadowkv_layer(cache, sizes: LayerSizes, batch, stored, context, device, dtype, host: _HostMemory):
    config, size = cache.config, sizes.resolved
    hkv, d, c = sizes.num_kv_heads, sizes.head_dim, config.chunk_size
    n, o, w, k, rank = size.num_chunks, size.outliers, size.local, size.budget_chunks, size.rank
    codec = value_codec(config.value_format, d)
    payload = host.take((stored, hkv, n, c, codec.payload_dim), codec.payload_dtype or dtype)
    scales = None if codec.scale_dtype is None else host.take((stored, hkv, n, c), codec.scale_dtype, _SCALES_ALIGN)
    codes, row_scales = codec.encode(torch.randn(1, hkv, n, c, d, device=device, dtype=dtype))
    for r in range(stored):  # one encoded row, rolled along the chunks: rows differ, encoding runs once
        payload[r].copy_(codes[0].roll(r, dims=1))
        if scales is not None:
            scales[r].copy_(row_scales[0].roll(r, dims=1))
    store = HostValueStore(payload, _rows_map(batch, stored), scales, codec)
    store.device_row_map(device)  # copied now, not in a timed step
    codec.prepare(device)
    selectable = torch.ones(batch, hkv, n, dtype=torch.bool, device=device)
    selectable[..., :o] = False
    return CompressedPrompt(
        a=torch.randn(batch, n * c, rank, device=device, dtype=dtype),
        b=torch.randn(batch, rank, hkv, d, device=device, dtype=dtype) / rank**0.5,
        positions=torch.arange(n * c, device=device).expand(batch, -1).contiguous(),
        policy_state=_random_landmarks(_state_policy(cache.policy), batch, hkv, n, d, device, dtype),
        selectable=selectable,
        budget_chunks=torch.full((batch,), k, dtype=torch.int64, device=device),
        outlier_keys=torch.randn(batch, hkv, o * c, d, device=device, dtype=dtype),
        outlier_values=torch.randn(batch, hkv, o * c, d, device=device, dtype=dtype),
        outlier_valid=torch.ones(batch, o * c, dtype=torch.bool, device=device),
        local_keys=torch.randn(batch, hkv, w, d, device=device, dtype=dtype),
        local_values=torch.randn(batch, hkv, w, d, device=device, dtype=dtype),
        local_valid=torch.ones(batch, w, dtype=torch.bool, device=device),
        values=store,
        chunk_size=c,
        slots=context,
        max_budget_chunks=k,
    )


def _yakv_layer(cache, sizes: LayerSizes, batch, stored, context, device, dtype, host: _HostMemory):
    size, hkv, d, e = sizes.resolved, sizes.num_kv_heads, sizes.head_dim, sizes.record_bytes
    n, k, w = size.num_chunks, size.budget_chunks, size.local
    m = d // _state_policy(cache.policy).grid_dim
    norm = torch.tensor([d**0.5], dtype=torch.float16).view(torch.uint8)  # its two bytes
    one_row = torch.randint(0, 256, (hkv, n, e), dtype=torch.uint8)
    one_row[..., 0:2], one_row[..., 2:4] = norm, norm  # key and value norms: a finite fp16, not random bits
    data = host.take((stored, hkv, n, e), torch.uint8)
    for r in range(stored):
        data[r].copy_(one_row.roll(r, dims=1))
    store = QuantizedKVStore(data, _rows_map(batch, stored)).with_mirror(cache.config.device_record_share, device)
    store.device_row_map(device)  # copied now, not in a timed step
    return QuantizedPrompt(
        policy_state={
            "codes": torch.randint(0, 256, (batch, hkv, n, m), dtype=torch.uint8, device=device),
            "norms": torch.full((batch, hkv, n), d**0.5, dtype=torch.float16, device=device),
        },
        real=torch.ones(batch, n, dtype=torch.bool, device=device),
        budget_tokens=torch.full((batch,), k, dtype=torch.int64, device=device),
        local_keys=torch.randn(batch, hkv, w, d, device=device, dtype=dtype),
        local_values=torch.randn(batch, hkv, w, d, device=device, dtype=dtype),
        local_valid=torch.ones(batch, w, dtype=torch.bool, device=device),
        store=store,
        slots=context,
        max_budget_tokens=k,
    )
