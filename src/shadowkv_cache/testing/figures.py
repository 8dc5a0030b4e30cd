"""What a cache's compressed layers select and move, summed over layers: the figures a benchmark turns into
host-to-device bytes per step, without reading the prompt's or the store's layout.

Legend: B batch, Hkv KV heads, C chunks (YAKV: N quantised tokens), K selected units per KV head, R rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..hf.cache import ShadowKVCache

__all__ = ["SelectionFigures", "selection_figures"]


@dataclass(frozen=True)
class SelectionFigures:
    """Sums over the compressed layers of one cache.

    Attributes:
        mode (`str`): `"shadowkv"` or `"yakv"`.
        compressed_layers (`int`): layers that hold a compressed prompt.
        rank (`int` or `None`): R of the first compressed layer's factors (ShadowKV; rows are padded to one rank).
        unit_tokens (`int`): tokens per selected unit: the chunk size, or 1 (YAKV).
        selected_units (`int`): units selected per KV head and row at each step (K, the largest over rows), summed
            over layers.
        prompt_units (`int`): units of one stored row over all KV heads (Hkv x C), summed over layers: what a step
            that reads the whole prompt moves per row.
        record_bytes (`int` or `None`): YAKV: bytes of one (head, token) key and value record.
        fetched_bytes (`int` or `None`): YAKV: record bytes fetched so far.
        hits, lookups (`int`): selected units found on the device from the previous step (ShadowKV's temporal
            cache, YAKV's held tokens), and units selected, so far.
    """

    mode: str
    compressed_layers: int
    rank: int | None
    unit_tokens: int
    selected_units: int
    prompt_units: int
    record_bytes: int | None
    fetched_bytes: int | None
    hits: int
    lookups: int


def selection_figures(cache: ShadowKVCache) -> SelectionFigures:
    """The figures of `cache` now (after its prefill, and the decode steps run so far)."""
    layers = [layer for layer in cache.layers if layer.is_compressed]
    yakv = cache.config.mode == "yakv"
    hits = lookups = 0
    for layer in layers:
        counts = layer.hit_counts()
        if counts is not None:
            hits, lookups = hits + counts[0], lookups + counts[1]
    if yakv:
        prompts = [layer.prompt for layer in layers]
        return SelectionFigures(
            mode="yakv",
            compressed_layers=len(layers),
            rank=None,
            unit_tokens=1,
            selected_units=sum(p.max_budget_tokens for p in prompts),
            prompt_units=sum(p.store.data.shape[1:3].numel() for p in prompts),
            record_bytes=prompts[0].store.record_bytes if prompts else None,
            fetched_bytes=sum(layer.mode.fetched_bytes for layer in layers),
            hits=hits,
            lookups=lookups,
        )
    prompts = [layer.prompt for layer in layers]
    return SelectionFigures(
        mode="shadowkv",
        compressed_layers=len(layers),
        rank=int(prompts[0].a.shape[-1]) if prompts else None,
        unit_tokens=cache.config.chunk_size,
        selected_units=sum(int(p.max_budget_chunks) for p in prompts),
        prompt_units=sum(p.values.data[0].shape[:2].numel() for p in prompts),
        record_bytes=None,
        fetched_bytes=None,
        hits=hits,
        lookups=lookups,
    )
