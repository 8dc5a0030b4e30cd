"""Reading a prefix file: everything is checked before any tensor is built.

Legend: S prefix tokens, L layers, Hkv KV heads, D head dim, c chunk size, C chunks, Tc = C*c compressed tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..config import ShadowKVConfig
from ..policies.base import SelectionPolicy
from ..shadowkv.prompt import CompressedPrompt
from ..stores.value_codecs import value_codec
from ..stores.value_store import HostValueStore
from .errors import PrefixCacheError, PrefixOptionError
from .format import DECODE_TIME_FIELDS, FORMAT_NAME, FORMAT_VERSION, METADATA_KEY
from .identity import canonical_json, kv_dtype_and_devices, model_dims, model_identity, token_ids_sha256
from .layout import DTYPES_BY_NAME, ST_DTYPES, Spec, check_specs, expected_tensors

__all__ = ["PrefixState", "read_prefix"]


@dataclass
class PrefixState:
    """What `read_prefix` validated and read: ready to become a `ShadowKVCache`'s layers."""

    config: ShadowKVConfig
    policy: SelectionPolicy
    token_ids: torch.Tensor  # [S] int64 on the CPU
    layers: list[tuple[CompressedPrompt | None, torch.Tensor, torch.Tensor]]  # (prompt, keys, values) per layer


def _field(meta: dict, key: str, kind: type, path: Path):
    value = meta.get(key) if isinstance(meta, dict) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise PrefixCacheError(
            f"{path}: metadata field '{key}' is missing or not a {kind.__name__}; the file is damaged or was not "
            "written by shadowkv_cache."
        )
    return value


def _differences(saved: dict, current: dict, limit: int = 6) -> str:
    keys = sorted(k for k in set(saved) | set(current) if saved.get(k, "<absent>") != current.get(k, "<absent>"))
    shown = [f"{k}: {saved.get(k, '<absent>')!r} in the file, {current.get(k, '<absent>')!r} here" for k in keys]
    return "; ".join(shown[:limit]) + (f"; and {len(keys) - limit} more" if len(keys) > limit else "")


def _read_header(path: Path) -> tuple[dict, dict[str, Spec]]:
    """The JSON metadata and `{name: (shape, dtype)}` from the safetensors header, or `PrefixCacheError`."""
    if not path.is_file():
        raise PrefixCacheError(f"No prefix file at {path}.")
    by_st = {v: k for k, v in ST_DTYPES.items()}
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            specs = {}
            for name in f.keys():
                piece = f.get_slice(name)
                specs[name] = (tuple(piece.get_shape()), by_st.get(piece.get_dtype(), piece.get_dtype()))
    except Exception as err:  # the library's errors for truncated or malformed files vary by version
        raise PrefixCacheError(f"{path} is not a readable safetensors file (truncated or damaged?): {err}") from err
    if METADATA_KEY not in metadata:
        raise PrefixCacheError(f"{path} is a safetensors file but not a shadowkv_cache prefix (no '{METADATA_KEY}').")
    try:
        meta = json.loads(metadata[METADATA_KEY])
    except (ValueError, RecursionError) as err:  # a header nested deep enough exhausts the parser's recursion
        raise PrefixCacheError(f"{path}: the prefix metadata is not valid JSON (damaged header): {err}") from err
    if not isinstance(meta, dict):
        raise PrefixCacheError(f"{path}: the prefix metadata is not a JSON object (damaged header).")
    return meta, specs


def _check_model(meta: dict, model: nn.Module, path: Path) -> torch.dtype:
    saved = _field(meta, "model", dict, path)
    saved_config = _field(saved, "config", dict, path)
    if hashlib.sha256(canonical_json(saved_config).encode()).hexdigest() != _field(saved, "config_sha256", str, path):
        raise PrefixCacheError(f"{path}: the model config in the metadata does not match its hash (damaged header).")
    current = model_identity(model)
    if saved_config != current["config"] or _field(saved, "model_type", str, path) != current["model_type"]:
        raise PrefixCacheError(
            f"{path} was saved for another model ({saved.get('model_type')}); config differs: "
            f"{_differences(saved_config, current['config'])}. Prefill the document again with this model."
        )
    dtype = DTYPES_BY_NAME.get(_field(meta, "kv_dtype", str, path))
    model_dtype, _ = kv_dtype_and_devices(model, 1)
    if dtype != model_dtype:
        raise PrefixCacheError(
            f"{path} holds {meta['kv_dtype']} keys/values but this model computes "
            f"{str(model_dtype).removeprefix('torch.')}; load the model "
            f"in {meta['kv_dtype']} or prefill the document again."
        )
    if _field(saved, "weights_sha256", str, path) != current["weights_sha256"]:
        raise PrefixCacheError(
            f"{path} was saved for a model with the same config but other weights (hash of {current['weights']} "
            "differs, e.g. a base vs an instruct model). Prefill the document again with this model."
        )
    return dtype


