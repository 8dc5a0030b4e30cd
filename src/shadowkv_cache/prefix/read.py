"""Reading a prefix file: everything is checked before any tensor is built.

Legend: S prefix tokens, L layers, Hkv KV heads, D head dim, c chunk size, C chunks, Tc = C*c compressed tokens,
N quantised tokens (YAKV).

A load reads one file even while a writer replaces it (`held_file.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..config import ShadowKVConfig
from ..policies.base import SelectionPolicy
from ..shadowkv.prompt import CompressedPrompt
from ..stores.value_codecs import value_codec
from ..yakv.prompt import QuantizedPrompt
from . import integrity
from .errors import PrefixCacheError, PrefixOptionError
from .format import (
    ADDED_DECODE_TIME_FIELDS,
    DECODE_TIME_FIELDS,
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA_KEY,
    OLDER_VERSIONS,
    policy_settings,
    settings_as_saved,
    yakv_quantizers,
)
from .held_file import read_one_file
from .identity import (
    canonical_json,
    config_identity,
    kv_dtype_and_devices,
    model_dims,
    model_identity,
    token_ids_sha256,
)
from .layout import (
    DTYPES_BY_NAME,
    ST_DTYPES,
    Spec,
    check_specs,
    check_structure,
    expected_tensors,
    layer_kinds,
    read_layer,
)

__all__ = ["PrefixState", "read_prefix"]


@dataclass
class PrefixState:
    """What `read_prefix` validated and read: ready to become a `ShadowKVCache`'s layers."""

    config: ShadowKVConfig
    policy: SelectionPolicy
    token_ids: torch.Tensor  # [S] int64 on the CPU
    # (prompt, keys, values) per layer: a compressed or quantised prompt and no tokens after it, or None and the
    # exact keys/values [1, Hkv, G, D] of a short document or of a sliding layer's window
    layers: list[tuple[CompressedPrompt | QuantizedPrompt | None, torch.Tensor, torch.Tensor]]


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


def _read_header(f, path: Path) -> tuple[dict, dict[str, Spec]]:
    """The JSON metadata and `{name: (shape, dtype)}` from the open safetensors file `f`, or `PrefixCacheError`."""
    by_st = {v: k for k, v in ST_DTYPES.items()}
    try:
        metadata = f.metadata() or {}
        specs = {}
        for name in f.keys():
            piece = f.get_slice(name)
            specs[name] = (tuple(piece.get_shape()), by_st.get(piece.get_dtype(), piece.get_dtype()))
    except Exception as err:  # the library's errors for malformed headers vary by version
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
    """The model's type, config and KV dtype (cheap; the weights come last, `_check_weights`)."""
    saved = _field(meta, "model", dict, path)
    saved_config = _field(saved, "config", dict, path)
    if hashlib.sha256(canonical_json(saved_config).encode()).hexdigest() != _field(saved, "config_sha256", str, path):
        raise PrefixCacheError(f"{path}: the model config in the metadata does not match its hash (damaged header).")
    current = config_identity(model)
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
    return dtype


def _check_weights(meta: dict, model: nn.Module, path: Path) -> None:
    """Every weight that shapes the keys and values (identity.py) hashes as it did for the model that saved the file."""
    saved = _field(meta, "model", dict, path)
    weights = _field(saved, "weights", dict, path)
    total = _field(saved, "weights_sha256", str, path)
    current = model_identity(model)
    if total == current["weights_sha256"]:
        return
    differ = [name for name, digest in current["weights"].items() if weights.get(name) != digest]
    missing = sorted(set(weights) - set(current["weights"]))
    extra = f"; the file's {missing[:3]} are not in this model" if missing else ""
    raise PrefixCacheError(
        f"{path} was saved for a model with the same config but other weights ({len(differ)} of "
        f"{len(current['weights'])} weight tensors differ, first {differ[:3]}{extra}; e.g. a base vs an instruct "
        "model, or a fine-tune). Prefill the document again with this model."
    )


