"""Prefix files: the format's name and version, and writing a document's compressed state to one.

Legend: S prefix tokens, L layers, Hkv KV heads, D head dim, c chunk size, C chunks, Tc = C*c compressed
tokens, R rank, O outlier chunks, W local-window tokens.

A prefix file (format version 2, see docs/prefix_format.md) holds, per layer, what a one-row `ShadowKVCache`
keeps of a document: the `CompressedPrompt` tensors (low-rank factors, positions, policy state such as the
landmarks, outliers, local window, host values), or the exact keys/values of a document shorter than
`min_compress_len`; plus the token ids. Its safetensors metadata holds one JSON object (key
`shadowkv_prefix`): format and version, the model's identity (a hash of its config and of the first layer's
`k_proj`/`v_proj` weights), the ShadowKV config, the selection policy, the prefix length, a hash of the token
ids and the KV dtype. The loader checks all of it, and every tensor's name, shape and dtype, before it builds
anything; writes are atomic; nothing is pickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ShadowKVConfig
from ..policies.base import SelectionPolicy
from ..stores.value_codecs import value_codec
from .errors import PrefixCacheError
from .identity import kv_dtype_and_devices, model_dims, model_identity, token_ids_sha256
from .layout import check_specs, expected_tensors, layer_tensors

__all__ = ["DECODE_TIME_FIELDS", "FORMAT_NAME", "FORMAT_VERSION", "METADATA_KEY", "write_prefix"]

FORMAT_NAME = "shadowkv-prefix"
FORMAT_VERSION = 2  # 2: per-layer ranks (rank='auto'); every config field present
METADATA_KEY = "shadowkv_prefix"
# Fields that only matter at decode time: a loaded prefix may change them. Every other field shaped the state.
DECODE_TIME_FIELDS = ("sparse_budget", "dense_multi_token_steps", "pin_memory", "cuda_graphs")


def write_prefix(path, model, config: ShadowKVConfig, policy: SelectionPolicy, token_ids: torch.Tensor, layers):
    """Save a one-row prefix (`layers`: `(prompt, keys, values)` per layer) to `path`, atomically."""
    path = Path(path)
    length = len(token_ids)
    dims = model_dims(model)
    dtype, _ = kv_dtype_and_devices(model, dims[0])
    for i, (prompt, keys, _) in enumerate(layers):
        held = keys.shape[2] + (prompt.slots if prompt is not None else 0) if keys is not None else 0
        if keys is None or keys.shape[0] != 1 or held != length:
            raise PrefixCacheError(
                f"save_prefix needs a one-row cache that holds exactly the {length}-token document; layer {i} "
                f"holds {held} tokens in {0 if keys is None else keys.shape[0]} row(s). Prefill the document "
                "alone (ShadowKVCache.prefill(model, ids)) and save before generating."
            )
    tensors = {"token_ids": token_ids}
    for i, (prompt, keys, values) in enumerate(layers):
        tensors |= layer_tensors(i, prompt, keys, values)
    tensors = {k: v[:1].contiguous() if k != "token_ids" else v.contiguous() for k, v in tensors.items()}
    policy_state = layers[0][0].policy_state if layers and layers[0][0] is not None else {}
    policy_specs = {name: (tuple(t[:1].shape), t.dtype) for name, t in policy_state.items()}
    ranks = [prompt.a.shape[-1] if prompt is not None else 0 for prompt, _, _ in layers]
    expected = expected_tensors(dims, config, length, dtype, policy_specs, ranks)
    check_specs({k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}, expected, "this cache")
    meta = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "model": model_identity(model),
        "shadowkv_config": dataclasses.asdict(config),
        "policy": {
            "name": type(policy).__name__,
            "state": {
                n: {"shape": list(s), "dtype": str(d).removeprefix("torch.")} for n, (s, d) in policy_specs.items()
            },
        },
        "prefix_length": length,
        "token_ids_sha256": token_ids_sha256(token_ids),
        "kv_dtype": str(dtype).removeprefix("torch."),
        "value_codec": value_codec(config.value_format, dims[2]).identity(),
        "layers": ["compressed" if p is not None else "exact" for p, _, _ in layers],
        "ranks": ranks,
    }
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    if needed > free:
        raise PrefixCacheError(
            f"The prefix needs {needed / 2**30:.2f} GiB but {path.parent} has {free / 2**30:.2f} GiB free."
        )
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={METADATA_KEY: json.dumps(meta, sort_keys=True)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