def _check_config(
    meta: dict, config: ShadowKVConfig | None, overrides: dict, path: Path
) -> tuple[ShadowKVConfig, ShadowKVConfig]:
    """(the config the file was made with, the config asked for), after checking they shaped the same state."""
    fields = _field(meta, "shadowkv_config", dict, path)
    if sorted(fields) != sorted(ShadowKVConfig.field_names()):
        raise PrefixCacheError(f"{path}: the ShadowKV config in the metadata has fields {sorted(fields)} (damaged?).")
    try:
        saved = ShadowKVConfig(**fields)
    except (TypeError, ValueError) as err:
        raise PrefixCacheError(f"{path}: the ShadowKV config in the metadata is invalid (damaged?): {err}") from err
    unknown = sorted(set(overrides) - set(ShadowKVConfig.field_names()))
    if unknown:
        raise PrefixOptionError(
            f"Unknown ShadowKVCache option(s) {unknown}; valid options: {ShadowKVConfig.field_names()}."
        )
    if config is not None and not isinstance(config, ShadowKVConfig):
        raise PrefixOptionError(f"config must be a ShadowKVConfig, got {type(config).__name__}; or pass options.")
    try:
        wanted = dataclasses.replace(config or saved, **overrides)
    except ValueError as err:
        raise PrefixCacheError(f"load_prefix got an invalid option: {err}") from err
    shaped = {k: v for k, v in dataclasses.asdict(saved).items() if k not in DECODE_TIME_FIELDS}
    asked = {k: v for k, v in dataclasses.asdict(wanted).items() if k not in DECODE_TIME_FIELDS}
    if shaped != asked:
        raise PrefixCacheError(
            f"{path} was compressed with another ShadowKV config: {_differences(shaped, asked)}. Only "
            f"{', '.join(DECODE_TIME_FIELDS)} may change at load; other settings need a new prefill."
        )
    return saved, wanted


def _check_value_codec(meta: dict, codec, path: Path) -> None:
    """The host values decode only with the codec that encoded them (its grid, for HIGGS)."""
    saved = meta.get("value_codec", {"name": "native", "head_dim": codec.head_dim})
    if not isinstance(saved, dict) or not codec.matches(saved):
        shown = {k: v for k, v in saved.items() if k != "grid"} if isinstance(saved, dict) else saved
        raise PrefixCacheError(
            f"{path} stores values encoded as {shown} (grid not shown), which this shadowkv_cache's {codec.name} "
            "codec does not decode (another grid, rotation or head dim); prefill the document again."
        )


def _policy_specs(meta: dict, policy: SelectionPolicy, path: Path) -> dict[str, Spec]:
    saved = _field(meta, "policy", dict, path)
    if _field(saved, "name", str, path) != type(policy).__name__:
        raise PrefixCacheError(
            f"{path} was prepared for the {saved['name']} selection policy, this load uses "
            f"{type(policy).__name__}; pass policy={saved['name']}() or prefill again."
        )
    specs = {}
    for name, spec in _field(saved, "state", dict, path).items():
        shape, dtype = spec.get("shape") if isinstance(spec, dict) else None, None
        if isinstance(spec, dict) and isinstance(spec.get("dtype"), str):
            dtype = DTYPES_BY_NAME.get(spec["dtype"])
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape) or dtype is None:
            raise PrefixCacheError(f"{path}: the policy state entry {name!r} in the metadata is malformed.")
        specs[name] = (tuple(shape), dtype)
    return specs


