"""Prefix reuse: a document's compressed state saved to safetensors, loaded into new caches, checked on use.

Legend: S prefix tokens, L layers, Hkv KV heads, D head dim, c chunk size, C chunks, Tc = C*c compressed
tokens, R rank, O outlier chunks, W local-window tokens.

A prefix file (format version 1, see docs/prefix_format.md) holds, per layer, what a one-row `ShadowKVCache`
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
import hashlib
import inspect
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .compressed_prompt import CompressedPrompt
from .config import ShadowKVConfig
from .policies.base import SelectionPolicy
from .value_codecs import value_codec
from .value_store import HostValueStore

__all__ = [
    "FORMAT_VERSION",
    "batch_questions",
    "PrefixCacheError",
    "PrefixState",
    "check_prefix_ids",
    "model_identity",
    "prefill",
    "read_prefix",
    "run_prompt",
    "token_ids_sha256",
    "write_prefix",
]

FORMAT_NAME = "shadowkv-prefix"
FORMAT_VERSION = 1
METADATA_KEY = "shadowkv_prefix"
# Fields that only matter at decode time: a loaded prefix may change them. Every other field shaped the state.
DECODE_TIME_FIELDS = ("sparse_budget", "dense_multi_token_steps", "pin_memory", "cuda_graphs")
_MODE_FIELDS = ("mode", "host_grid_dim", "score_grid_dim", "recent_window")
# Config entries that do not change the keys and values a model computes.
_VOLATILE_CONFIG_KEYS = {
    "architectures", "bos_token_id", "dtype", "eos_token_id", "id2label", "label2id", "output_attentions",
    "output_hidden_states", "pad_token_id", "problem_type", "return_dict", "torch_dtype", "transformers_version",
    "use_cache",
}  # fmt: skip
_ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.bool: "BOOL",
    torch.uint8: "U8",  # 4-bit value codes, two per byte
    torch.float8_e4m3fn: "F8_E4M3",  # fp8 value codes
}
_DTYPES_BY_NAME = {str(dt).removeprefix("torch."): dt for dt in _ST_DTYPES}
Spec = tuple[tuple[int, ...], torch.dtype]  # (shape, dtype) of one stored tensor


class PrefixCacheError(ValueError):
    """A prefix file or a prefix use that does not fit: another model, config, version, or a damaged file."""


@dataclass
class PrefixState:
    """What `read_prefix` validated and read: ready to become a `ShadowKVCache`'s layers."""

    config: ShadowKVConfig
    policy: SelectionPolicy
    token_ids: torch.Tensor  # [S] int64 on the CPU
    layers: list[tuple[CompressedPrompt | None, torch.Tensor, torch.Tensor]]  # (prompt, keys, values) per layer


# -- identities ----------------------------------------------------------------------------------------------


def token_ids_sha256(ids: torch.Tensor) -> str:
    """SHA-256 of the ids as little-endian int64 (`[S]`)."""
    return hashlib.sha256(ids.to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes()).hexdigest()


def _json(obj) -> str:
    return json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))