def _check_config(
    meta: dict, config: ShadowKVConfig | None, overrides: dict, path: Path
) -> tuple[ShadowKVConfig, ShadowKVConfig]:
    """(the config the file was made with, the config asked for), after checking they shaped the same state."""
    fields = _field(meta, "shadowkv_config", dict, path)
    defaults = ShadowKVConfig()
    fields = {**{name: getattr(defaults, name) for name in ADDED_DECODE_TIME_FIELDS}, **fields}
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


def _check_quantizers(meta: dict, config: ShadowKVConfig, policy: SelectionPolicy, head_dim: int, path: Path) -> None:
    """YAKV's host records and scoring codes decode only with the quantisers that made them."""
    saved = _field(meta, "quantizers", dict, path)
    current = yakv_quantizers(config, policy, head_dim)
    if sorted(saved) != sorted(current):
        raise PrefixCacheError(
            f"{path}: the file records quantisers {sorted(saved)}, this load uses {sorted(current)} (damaged?)."
        )
    for role, quantizer in current.items():
        if not quantizer.matches(saved[role]):
            entry = saved[role]
            shown = {k: v for k, v in entry.items() if k not in ("grid", "signs")} if isinstance(entry, dict) else entry
            raise PrefixCacheError(
                f"{path} holds {role} codes of the HIGGS quantiser {shown} (grid and signs not shown), which this "
                "shadowkv_cache's quantiser does not decode (another grid, rotation or seed); prefill the document "
                "again."
            )


def _policy_specs(meta: dict, policy: SelectionPolicy, path: Path) -> dict[str, Spec]:
    saved = _field(meta, "policy", dict, path)
    if _field(saved, "name", str, path) != type(policy).__name__:
        raise PrefixCacheError(
            f"{path} was prepared for the {saved['name']} selection policy, this load uses "
            f"{type(policy).__name__}; pass policy={saved['name']}() or prefill again."
        )
    settings = settings_as_saved(_field(saved, "settings", dict, path), policy)
    if settings != policy_settings(policy):
        raise PrefixCacheError(
            f"{path} was prepared by a {saved['name']} with other settings: "
            f"{_differences(settings, policy_settings(policy))}. Pass a policy with the file's settings or prefill "
            "again."
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
    model: nn.Module,
    path,
    config: ShadowKVConfig | None,
    policy: SelectionPolicy | None,
    default_policy: Callable[[ShadowKVConfig], SelectionPolicy],
    overrides: dict,
    windows: list[int | None],
    verify: bool = True,
    key: bytes | None = None,
) -> PrefixState:
    """Validate the file at `path` against `model`, `config`/`overrides` and `policy` (`default_policy(config)` when
    None, for the config the load resolves to), then read it; `windows` are the model's sliding windows per layer
    (None for other layers).

    Everything is checked before any tensor is built, from one open file: format and version, the key (a keyed
    file's header MAC first), model type, config and KV dtype, ShadowKV config, policy, every tensor's name, shape and
    dtype, the header digest, the model's weights; then the token ids against their hash, the structural tensors
    (positions, masks, budgets) against what a document prefix holds, and, with `verify` (the default), every
    tensor's digest and that float tensors are finite. Device tensors go to each layer's device; host values to
    (pinned) host memory.
    """
    path = Path(path)
    if not isinstance(verify, bool):
        raise PrefixOptionError(f"verify must be True or False, got {verify!r}.")
    key = integrity.check_key_option(key)
    if key is not None and not verify:
        raise PrefixOptionError("load_prefix(key=...) authenticates the file, which needs verify=True.")

    def read(f) -> PrefixState:
        return _read_open(f, model, path, config, policy, default_policy, overrides, windows, verify, key)

    return read_one_file(path, read)