def read_prefix(
    model: nn.Module, path, config: ShadowKVConfig | None, policy: SelectionPolicy, overrides: dict
) -> PrefixState:
    """Validate the file at `path` against `model`, `config`/`overrides` and `policy`, then read it.

    Everything is checked before any tensor is read: format and version, model config and weights, KV
    dtype, ShadowKV config, policy, and every tensor's name, shape and dtype. Then the token ids are checked
    against their hash and the structural tensors (positions, masks, budgets) against what a document prefix
    holds. Device tensors go to each layer's device; host values to (pinned) host memory.
    """
    path = Path(path)
    meta, found = _read_header(path)
    if meta.get("format") != FORMAT_NAME:
        raise PrefixCacheError(f"{path}: not a shadowkv_cache prefix (format {meta.get('format')!r}).")
    version = _field(meta, "version", int, path)
    if version != FORMAT_VERSION:
        older = " (version 1 predates per-layer ranks, rank='auto')" if version < FORMAT_VERSION else ""
        raise PrefixCacheError(
            f"{path} uses prefix format version {version}{older}; this shadowkv_cache reads version "
            f"{FORMAT_VERSION}. Prefill the document again with this version (or use the version that wrote it)."
        )
    dtype = _check_model(meta, model, path)
    saved_config, config = _check_config(meta, config, overrides, path)
    length = _field(meta, "prefix_length", int, path)
    dims = model_dims(model)
    kinds = _field(meta, "layers", list, path)
    sizes = saved_config.resolve(length, dims[1] * dims[2])
    if length < 1 or kinds != ["compressed" if sizes.num_chunks else "exact"] * dims[0]:
        raise PrefixCacheError(f"{path}: prefix length {length} and layer kinds {kinds[:3]}... do not fit (damaged?).")
    ranks = _ranks(meta, sizes, dims[0], path)
    expected = expected_tensors(dims, config, length, dtype, _policy_specs(meta, policy, path), ranks)
    check_specs(found, expected, str(path))
    _check_value_codec(meta, value_codec(config.value_format, dims[2]), path)

    _, devices = kv_dtype_and_devices(model, dims[0])
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            token_ids = f.get_tensor("token_ids").clone()
            if token_ids_sha256(token_ids) != _field(meta, "token_ids_sha256", str, path):
                raise PrefixCacheError(f"{path}: the token ids do not match their hash (damaged file).")
            budget = config.resolve(length, dims[1] * dims[2]).budget_chunks  # `sparse_budget` may change at load
            layers = [_read_layer(f, i, devices[i], config, sizes, budget, path) for i in range(dims[0])]
    except PrefixCacheError:
        raise
    except Exception as err:  # a data region the header promised but the file lacks, an unreadable page
        raise PrefixCacheError(f"{path}: could not read the tensors (truncated or damaged?): {err}") from err
    return PrefixState(config, policy, token_ids, layers)


def _ranks(meta: dict, sizes, num_layers: int, path: Path) -> list[int]:
    """Each layer's rank of the key factors (0 for an exact layer), checked against the rule that chose it."""
    ranks = _field(meta, "ranks", list, path)
    if sizes.num_chunks:
        low = sizes.min_rank if sizes.max_logit_error is not None else sizes.rank
        fits = all(type(r) is int and low <= r <= sizes.rank for r in ranks)
    else:
        fits = all(type(r) is int and r == 0 for r in ranks)
    if len(ranks) != num_layers or not fits:
        if not sizes.num_chunks:
            wanted = "0 (exact layers)"
        elif sizes.max_logit_error is None:
            wanted = str(sizes.rank)
        else:
            wanted = f"{sizes.min_rank}..{sizes.rank}"
        raise PrefixCacheError(
            f"{path}: the file's per-layer ranks {ranks[:6]} do not fit the config it was saved with ({num_layers} "
            f"layers of rank {wanted}); the file is damaged."
        )
    return ranks


def _read_layer(f, i: int, device: torch.device, config: ShadowKVConfig, sizes, budget: int, path: Path):
    """One layer's `(prompt, keys, values)`; `sizes` are the saved config's, `budget` the chunks to select now."""
    p = f"layers.{i}."
    if not sizes.num_chunks:
        return None, f.get_tensor(p + "keys").to(device, copy=True), f.get_tensor(p + "values").to(device, copy=True)
    t = {name: f.get_tensor(p + name) for name in CompressedPrompt.ROW_FIELDS}
    # A document prefix has fixed structure: positions 0..Tc-1, every outlier and local slot real, C-O
    # selectable chunks per head, the budget of its config. A file that says otherwise is damaged.
    structure_ok = (
        torch.equal(t["positions"][0], torch.arange(t["positions"].shape[1]))
        and int(t["budget_chunks"][0]) == sizes.budget_chunks
        and bool(t["outlier_valid"].view(torch.uint8).eq(1).all())
        and bool(t["local_valid"].view(torch.uint8).eq(1).all())
        and bool(t["selectable"].view(torch.uint8).le(1).all())
        and bool(t["selectable"].sum(-1).eq(sizes.num_chunks - sizes.outliers).all())
    )
    if not structure_ok:
        raise PrefixCacheError(f"{path}: layer {i} does not hold a document prefix's positions and masks (damaged).")
    t["budget_chunks"] = torch.tensor([budget])
    codec = value_codec(config.value_format, t["b"].shape[-1])  # the file's format: checked to be the config's
    prompt = CompressedPrompt(
        **{name: v.to(device, copy=True) for name, v in t.items()},
        policy_state={
            k.removeprefix(p + "policy."): f.get_tensor(k).to(device, copy=True)
            for k in f.keys()
            if k.startswith(p + "policy.")
        },
        values=HostValueStore.from_encoded(
            f.get_tensor(p + "host_values"),
            f.get_tensor(p + "host_value_scales") if codec.scale_dtype is not None else None,
            codec,
            pin=config.pin_memory and device.type == "cuda",
        ),
        chunk_size=config.chunk_size,
        slots=sizes.num_chunks * config.chunk_size + sizes.local,
        max_budget_chunks=budget,
    )
    empty = prompt.local_keys[:, :, :0]
    return prompt, empty, empty.clone()
