"""Hot-path operations. Each has a PyTorch twin that defines its meaning (the CPU path), and each kernel path is a
`torch.ops.shadowkv` operator (`library.py`), registered when its module is imported (importing this package imports
them all).

`KERNELS` names, for every CUDA source `kernels/<stem>.cu`, the op module that launches it and the twin that
defines what it computes (design.md §10); a test holds it equal to the sources. Module paths are strings, so
reading the registry imports nothing.
"""

from . import (  # noqa: F401 - registers each module's operator
    attend_parts,
    attend_records,
    gather_dequant,
    gather_values,
    landmark_logits,
    landmark_scores,
    quantize_higgs,
    score_codes,
    select_topk,
    temporal_scan,
)
from .library import registered_ops
from .rebuild_keys import rebuild_keys

__all__ = ["KERNELS", "OPERATORS", "rebuild_keys", "registered_ops"]

# kernel stem -> (op module that launches it, name of its PyTorch twin in that module)
KERNELS: dict[str, tuple[str, str]] = {
    # One-token attention over the attended parts in place; the twin concatenates them (core/attention.py).
    "attend_parts": ("shadowkv_cache.ops.attend_parts", "attend_parts_reference"),
    # YAKV's selected tokens attended in place from the device mirror of their records (no fetch, nothing held); the
    # twin dequantises them, then attends over them and the other parts.
    "attend_records": ("shadowkv_cache.ops.attend_records", "attend_records_reference"),
    "gather_dequant": ("shadowkv_cache.ops.gather_dequant", "gather_dequant_reference"),
    "gather_values": ("shadowkv_cache.ops.gather_values", "gather_values_reference"),
    # ShadowKV's landmark logits on tensor cores from int8 landmarks (the twin dequantises and multiplies in fp32) and
    # from 16-bit ones (their twin, `landmark_logits_native_reference`, is the same product without codes).
    "landmark_logits": ("shadowkv_cache.ops.landmark_logits", "landmark_logits_int8_reference"),
    # ShadowKV's chunk scores from the landmark GEMM's output as it lies: softmax, group max, mask.
    "landmark_scores": ("shadowkv_cache.ops.landmark_scores", "landmark_scores_reference"),
    "quantize_higgs": ("shadowkv_cache.ops.quantize_higgs", "quantize_vectors_reference"),
    # RoPE of the missed slots after a batched GEMM of every slot (keys `rebuild_missed` does not take);
    # `rebuild_keys` defines the rebuilt keys.
    "rebuild_keys": ("shadowkv_cache.ops.rebuild_keys", "rebuild_keys"),
    # The missed slots' keys in one kernel: rows of A gathered, A·B on tensor cores, RoPE.
    "rebuild_missed": ("shadowkv_cache.ops.rebuild_missed", "rebuild_missed_reference"),
    # `code_scores` on tensor cores (one pass over the codes, then the scores from its fp16 exponentials), or the fp32
    # kernel's logits and per-tile states, whose second pass is `softmax_group_max`; either way the twin's scores.
    "score_codes": ("shadowkv_cache.ops.score_codes", "code_scores_reference"),
    # Second pass of `code_scores`: softmax over the selectable units, max over each GQA group.
    "softmax_group_max": ("shadowkv_cache.ops.score_codes", "attention_scores"),
    # The k best scores of each (row, head), best first: a radix select per row, then each candidate's rank.
    "select_topk": ("shadowkv_cache.ops.select_topk", "select_topk_reference"),
    # Rows too long for one block's registers (YAKV's tokens): a top-bits histogram across blocks, a filter of the
    # k-th key's bin and those above it, then a block per row that selects within the bin and sorts.
    "select_topk_split": ("shadowkv_cache.ops.select_topk", "select_topk_reference"),
    "temporal_scan": ("shadowkv_cache.ops.temporal_scan", "temporal_scan_reference"),
}

# operator (torch.ops.shadowkv.<name>) -> kernel stems its CUDA implementation launches
OPERATORS: dict[str, tuple[str, ...]] = {
    "attend_parts": ("attend_parts",),
    "attend_records": ("attend_records", "attend_parts"),
    "code_scores": ("score_codes", "softmax_group_max"),
    "gather_dequant": ("gather_dequant",),
    "gather_values": ("gather_values",),
    "landmark_logits_int8": ("landmark_logits",),
    "landmark_logits_native": ("landmark_logits",),
    "landmark_scores": ("landmark_scores",),
    "quantize_higgs": ("quantize_higgs",),
    "rebuild_missed": ("rebuild_missed",),
    "rope_missed": ("rebuild_keys",),
    "select_topk": ("select_topk", "select_topk_split"),
    "temporal_scan": ("temporal_scan",),
}
