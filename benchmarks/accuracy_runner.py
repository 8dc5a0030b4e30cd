"""Running the accuracy benchmark's settings on a model: which cache a (method, rank, chunk, budget) setting gets,
which settings share a prefill, and what a run cost in selection recall and host-to-device bytes.

Legend: B batch, Hkv KV heads, D head dim, c chunk size, L layers.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from benchmarks.accuracy_core import prefill
from benchmarks.accuracy_plans import Config
from benchmarks.methods import EVICTING, METHODS, MODE_CHANGES, PolicyBundle, fork_cache
from benchmarks.selection_probe import SelectionProbe
from shadowkv_cache import ShadowKVCache
from shadowkv_cache.hf.architectures import sliding_windows
from shadowkv_cache.testing import selection_figures

__all__ = ["MODELS", "Runner", "load_model", "summarise_stats"]


def load_model(name: str, dtype: torch.dtype, device: str):
    """`(model, tokenizer)` of an embedded model: SmolLM2-135M-Instruct or Gemma 3 270M (extra `gemma`)."""
    from shadowkv_cache import embedded_models

    if name == "smollm2":
        return embedded_models.load_smollm2(dtype=dtype, device=device)
    if name == "gemma3":
        return embedded_models.load_gemma3_270m(dtype=dtype, device=device)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


MODELS = ["smollm2", "gemma3"]


class Runner:
    def __init__(self, model, tokenizer, device: str, chunk_overrides: dict | None = None, count_kept: bool = False):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.chunk_overrides, self.count_kept = chunk_overrides or {}, count_kept
        text = model.config.get_text_config()
        # The layers ShadowKV compresses (Gemma 3: the full-attention ones; its sliding layers stay exact).
        self.num_layers = sum(window is None for window in sliding_windows(text))
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.num_kv_heads = text.num_key_value_heads
        self.key_dim = self.num_kv_heads * self.head_dim
        self.elem = torch.finfo(model.dtype).bits // 8

    def overrides(self, cfg: Config, length: int) -> dict:
        # Eager decode steps: the selection probe records every step in Python, which a replayed CUDA graph would
        # skip (capture also fails on the probe's host reads, and the cache then falls back to eager with a warning).
        start = {"min_compress_len": min(1024, length // 2), "cuda_graphs": False}
        if cfg.method in MODE_CHANGES:  # no rank or chunks: keys and values are quantised, tokens selected
            return {**start, **MODE_CHANGES[cfg.method]}
        rank = self.key_dim if cfg.rank == "full" else cfg.rank
        return {"rank": rank, "chunk_size": cfg.chunk, **start, **self.chunk_overrides}

    def groups(self, configs: list[Config]) -> dict[tuple, list[Config]]:
        """Configs that can share one prefill: same rank and chunk size, or the same storage mode."""
        out: dict[tuple, list[Config]] = defaultdict(list)
        for cfg in configs:
            key = (
                tuple(sorted(MODE_CHANGES[cfg.method].items())) if cfg.method in MODE_CHANGES else (cfg.rank, cfg.chunk)
            )
            out[key].append(cfg)
        return out

    def base_cache(self, group: list[Config], length: int, ids, mask) -> ShadowKVCache:
        bundle = PolicyBundle({m: METHODS[m]() for m in dict.fromkeys(c.method for c in group)})
        base = ShadowKVCache(self.model, policy=bundle, **self.overrides(group[0], length))
        prefill(self.model, ids, mask, base)
        return base

    def fork(self, base: ShadowKVCache, cfg: Config) -> tuple[ShadowKVCache, SelectionProbe]:
        probe = SelectionProbe(METHODS[cfg.method](), self.num_layers, self.count_kept)
        dense = cfg.method not in EVICTING
        cache = fork_cache(base, self.model, cfg.method, probe, cfg.budget, dense_multi_token_steps=dense)
        return cache, probe

    def stats(self, cache: ShadowKVCache, probe: SelectionProbe, rows: int, cfg: Config, multi_token_steps=0) -> dict:
        """Selection recall and the host-to-device value bytes per decode step and sequence.

        Single-token steps move the temporal cache's missed chunks; a multi-token step (a later chat turn) with
        `dense_multi_token_steps` moves every chunk of the prompt. YAKV counts the quantised key and value
        records it read (the selected tokens it did not hold from the previous step, the whole prompt on
        multi-token steps); its nominal bytes are those of every selected token, what a step without reuse reads.
        """
        figures = selection_figures(cache)
        recall, oracle, units = probe.totals()
        dense_steps = multi_token_steps if cache.config.dense_multi_token_steps else 0
        steps_rows = (probe.steps + dense_steps) * rows
        if figures.mode == "yakv":
            return {
                "nominal_bytes": figures.selected_units * self.num_kv_heads * (figures.record_bytes or 0),
                "value_bytes_bf16": figures.fetched_bytes,
                "rank": self.key_dim,  # keys are quantised, not low-rank
                "recall_mass": recall,
                "oracle_mass": oracle,
                "units": units,
                "value_bytes": figures.fetched_bytes,
                "steps_rows": steps_rows,
                "hits": figures.hits,
                "lookups": figures.lookups,
            }
        chunk_bytes = cfg.chunk * self.head_dim * self.elem
        value_bytes = (figures.lookups - figures.hits) * chunk_bytes
        value_bytes += dense_steps * rows * figures.prompt_units * chunk_bytes
        return {
            "nominal_bytes": figures.selected_units * cfg.chunk * self.head_dim * 2 * self.num_kv_heads,  # bf16
            "value_bytes_bf16": value_bytes * 2 // self.elem,
            "rank": mean_rank(cache),
            "recall_mass": recall,
            "oracle_mass": oracle,
            "units": units,
            "value_bytes": value_bytes,
            "steps_rows": steps_rows,
            "hits": figures.hits,
            "lookups": figures.lookups,
        }


def mean_rank(cache: ShadowKVCache) -> float:
    """The mean rank of the key factors over the compressed layers (`rank="auto"` picks one per layer)."""
    ranks = [layer.rank for layer in cache.memory_report().layers if layer.rank is not None]
    return round(sum(ranks) / len(ranks), 1) if ranks else 0.0


def summarise_stats(a: dict) -> dict:
    return {
        "recall": a["recall_mass"] / a["units"] if a["units"] else float("nan"),
        "oracle_recall": a["oracle_mass"] / a["units"] if a["units"] else float("nan"),
        "h2d_kib_per_step": a["value_bytes"] / a["steps_rows"] / 1024 if a["steps_rows"] else 0.0,
        "h2d_bf16_kib": round(a["nominal_bytes"] / 1024),
        "h2d_bf16_measured_kib": a["value_bytes_bf16"] / a["steps_rows"] / 1024 if a["steps_rows"] else 0.0,
        "hit_rate": a["hits"] / a["lookups"] if a["lookups"] else float("nan"),
    }
