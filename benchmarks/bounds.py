"""What bytes alone allow a decode step: the full-attention roofline and the ShadowKV and YAKV bounds.

The bounds count what a step must move, not what the code moves: since attention reads the attended parts in place
(no concatenated copy), the attended set counts once. Results recorded before that change (commit `2e414c1`) hold
bounds that counted it three times (written by the copy, read back, read by attention).

Legend: B batch, S context tokens, L layers, Hkv KV heads, D head dim, c chunk size, K selected chunks (YAKV:
tokens) per KV head, h hit rate, E YAKV record bytes.

A step reads the weights and each row's attended state from HBM, and (offloaded modes) fetches what it misses over
PCIe; its time is at least HBM bytes / HBM bandwidth + PCIe bytes / PCIe bandwidth. Figures assume bf16 K/V.
"""

from __future__ import annotations

import torch

from shadowkv_cache.testing import layer_sizes

PCIE_ZERO_COPY = 50e9  # bytes/s of the zero-copy gather of 2 KiB chunks measured on the H200 (47-51 GB/s)


def kv_bytes_per_token(cfg) -> int:
    """Bytes of one token's K and V over all layers (bf16)."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2


def full_attention_step(weights: int, batch: int, length: int, cfg, hbm_bw: float) -> float:
    """Seconds per step of full attention at the HBM roofline: weights + B x the full K/V of S tokens."""
    return (weights + batch * length * kv_bytes_per_token(cfg)) / hbm_bw


def shadowkv_bound(
    model, config, length, batch, h, weights, hbm_bw, landmark_format: str = "native"
) -> tuple[float, float, float]:
    """`(seconds, HBM bytes, PCIe bytes)` per step: HBM (weights, landmarks, attended set) + PCIe (missed values).
    Landmarks are bf16, or with `landmark_format="int8"` one byte per value and an fp32 scale per landmark."""
    cfg = model.config
    sizes = layer_sizes(model, config, length, dtype=torch.bfloat16)
    size = sizes.resolved
    per_head = cfg.num_key_value_heads * cfg.head_dim * 2
    landmark = per_head if landmark_format == "native" else cfg.num_key_value_heads * (cfg.head_dim + 4)
    attended = (size.outliers + size.budget_chunks) * config.chunk_size + size.local + 64
    missed = size.budget_chunks * config.chunk_size * (1 - h)  # tokens whose keys are rebuilt and values fetched
    # Landmarks read once, the attended keys and values read once (attention reads the parts in place,
    # ops/attend_parts.py), and the misses' rebuilt keys and fetched values written into their slots.
    per_layer = size.num_chunks * landmark + 2 * (attended + missed) * per_head
    hbm = weights + batch * cfg.num_hidden_layers * per_layer
    pcie = (
        batch
        * cfg.num_hidden_layers
        * cfg.num_key_value_heads
        * size.budget_chunks
        * (1 - h)
        * (config.chunk_size * per_head / cfg.num_key_value_heads)
    )
    pcie *= sizes.value_bits / 16
    return hbm / hbm_bw + pcie / PCIE_ZERO_COPY, hbm, pcie


def yakv_bound(model, config, length, batch, h, weights, hbm_bw) -> tuple[float, float, float]:
    """`(seconds, HBM bytes, PCIe bytes)` per step in YAKV mode: HBM (weights, scoring codes and norms, attended set)
    + PCIe (the records of the selected tokens not held from the previous step, a share `1 - h`). Of those records,
    the share the device mirror holds (`device_record_share`, selected tokens spread evenly over the prompt) is read
    from HBM instead. With every token mirrored the step reads the selected records in place (`ops/attend_records.py`):
    nothing fetched or held, the attended set is the records and the exact recent tokens."""
    cfg = model.config
    sizes = layer_sizes(model, config, length)
    size = sizes.resolved
    hkv, d = cfg.num_key_value_heads, cfg.head_dim
    near = sizes.mirrored_tokens / max(size.num_chunks, 1)
    scoring = size.num_chunks * hkv * (d // config.score_grid_dim + 2)
    attended = (size.budget_chunks + size.local + 64) * hkv * d * 2 * 2  # K and V, bf16
    missed = size.budget_chunks * (1 - h) * hkv * d * 2 * 2  # the records not held, dequantised into their slots
    records = batch * cfg.num_hidden_layers * hkv * size.budget_chunks * (1 - h) * sizes.record_bytes
    if sizes.mirrored_tokens >= size.num_chunks > 0:
        exact = (size.local + 64) * hkv * d * 2 * 2
        in_place = size.budget_chunks * hkv * sizes.record_bytes
        hbm = weights + batch * cfg.num_hidden_layers * (scoring + exact + in_place)
        return hbm / hbm_bw, hbm, 0.0
    # attention reads the parts once
    hbm = weights + batch * cfg.num_hidden_layers * (scoring + attended + missed) + near * records
    pcie = (1 - near) * records
    return hbm / hbm_bw + pcie / PCIE_ZERO_COPY, hbm, pcie