def _first_kv_projections(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    names = {}
    for name, param in model.named_parameters():
        for proj in ("k_proj.weight", "v_proj.weight"):
            if name.endswith(proj) and proj not in names:
                names[proj] = (name, param)
    if len(names) < 2:
        raise PrefixCacheError(f"{type(model).__name__} has no k_proj/v_proj weights to identify it by.")
    return [names["k_proj.weight"], names["v_proj.weight"]]


def model_identity(model: nn.Module) -> dict:
    """The model's config (minus entries that do not change keys/values) and hashes of it and of layer 0's
    `k_proj`/`v_proj` weights, which tell a base and an instruct model of one config apart."""
    text_config = model.config.get_text_config()
    config = {
        k: v for k, v in text_config.to_dict().items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS
    }
    config = json.loads(_json(config))  # plain JSON, as it reads back from a file
    weights = hashlib.sha256()
    projections = _first_kv_projections(model)
    for name, param in projections:
        tensor = param.detach().to("cpu").contiguous()
        weights.update(_json([name, str(tensor.dtype), list(tensor.shape)]).encode())
        weights.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return {
        "model_type": text_config.model_type,
        "config": config,
        "config_sha256": hashlib.sha256(_json(config).encode()).hexdigest(),
        "weights": [name for name, _ in projections],
        "weights_sha256": weights.hexdigest(),
    }


def model_dims(model: nn.Module) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the model's text config."""
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, text.num_key_value_heads, head_dim


def _kv_dtype_and_devices(model: nn.Module, num_layers: int) -> tuple[torch.dtype, list[torch.device]]:
    """The dtype keys and values come in (that of `k_proj`), and the device of each layer's attention."""
    devices = {}
    for module in model.modules():
        if hasattr(module, "layer_idx") and isinstance(getattr(module, "k_proj", None), nn.Module):
            devices[module.layer_idx] = module.k_proj.weight.device
    dtype = _first_kv_projections(model)[0][1].dtype
    fallback = next(iter(devices.values()), torch.device("cpu"))
    return dtype, [devices.get(i, fallback) for i in range(num_layers)]


# -- the expected layout -------------------------------------------------------------------------------------


def _expected_tensors(dims, config: ShadowKVConfig, length: int, dtype, policy_specs: dict[str, Spec]):
    """`{name: (shape, dtype)}` of every tensor a file for this model, config and prefix length must hold."""
    num_layers, heads, dim = dims
    sizes = config.resolve(length, heads * dim)
    specs: dict[str, Spec] = {"token_ids": ((length,), torch.int64)}
    for i in range(num_layers):
        p = f"layers.{i}."
        if not sizes.num_chunks:  # a short document stays exact
            specs[p + "keys"] = specs[p + "values"] = ((1, heads, length, dim), dtype)
            continue
        c, chunks, rank = config.chunk_size, sizes.num_chunks, sizes.rank
        out, local = sizes.outliers * c, sizes.local
        codec = value_codec(config.value_format, dim)
        specs |= {
            p + "a": ((1, chunks * c, rank), dtype),
            p + "b": ((1, rank, heads, dim), dtype),
            p + "positions": ((1, chunks * c), torch.int64),
            p + "selectable": ((1, heads, chunks), torch.bool),
            p + "budget_chunks": ((1,), torch.int64),
            p + "outlier_keys": ((1, heads, out, dim), dtype),
            p + "outlier_values": ((1, heads, out, dim), dtype),
            p + "outlier_valid": ((1, out), torch.bool),
            p + "local_keys": ((1, heads, local, dim), dtype),
            p + "local_values": ((1, heads, local, dim), dtype),
            p + "local_valid": ((1, local), torch.bool),
            p + "host_values": ((1, heads, chunks, c, codec.payload_dim), codec.payload_dtype or dtype),
        }
        if codec.scale_dtype is not None:
            specs[p + "host_value_scales"] = ((1, heads, chunks, c), codec.scale_dtype)
        specs |= {f"{p}policy.{name}": spec for name, spec in policy_specs.items()}
    return specs


def _layer_tensors(i: int, prompt: CompressedPrompt | None, keys: torch.Tensor, values: torch.Tensor) -> dict:
    p = f"layers.{i}."
    if prompt is None:
        return {p + "keys": keys, p + "values": values}
    out = {p + name: getattr(prompt, name) for name in CompressedPrompt._ROW_FIELDS}
    out |= {f"{p}policy.{name}": t for name, t in prompt.policy_state.items()}
    store = prompt.values  # saved as stored (encoded), so a load decodes exactly what this cache decodes
    out[p + "host_values"] = store.data[store.row_map[:1]]
    if store.scales is not None:
        out[p + "host_value_scales"] = store.scales[store.row_map[:1]]
    return out


# -- writing -------------------------------------------------------------------------------------------------


def as_prefix_ids(input_ids) -> torch.Tensor:
    """`[S]` int64 CPU ids from a `[S]` or `[1, S]` tensor or list; one document only."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point():
        raise PrefixCacheError(
            f"A prefix is one document: pass its token ids as [S] or [1, S] integers, got shape {tuple(ids.shape)}."
        )
    return ids.to("cpu", torch.int64)


def prefill(model: nn.Module, input_ids: torch.Tensor, cache, progress: bool = False) -> None:
    """Run the document `input_ids` (`[S]` or `[1, S]`) through `model` into `cache` (one forward, no logits
    kept but the last), with a per-layer progress bar if `progress`."""
    run_prompt(model, as_prefix_ids(input_ids)[None], cache, progress=progress)


def run_prompt(model: nn.Module, input_ids: torch.Tensor, cache, progress: bool = False, **inputs) -> None:
    """One forward of `input_ids` (`[B, S]`) and further `inputs` (e.g. `attention_mask`, `position_ids`, `[B, S]`)
    into `cache`, on the device of the model's first layer, no logits kept but the last; a per-layer progress
    bar if `progress`."""
    device = _kv_dtype_and_devices(model, 1)[1][0]
    ids = input_ids.to(device)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    hooks = []
    if progress:
        from tqdm import tqdm

        attention = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
        bar = tqdm(total=len(attention), desc=f"prefill {ids.shape[1]} tokens", unit="layer", leave=False)

        def step(*_) -> None:  # a forward hook that returns a value would replace the module's output
            bar.update(1)

        hooks = [m.register_forward_hook(step) for m in attention]
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **inputs, **{name: cache})
    finally:
        for hook in hooks:
            hook.remove()
        if progress:
            bar.close()


def write_prefix(path, model, config: ShadowKVConfig, policy: SelectionPolicy, token_ids: torch.Tensor, layers):
    """Save a one-row prefix (`layers`: `(prompt, keys, values)` per layer) to `path`, atomically."""
    path = Path(path)
    length = len(token_ids)
    dims = model_dims(model)
    dtype, _ = _kv_dtype_and_devices(model, dims[0])
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
        tensors |= _layer_tensors(i, prompt, keys, values)
    tensors = {k: v[:1].contiguous() if k != "token_ids" else v.contiguous() for k, v in tensors.items()}
    policy_state = layers[0][0].policy_state if layers and layers[0][0] is not None else {}
    policy_specs = {name: (tuple(t[:1].shape), t.dtype) for name, t in policy_state.items()}
    expected = _expected_tensors(dims, config, length, dtype, policy_specs)
    _check_specs({k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}, expected, "this cache")
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


# -- reading -------------------------------------------------------------------------------------------------


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


def _check_specs(found: dict[str, Spec], expected: dict[str, Spec], where: str) -> None:
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or extra:
        raise PrefixCacheError(
            f"{where} does not hold the tensors a prefix of this model and config has: missing {missing[:4]}, "
            f"unexpected {extra[:4]}."
        )
    for name, (shape, dtype) in expected.items():
        if found[name] != (shape, dtype):
            raise PrefixCacheError(
                f"{where}: tensor {name} is {list(found[name][0])} {_dtype_name(found[name][1])}, expected "
                f"{list(shape)} {_dtype_name(dtype)}."
            )


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")  # a torch dtype, or a safetensors name we do not map (e.g. F64)


def _read_header(path: Path) -> tuple[dict, dict[str, Spec]]:
    """The JSON metadata and `{name: (shape, dtype)}` from the safetensors header, or `PrefixCacheError`."""
    if not path.is_file():
        raise PrefixCacheError(f"No prefix file at {path}.")
    by_st = {v: k for k, v in _ST_DTYPES.items()}
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
    except ValueError as err:
        raise PrefixCacheError(f"{path}: the prefix metadata is not valid JSON (damaged header): {err}") from err
    if not isinstance(meta, dict):
        raise PrefixCacheError(f"{path}: the prefix metadata is not a JSON object (damaged header).")
    return meta, specs


def _check_model(meta: dict, model: nn.Module, path: Path) -> torch.dtype:
    saved = _field(meta, "model", dict, path)
    saved_config = _field(saved, "config", dict, path)
    if hashlib.sha256(_json(saved_config).encode()).hexdigest() != _field(saved, "config_sha256", str, path):
        raise PrefixCacheError(f"{path}: the model config in the metadata does not match its hash (damaged header).")
    current = model_identity(model)
    if saved_config != current["config"] or _field(saved, "model_type", str, path) != current["model_type"]:
        raise PrefixCacheError(
            f"{path} was saved for another model ({saved.get('model_type')}); config differs: "
            f"{_differences(saved_config, current['config'])}. Prefill the document again with this model."
        )
    dtype = _DTYPES_BY_NAME.get(_field(meta, "kv_dtype", str, path))
    model_dtype, _ = _kv_dtype_and_devices(model, 1)
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
    fields = {"value_format": "native", **fields}  # files written before value formats hold native values
    # Files written before the YAKV fields (or a decode-time switch) existed are ShadowKV-mode files: those fields
    # take their defaults.
    defaults = dataclasses.asdict(ShadowKVConfig())
    fields = {**{k: defaults[k] for k in (*_MODE_FIELDS, *DECODE_TIME_FIELDS) if k not in fields}, **fields}
    if sorted(fields) != sorted(ShadowKVConfig.field_names()):
        raise PrefixCacheError(f"{path}: the ShadowKV config in the metadata has fields {sorted(fields)} (damaged?).")
    try:
        saved = ShadowKVConfig(**fields)
    except (TypeError, ValueError) as err:
        raise PrefixCacheError(f"{path}: the ShadowKV config in the metadata is invalid (damaged?): {err}") from err
    unknown = sorted(set(overrides) - set(ShadowKVConfig.field_names()))
    if unknown:
        raise TypeError(f"Unknown ShadowKVCache option(s) {unknown}; valid options: {ShadowKVConfig.field_names()}.")
    wanted = dataclasses.replace(config or saved, **overrides)
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
            dtype = _DTYPES_BY_NAME.get(spec["dtype"])
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
        raise PrefixCacheError(
            f"{path} uses prefix format version {version}; this shadowkv_cache reads version {FORMAT_VERSION}. "
            "Prefill the document again with this version (or use the version that wrote it)."
        )
    dtype = _check_model(meta, model, path)
    saved_config, config = _check_config(meta, config, overrides, path)
    length = _field(meta, "prefix_length", int, path)
    dims = model_dims(model)
    kinds = _field(meta, "layers", list, path)
    sizes = saved_config.resolve(length, dims[1] * dims[2])
    if length < 1 or kinds != ["compressed" if sizes.num_chunks else "exact"] * dims[0]:
        raise PrefixCacheError(f"{path}: prefix length {length} and layer kinds {kinds[:3]}... do not fit (damaged?).")
    expected = _expected_tensors(dims, config, length, dtype, _policy_specs(meta, policy, path))
    _check_specs(found, expected, str(path))
    _check_value_codec(meta, value_codec(config.value_format, dims[2]), path)

    _, devices = _kv_dtype_and_devices(model, dims[0])
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


def _read_layer(f, i: int, device: torch.device, config: ShadowKVConfig, sizes, budget: int, path: Path):
    """One layer's `(prompt, keys, values)`; `sizes` are the saved config's, `budget` the chunks to select now."""
    p = f"layers.{i}."
    if not sizes.num_chunks:
        return None, f.get_tensor(p + "keys").to(device, copy=True), f.get_tensor(p + "values").to(device, copy=True)
    t = {name: f.get_tensor(p + name) for name in CompressedPrompt._ROW_FIELDS}
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


# -- use -----------------------------------------------------------------------------------------------------


def check_prefix_ids(prefix_ids: torch.Tensor, input_ids: torch.Tensor, rows: int) -> None:
    """Raise unless every row of `input_ids` (`[B, T]`, what `generate` got) starts with the prefix (`[S]`)
    and goes on past it, and `B` is the cache's row count."""
    length = len(prefix_ids)
    batch, width = input_ids.shape[:2]
    if batch != rows:
        raise PrefixCacheError(
            f"generate got a batch of {batch} but the prefix cache has {rows} row(s); make one with "
            f"cache.fork(batch_size={batch}) (rows share the document)."
        )
    if width <= length:
        raise PrefixCacheError(
            f"generate got {width} tokens but the cache already holds the {length}-token prefix: pass the prefix "
            "ids followed by the question, torch.cat([cache.prefix_ids, question_ids]) (chunked prefill, "
            "prefill_chunk_size, is not supported on a prefix cache)."
        )
    head = input_ids[:, :length].to("cpu")
    differs = head != prefix_ids[None]
    if bool(differs.any()):
        row, col = (int(x) for x in differs.nonzero()[0])
        raise PrefixCacheError(
            f"The ids passed to generate do not start with the {length}-token prefix this cache holds (sha256 "
            f"{token_ids_sha256(prefix_ids)[:12]}...): row {row} differs first at token {col} "
            f"({int(head[row, col])} instead of {int(prefix_ids[col])}). Pass the document ids, then the question; "
            "in a batch, [document][left-padded question] (see shadowkv_cache.prefix.batch_questions)."
        )


def batch_questions(prefix_ids, questions, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids` and `attention_mask` (`[N, S + max Q]`) that ask N questions over one prefix in one batch.

    Rows are `[document][left-padded question]`, the layout a `cache.fork(batch_size=N)` expects: the pads sit
    between the document and the question and are masked. `generate` derives positions from the mask's
    cumulative sum, so a question's tokens get the positions they get alone (`S, S+1, ...`).

    >>> ids, mask = batch_questions(doc.prefix_ids, [q1, q2], tokenizer.pad_token_id)  # doctest: +SKIP
    >>> model.generate(ids, attention_mask=mask, past_key_values=doc.fork(2), max_new_tokens=32)  # doctest: +SKIP
    """
    prefix = as_prefix_ids(prefix_ids)
    rows = [as_prefix_ids(q) for q in questions]
    if not rows:
        raise PrefixCacheError("batch_questions needs at least one question.")
    width = max(len(q) for q in rows)
    ids = torch.full((len(rows), len(prefix) + width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    ids[:, : len(prefix)] = prefix
    mask[:, : len(prefix)] = 1
    for i, q in enumerate(rows):
        ids[i, ids.shape[1] - len(q) :] = q
        mask[i, ids.shape[1] - len(q) :] = 1
    return ids, mask
