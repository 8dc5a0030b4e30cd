"""Prefix files: the format's name and version, and writing a document's compressed state to one.

Legend: S prefix tokens, L layers, Hkv KV heads, D head dim, c chunk size, C chunks, Tc = C*c compressed
tokens, R rank, O outlier chunks, W local-window tokens.

A prefix file (format version 5, see docs/prefix_format.md) holds, per layer, what a one-row `ShadowKVCache`
keeps of a document: the `CompressedPrompt` tensors (low-rank factors, positions, policy state such as the
landmarks, outliers, local window, host values), in YAKV mode the `QuantizedPrompt` tensors (host records, scoring
codes, recent window), the exact keys/values of a document shorter than `min_compress_len`, or a sliding-window
layer's window; plus the token ids. Its safetensors metadata holds one JSON object (key
`shadowkv_prefix`): format and version, the model's identity (a hash of its config and of every weight that shapes
the keys and values), the ShadowKV config, the selection policy, the prefix length, a hash of the token ids, the KV
dtype, and digests of every tensor and of the header (SHA-256, or HMAC-SHA256 with a key; `integrity.py`). The
loader checks all of it before it builds anything; writes are atomic and get the usual permissions; nothing is
pickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ShadowKVConfig
from ..policies.base import SelectionPolicy
from ..quant import HiggsQuantizer
from ..shadowkv.prompt import CompressedPrompt
from ..stores.value_codecs import value_codec
from . import integrity
from .errors import PrefixCacheError
from .identity import kv_dtype_and_devices, model_dims, model_identity, token_ids_sha256
from .layout import check_specs, expected_tensors, layer_kinds, layer_tensors

__all__ = [
    "ADDED_DECODE_TIME_FIELDS",
    "DECODE_TIME_FIELDS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_KEY",
    "OLDER_VERSIONS",
    "format_bytes",
    "policy_settings",
    "yakv_quantizers",
    "write_prefix",
]

FORMAT_NAME = "shadowkv-prefix"
FORMAT_VERSION = 5  # 2: per-layer ranks (rank='auto'); 3: digests of every tensor and the header, all K/V weights;
# 4: the rank rule's attention-weighted bound (`auto_rank_shift`) in the config; 5: sliding-window layers, YAKV mode,
# the policy's settings and the YAKV quantisers
OLDER_VERSIONS = {
    1: "version 1 predates per-layer ranks, rank='auto'",
    2: "version 2 predates the digests of every tensor and the identity over every K/V weight",
    3: "version 3 predates the attention-weighted bound of rank='auto', auto_rank_shift",
    4: "version 4 predates sliding-window layers, YAKV mode and the policy's settings in the file",
}
METADATA_KEY = "shadowkv_prefix"
# Fields that only matter at decode time: a loaded prefix may change them. Every other field shaped the state.
DECODE_TIME_FIELDS = (
    "sparse_budget",
    "dense_multi_token_steps",
    "pin_memory",
    "cuda_graphs",
    "compile_model_ops",
    "device_record_share",
)
# Decode-time fields added after files of this version were first written: a file without one was made with its
# default.
ADDED_DECODE_TIME_FIELDS = ("compile_model_ops", "device_record_share")


# A writer's temporary file: `.<target name>.<pid>.<16 hex>.shadowkv-tmp` beside the target (see `_remove_stale`).
_TMP_SUFFIX = ".shadowkv-tmp"
_TMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{16}" + re.escape(_TMP_SUFFIX) + "$")
# A temporary file is stale when its writer is gone and it has not changed for this long (a writer in another PID
# namespace on a shared folder may look gone from here, but it keeps writing).
STALE_AFTER_S = 600.0


def policy_settings(policy: SelectionPolicy) -> dict:
    """The policy's public settings of plain JSON types (e.g. `QuantizedKeyTopK`'s `grid_dim` and `seed`), and those
    of the policies it wraps (`SharedBudgetTopK`'s `inner`): a policy of the same class with other settings prepares
    other state."""
    plain = (bool, int, float, str, type(None))
    out = {}
    for name, value in sorted(vars(policy).items()):
        if isinstance(value, SelectionPolicy):
            out[name] = {"name": type(value).__name__, "settings": policy_settings(value)}
        elif not name.startswith("_") and isinstance(value, plain):
            out[name] = value
    return out


def settings_as_saved(saved: dict, policy: SelectionPolicy) -> dict:
    """The settings a file records (`policy_settings` of the policy that wrote it), with any of `policy`'s class's
    `settings_before` that the file lacks: a setting added after the file was written (`LandmarkTopK`'s
    `landmark_format`) had then the value `settings_before` names, whatever its default is now."""
    current = policy_settings(policy)
    out = {name: value for name, value in type(policy).settings_before.items() if name in current}
    out.update(saved)
    for name, inner in vars(policy).items():  # the policies it wraps, as `policy_settings` records them
        entry = out.get(name)
        if isinstance(inner, SelectionPolicy) and isinstance(entry, dict) and isinstance(entry.get("settings"), dict):
            out[name] = {**entry, "settings": settings_as_saved(entry["settings"], inner)}
    return out


def yakv_quantizers(config: ShadowKVConfig, policy: SelectionPolicy, head_dim: int) -> dict[str, HiggsQuantizer]:
    """`{"host": ..., "score": ...}`: the HIGGS quantisers that encode a YAKV prompt's host records and the policy's
    scoring state (that of the policy, or of a policy it wraps, with a `quantizer`); `{}` in ShadowKV mode."""
    if config.mode != "yakv":
        return {}
    out = {"host": HiggsQuantizer(head_dim, config.host_grid_dim)}
    wrapped = [policy, *(v for v in vars(policy).values() if isinstance(v, SelectionPolicy))]
    scorer = next((p.quantizer for p in wrapped if callable(getattr(p, "quantizer", None))), None)
    if scorer is not None:
        out["score"] = scorer(head_dim)
    return out


def write_prefix(
    path,
    model,
    config: ShadowKVConfig,
    policy: SelectionPolicy,
    token_ids: torch.Tensor,
    layers,
    windows: list[int | None],
    key: bytes | None = None,
) -> None:
    """Save a one-row prefix to `path`, atomically; with `key` (bytes), every digest is an HMAC-SHA256 under it.

    Args:
        layers: per layer `(prompt, keys, values, seen)`: the compressed prompt or None, the exact keys and values
            `[1, Hkv, G, D]` (a short document, a sliding layer's window, none after a prompt), and the tokens the
            layer has seen.
        windows: per layer the sliding window, or None (`sliding_windows` of the model's config).
    """
    path = Path(path)
    if path.is_dir() or not path.parent.is_dir():
        raise PrefixCacheError(
            f"save_prefix writes one file, and {str(path)!r} "
            f"{'is a directory' if path.is_dir() else 'is in a folder that does not exist'}: pass a file path in an "
            "existing folder, e.g. 'doc.safetensors'."
        )
    key = integrity.check_key_option(key)
    length = len(token_ids)
    dims = model_dims(model)
    dtype, _ = kv_dtype_and_devices(model, dims[0])
    for i, (prompt, keys, _, seen) in enumerate(layers):
        rows = 0 if keys is None else keys.shape[0]
        if keys is None or rows != 1 or seen != length:
            raise PrefixCacheError(
                f"save_prefix needs a one-row cache that holds exactly the {length}-token document; layer {i} "
                f"holds {seen if keys is not None else 0} tokens in {rows} row(s). Prefill the document "
                "alone (ShadowKVCache.prefill(model, ids)) and save before generating."
            )
        if prompt is not None and keys is not None and keys.shape[2]:
            raise PrefixCacheError(
                f"save_prefix saves a document as its prefill left it; layer {i} holds {keys.shape[2]} tokens after "
                "its compressed prompt (generated tokens or a new turn). Prefill the document alone "
                "(ShadowKVCache.prefill(model, ids)) and save before generating."
            )
    tensors = {"token_ids": token_ids}
    for i, (prompt, keys, values, _) in enumerate(layers):
        tensors |= layer_tensors(i, prompt, keys, values)
    tensors = {k: v[:1].contiguous() if k != "token_ids" else v.contiguous() for k, v in tensors.items()}
    prompts = [prompt for prompt, *_ in layers if prompt is not None]
    policy_state = prompts[0].policy_state if prompts else {}
    policy_specs = {name: (tuple(t[:1].shape), t.dtype) for name, t in policy_state.items()}
    ranks = [prompt.a.shape[-1] if isinstance(prompt, CompressedPrompt) else 0 for prompt, *_ in layers]
    expected = expected_tensors(dims, config, length, dtype, policy_specs, ranks, windows)
    check_specs({k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}, expected, "this cache")
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    if needed > free:
        raise PrefixCacheError(
            f"The prefix needs {format_bytes(needed)} but {path.parent} has {format_bytes(free)} free; free some space "
            "or save elsewhere."
        )
    tensors = {k: v.to("cpu") for k, v in tensors.items()}  # once: digests and the writer read the same bytes
    bad = [name for name, t in tensors.items() if integrity.non_finite(t)]
    if bad:
        raise PrefixCacheError(
            f"This cache holds NaN or inf in {bad[:4]}: the model produced non-finite keys or values (an fp16 "
            "overflow?), and a file of them would give NaN logits. Prefill the document again (e.g. in bf16 or fp32)."
        )
    token_hash = token_ids_sha256(token_ids)
    meta = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "model": model_identity(model),
        "shadowkv_config": dataclasses.asdict(config),
        "policy": {
            "name": type(policy).__name__,
            "settings": policy_settings(policy),
            "state": {
                n: {"shape": list(s), "dtype": str(d).removeprefix("torch.")} for n, (s, d) in policy_specs.items()
            },
        },
        "prefix_length": length,
        "token_ids_sha256": token_hash,
        "kv_dtype": str(dtype).removeprefix("torch."),
        "value_codec": value_codec(config.value_format, dims[2]).identity(),
        "quantizers": {k: q.identity() for k, q in yakv_quantizers(config, policy, dims[2]).items()},
        "layers": layer_kinds(windows, config, length, dims[1] * dims[2]),
        "ranks": ranks,
        integrity.FIELD: {
            "algorithm": integrity.KEYED if key is not None else integrity.UNKEYED,
            "tensors": integrity.tensor_digests(key, token_hash, tensors),
        },
    }
    meta[integrity.FIELD]["header"] = integrity.header_digest(key, meta)
    _remove_stale(path.parent)
    tmp = _create_temporary(path)
    try:
        mode = tmp.stat().st_mode & 0o777  # 0666 less the umask, as the kernel applied it to our own creation
        save_file(tensors, tmp, metadata={METADATA_KEY: json.dumps(meta, sort_keys=True)})
        os.chmod(tmp, mode)  # safetensors writes its files 0600
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old file or the new one, never half of one
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def format_bytes(n: int) -> str:
    """`n` bytes in the largest binary unit that keeps it >= 1 (B, KiB, MiB, GiB, TiB), 3 significant digits."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.3g} {unit}"


def _create_temporary(path: Path) -> Path:
    """A new empty file beside `path` whose name records this writer's pid, created with mode 0666 so that the umask
    gives it the usual permissions (`tempfile.mkstemp` makes 0600 files, and the renamed file would stay private)."""
    while True:
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}{_TMP_SUFFIX}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return tmp


def _remove_stale(folder: Path) -> None:
    """Delete this library's temporary files in `folder` left by writers that died (`kill -9` mid-save): their pid
    is not a live process here and they have not changed for `STALE_AFTER_S`. Other files are never touched."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    now = time.time()
    for entry in entries:
        match = _TMP_NAME.match(entry.name)
        if match is None or not entry.is_file(follow_symlinks=False):
            continue
        try:
            os.kill(int(match["pid"]), 0)
            continue  # alive (or reused by another process): not ours to judge
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError, ValueError):
            continue  # a live process of another user, or not a pid
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime >= STALE_AFTER_S:
                os.unlink(entry.path)
        except OSError:
            continue
