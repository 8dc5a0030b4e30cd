"""What a ShadowKV cache holds, per layer, per device and in total, against what `DynamicCache` would hold."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DeviceMemory", "LayerMemory", "MemoryReport"]


@dataclass(frozen=True)
class LayerMemory:
    """One layer: how it holds its tokens and what that costs.

    `mode` is `"shadowkv"` or `"yakv"` for a compressed layer, `"exact"` for a full-attention layer that holds its
    tokens exactly (a prompt shorter than `min_compress_len`, or nothing yet), `"sliding"` for a sliding-window layer.
    `rank` is the rank of the key factors (ShadowKV; with `rank="auto"` the largest rank any row chose) and
    `budget_tokens` the tokens selected per KV head and step (the largest over rows); None where they do not apply.
    `device` is where the layer's keys and values are (e.g. `"cuda:1"` in a model split over GPUs), None while it
    holds nothing.
    """

    layer: int
    mode: str
    gpu_bytes: int  # on the layer's device (the accelerator when there is one)
    host_bytes: int
    dynamic_cache_bytes: int  # full K/V of the same tokens
    rank: int | None = None
    budget_tokens: int | None = None
    device: str | None = None

    @property
    def compressed(self) -> bool:
        return self.mode in ("shadowkv", "yakv")


@dataclass(frozen=True)
class DeviceMemory:
    """The layers on one device and what they hold: `gpu_bytes` on that device, `host_bytes` in host memory for them
    (pinned, when the device is a GPU), `dynamic_cache_bytes` what `DynamicCache` would hold on that device."""

    device: str
    layers: tuple[int, ...]
    gpu_bytes: int
    host_bytes: int
    dynamic_cache_bytes: int


@dataclass(frozen=True)
class MemoryReport:
    """Totals and per-layer figures. `ratio` = device bytes / `DynamicCache` bytes (lower is better)."""

    layers: tuple[LayerMemory, ...]
    # Share of selected chunks (YAKV: tokens) already on the device from the previous step; None before any sparse
    # step.
    hit_rate: float | None

    @classmethod
    def of_layers(cls, layers) -> MemoryReport:
        """The report of a cache's layers (each with `kind()`, `nbytes()`, `hit_counts()` and its keys' device)."""
        per_layer, hits, lookups = [], 0, 0
        for i, layer in enumerate(layers):
            mode, rank, budget = layer.kind()
            where = str(layer.keys.device) if layer.is_initialized else None
            per_layer.append(LayerMemory(i, mode, *layer.nbytes(), rank, budget, where))
            counts = layer.hit_counts()
            if counts is not None:
                hits, lookups = hits + counts[0], lookups + counts[1]
        return cls(tuple(per_layer), hits / lookups if lookups else None)

    @property
    def gpu_bytes(self) -> int:
        return sum(m.gpu_bytes for m in self.layers)

    @property
    def host_bytes(self) -> int:
        return sum(m.host_bytes for m in self.layers)

    @property
    def dynamic_cache_bytes(self) -> int:
        return sum(m.dynamic_cache_bytes for m in self.layers)

    @property
    def ratio(self) -> float:
        return self.gpu_bytes / self.dynamic_cache_bytes if self.dynamic_cache_bytes else 1.0

    @property
    def per_device(self) -> dict[str, DeviceMemory]:
        """`{device: DeviceMemory}` over the layers that hold something, in the order of their first layer (a model
        split over GPUs by accelerate, design.md §11; one entry otherwise)."""
        groups: dict[str, list[LayerMemory]] = {}
        for m in self.layers:
            if m.device is not None:
                groups.setdefault(m.device, []).append(m)
        return {
            device: DeviceMemory(
                device,
                tuple(m.layer for m in group),
                sum(m.gpu_bytes for m in group),
                sum(m.host_bytes for m in group),
                sum(m.dynamic_cache_bytes for m in group),
            )
            for device, group in groups.items()
        }

    def __str__(self) -> str:
        mib = 2**20
        lines = [
            f"{'layer':>5} {'mode':>9} {'rank':>5} {'budget':>7} {'device MiB':>11} {'host MiB':>9} "
            f"{'DynamicCache MiB':>17}"
        ]
        for m in self.layers:
            rank = "" if m.rank is None else m.rank
            budget = "" if m.budget_tokens is None else m.budget_tokens
            lines.append(
                f"{m.layer:>5} {m.mode:>9} {rank:>5} {budget:>7} {m.gpu_bytes / mib:>11.2f} {m.host_bytes / mib:>9.2f} "
                f"{m.dynamic_cache_bytes / mib:>17.2f}"
            )
        hit = "n/a" if self.hit_rate is None else f"{self.hit_rate:.1%}"
        lines.append(
            f"{'total':>5} {'':>9} {'':>5} {'':>7} {self.gpu_bytes / mib:>11.2f} {self.host_bytes / mib:>9.2f} "
            f"{self.dynamic_cache_bytes / mib:>17.2f}"
        )
        devices = self.per_device
        if len(devices) > 1:  # one line per device of a split model
            for d in devices.values():
                name = f"{d.device} ({len(d.layers)} layers)"
                lines.append(
                    f"{name:>29} {d.gpu_bytes / mib:>11.2f} {d.host_bytes / mib:>9.2f} "
                    f"{d.dynamic_cache_bytes / mib:>17.2f}"
                )
        lines.append(f"device bytes / DynamicCache bytes = {self.ratio:.3f}; temporal-cache hit rate = {hit}")
        return "\n".join(lines)
