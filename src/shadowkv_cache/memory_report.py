"""What a ShadowKV cache holds, per layer and in total, against what `DynamicCache` would hold."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerMemory", "MemoryReport"]


@dataclass(frozen=True)
class LayerMemory:
    layer: int
    compressed: bool
    gpu_bytes: int  # on the model's device (the accelerator when there is one)
    host_bytes: int
    dynamic_cache_bytes: int  # full K/V of the same tokens


@dataclass(frozen=True)
class MemoryReport:
    """Totals and per-layer figures. `ratio` = device bytes / `DynamicCache` bytes (lower is better)."""

    layers: tuple[LayerMemory, ...]
    hit_rate: float | None  # share of selected chunks already on the device; None before any sparse step

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

    def __str__(self) -> str:
        mib = 2**20
        lines = [f"{'layer':>5} {'mode':>10} {'device MiB':>11} {'host MiB':>9} {'DynamicCache MiB':>17}"]
        for m in self.layers:
            mode = "shadowkv" if m.compressed else "exact"
            lines.append(
                f"{m.layer:>5} {mode:>10} {m.gpu_bytes / mib:>11.2f} {m.host_bytes / mib:>9.2f} "
                f"{m.dynamic_cache_bytes / mib:>17.2f}"
            )
        hit = "n/a" if self.hit_rate is None else f"{self.hit_rate:.1%}"
        lines.append(
            f"{'total':>5} {'':>10} {self.gpu_bytes / mib:>11.2f} {self.host_bytes / mib:>9.2f} "
            f"{self.dynamic_cache_bytes / mib:>17.2f}"
        )
        lines.append(f"device bytes / DynamicCache bytes = {self.ratio:.3f}; temporal-cache hit rate = {hit}")
        return "\n".join(lines)