def _read_open(
    f, model, path: Path, config, policy, default_policy, overrides: dict, windows, verify: bool, key: bytes | None
) -> PrefixState:
    meta, found = _read_header(f, path)
    if meta.get("format") != FORMAT_NAME:
        raise PrefixCacheError(f"{path}: not a shadowkv_cache prefix (format {meta.get('format')!r}).")
    version = _field(meta, "version", int, path)
    if version != FORMAT_VERSION:
        older = f" ({OLDER_VERSIONS[version]})" if version in OLDER_VERSIONS else ""
        raise PrefixCacheError(
            f"{path} uses prefix format version {version}{older}; this shadowkv_cache reads version "
            f"{FORMAT_VERSION}. Prefill the document again with this version (or use the version that wrote it)."
        )
    sealed = _field(meta, integrity.FIELD, dict, path)
    integrity.check_seal(meta, sealed, key, path)  # a signed file's header MAC before any other field is trusted
    dtype = _check_model(meta, model, path)
    saved_config, config = _check_config(meta, config, overrides, path)
    length = _field(meta, "prefix_length", int, path)
    dims = model_dims(model)
    kinds = _field(meta, "layers", list, path)
    sizes = saved_config.resolve(length, dims[1] * dims[2])
    if length < 1 or kinds != layer_kinds(windows, saved_config, length, dims[1] * dims[2]):
        raise PrefixCacheError(f"{path}: prefix length {length} and layer kinds {kinds[:3]}... do not fit (damaged?).")
    ranks = _ranks(meta, sizes, kinds, path)
    policy = policy if policy is not None else default_policy(config)
    specs = _policy_specs(meta, policy, path)
    expected = expected_tensors(dims, config, length, dtype, specs, ranks, windows)
    check_specs(found, expected, str(path))
    _check_value_codec(meta, value_codec(config.value_format, dims[2]), path)
    _check_quantizers(meta, config, policy, dims[2], path)
    digests = _field(sealed, "tensors", dict, path)
    if sorted(digests) != sorted(found):
        raise PrefixCacheError(f"{path}: the metadata has digests for other tensors than the file holds (damaged).")
    _check_weights(meta, model, path)

    _, devices = kv_dtype_and_devices(model, dims[0])
    try:
        # Views of the file's one mapping: nothing is copied until a layer is built.
        tensors = {name: f.get_tensor(name) for name in found}
        token_hash = _field(meta, "token_ids_sha256", str, path)
        if token_ids_sha256(tensors["token_ids"]) != token_hash:
            raise PrefixCacheError(f"{path}: the token ids do not match their hash (damaged file).")
        budget = config.resolve(length, dims[1] * dims[2]).budget_chunks  # `sparse_budget` may change at load
        for i in range(dims[0]):
            check_structure(tensors, i, kinds[i], sizes, path)
        if verify:  # after the field-by-field checks, which name what is wrong; this catches the rest
            if not integrity.digests_equal(sealed.get("header"), integrity.header_digest(key, meta)):
                raise PrefixCacheError(f"{path}: the metadata does not match its digest (damaged header).")
            integrity.verify_tensors(tensors, digests, token_hash, key, path)
        token_ids = tensors["token_ids"].clone()
        layers = [read_layer(tensors, i, kinds[i], devices[i], config, sizes, budget, length) for i in range(dims[0])]
    except PrefixCacheError:
        raise
    except Exception as err:  # a data region the header promised but the file lacks, an unreadable page
        raise PrefixCacheError(f"{path}: could not read the tensors (truncated or damaged?): {err}") from err
    return PrefixState(config, policy, token_ids, layers)


def _ranks(meta: dict, sizes, kinds: list[str], path: Path) -> list[int]:
    """Each layer's rank of the key factors (0 for any other kind), checked against the rule that chose it."""
    ranks = _field(meta, "ranks", list, path)
    low = sizes.min_rank if sizes.max_logit_error is not None else sizes.rank
    fits = len(ranks) == len(kinds) and all(
        type(r) is int and (low <= r <= sizes.rank if kind == "compressed" else r == 0) for r, kind in zip(ranks, kinds)
    )
    if not fits:
        wanted = str(sizes.rank) if sizes.max_logit_error is None else f"{sizes.min_rank}..{sizes.rank}"
        raise PrefixCacheError(
            f"{path}: the file's per-layer ranks {ranks[:6]} do not fit the config it was saved with (layers "
            f"{kinds[:6]}: rank {wanted} for a compressed layer, 0 for the others); the file is damaged."
        )
    return ranks
