"""A model's identity in a prefix file: what must match for a saved document's keys and values to be this model's.

Legend: S prefix tokens, L layers.

The keys and values of layer `i` are a function of the token ids, the config and every weight they pass through on
the way: the input embeddings and every parameter of layers `0..i` (norms, q/k/v/o projections, MLP, per-head
norms). So the identity hashes the config and all of those for `i = L-1`: the embeddings and every parameter of
decoder layers `0..L-1`, but not the final norm or the LM head, which come after the last layer's keys and values.
Hashing is streamed (a tensor at a time, device tensors in 64 MiB pieces), and its result is kept per model object
until a hashed parameter changes (`model_identity`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from ..model_keys import key_dims, key_projection
from ..placement import attention_devices
from .errors import PrefixCacheError

__all__ = [
    "WEIGHTS_COVERED",
    "canonical_json",
    "config_identity",
    "forget_model_identity",
    "hash_tensor_into",
    "identity_weights",
    "kv_dtype_and_devices",
    "model_dims",
    "model_identity",
    "parallel_map",
    "token_ids_sha256",
]

# Config entries that do not change the keys and values a model computes.
_VOLATILE_CONFIG_KEYS = {
    "architectures", "bos_token_id", "dtype", "eos_token_id", "id2label", "label2id", "output_attentions",
    "output_hidden_states", "pad_token_id", "problem_type", "return_dict", "torch_dtype", "transformers_version",
    "use_cache",
}  # fmt: skip
WEIGHTS_COVERED = "input embeddings and every parameter of decoder layers 0..L-1 (not the final norm or LM head)"
_PIECE = 64 * 2**20  # bytes of a device tensor copied to the host at a time while hashing


def token_ids_sha256(ids: torch.Tensor) -> str:
    """SHA-256 of the ids as little-endian int64 (`[S]`)."""
    return hashlib.sha256(ids.to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes()).hexdigest()


def canonical_json(obj) -> str:
    return json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))


def hash_tensor_into(digest, tensor: torch.Tensor) -> None:
    """Feed `tensor`'s raw bytes (native byte order, row-major) to `digest` (a `hashlib`/`hmac` object) without
    copying a host tensor, and a device tensor in pieces of at most 64 MiB."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        digest.update(memoryview(flat.numpy()))
        return
    for start in range(0, flat.numel(), _PIECE):
        digest.update(memoryview(flat[start : start + _PIECE].cpu().numpy()))


def parallel_map(fn: Callable, items: Iterable) -> list:
    """`[fn(item) for item in items]`, spread over threads: hashlib releases the GIL while it hashes a large buffer,
    so digests of many tensors use every core (results in the order of `items`)."""
    items = list(items)
    workers = min(len(items), os.cpu_count() or 1, 16)
    if workers <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shadowkv-hash") as pool:
        return list(pool.map(fn, items))


def identity_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """`(name, parameter)` of everything that shapes the keys and values: the input embeddings and every parameter of
    each decoder layer, in the model's order (`named_parameters`, so a tied weight counts once)."""
    text = model.config.get_text_config()
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    layers = _decoder_layers(model, text.num_hidden_layers)
    owners = {id(p) for p in embeddings.parameters()} if embeddings is not None else set()
    for layer in layers:
        owners |= {id(p) for p in layer.parameters()}
    weights = [(name, p) for name, p in model.named_parameters() if id(p) in owners]
    if embeddings is None or not weights:
        raise PrefixCacheError(f"{type(model).__name__} has no input embeddings and decoder layers to identify it by.")
    return weights


def _decoder_layers(model: nn.Module, num_layers: int) -> list[nn.Module]:
    """The model's decoder layers: the `ModuleList` of `num_layers` modules that hold its attention modules."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            if all(any(key_projection(m) is not None for m in layer.modules()) for layer in module):
                return list(module)
    raise PrefixCacheError(f"{type(model).__name__} has no list of {num_layers} decoder layers to identify it by.")


# model -> (what the cached identity was computed from, the identity); see `model_identity`.
_IDENTITIES: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, dict]] = weakref.WeakKeyDictionary()
_IDENTITIES_LOCK = threading.Lock()


def _weights_state(weights: list[tuple[str, torch.Tensor]]) -> tuple:
    # In-place writes to a parameter bump its version counter; a new tensor has another address, dtype or shape.
    return tuple((name, p.data_ptr(), p._version, p.dtype, tuple(p.shape), p.device) for name, p in weights)


def forget_model_identity(model: nn.Module | None = None) -> None:
    """Drop the identity kept for `model` (or for every model), so that the next save or load hashes its weights
    again. Needed only after writing weights in a way PyTorch does not count (through `.data`, numpy or DLPack)."""
    with _IDENTITIES_LOCK:
        if model is None:
            _IDENTITIES.clear()
        else:
            _IDENTITIES.pop(model, None)


def config_identity(model: nn.Module) -> dict:
    """The model's type, its text config as plain JSON (minus entries that do not change keys/values) and its hash."""
    text_config = model.config.get_text_config()
    config = {
        k: v for k, v in text_config.to_dict().items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS
    }
    config = json.loads(canonical_json(config))  # plain JSON, as it reads back from a file
    return {
        "model_type": text_config.model_type,
        "config": config,
        "config_sha256": hashlib.sha256(canonical_json(config).encode()).hexdigest(),
    }


def model_identity(model: nn.Module) -> dict:
    """`config_identity` plus SHA-256 digests of every weight that shapes the keys and values (`identity_weights`),
    one per tensor (`weights`) and one over all of them (`weights_sha256`).

    Hashing an 8B model's ~15 GB takes seconds, so the digests are kept per model object and computed again only when
    a hashed parameter changed: written in place through the parameter (its `_version` counter), or replaced (another
    address, dtype, shape or device). Writes PyTorch does not count (`param.data.copy_(...)`, numpy or DLPack views)
    are not seen: call `forget_model_identity(model)` after such a write.
    """
    weights = identity_weights(model)
    offloaded = [name for name, param in weights if param.is_meta]
    if offloaded:  # accelerate keeps offloaded weights elsewhere and puts them in place only during a forward
        raise PrefixCacheError(
            f"A prefix file identifies its model by the weights, but {len(offloaded)} of them ({offloaded[0]}, ...) "
            "are not in memory (on 'meta': offloaded by accelerate). Save and load prefixes with every decoder layer "
            "placed on a GPU or the CPU (design.md §11)."
        )
    state = _weights_state(weights)
    with _IDENTITIES_LOCK:
        kept = _IDENTITIES.get(model)
    if kept is not None and kept[0] == state:
        digests = kept[1]
    else:

        def digest(item: tuple[str, torch.Tensor]) -> str:
            name, param = item
            one = hashlib.sha256(canonical_json([name, str(param.dtype), list(param.shape)]).encode())
            hash_tensor_into(one, param)
            return one.hexdigest()

        per_tensor = dict(zip([name for name, _ in weights], parallel_map(digest, weights)))
        combined = hashlib.sha256()
        for name, hexdigest in per_tensor.items():
            combined.update(f"{name}:{hexdigest};".encode())
        digests = {"weights": per_tensor, "weights_sha256": combined.hexdigest()}
        with _IDENTITIES_LOCK:
            _IDENTITIES[model] = (state, digests)
    return {
        **config_identity(model),
        "weights_covered": WEIGHTS_COVERED,
        "weights": dict(digests["weights"]),
        "weights_sha256": digests["weights_sha256"],
    }


def model_dims(model: nn.Module) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the model's text config."""
    text = model.config.get_text_config()
    return text.num_hidden_layers, *key_dims(text)


def kv_dtype_and_devices(model: nn.Module, num_layers: int) -> tuple[torch.dtype, list[torch.device]]:
    """The dtype keys and values come in (that of the first layer's key projection), and the device each layer's
    attention runs on (its execution device where accelerate places or offloads it, design.md §11)."""
    weights = {}
    for module in model.modules():
        projection = key_projection(module)
        if projection is not None:
            weights[module.layer_idx] = projection.weight
    if not weights:
        raise PrefixCacheError(f"{type(model).__name__} has no key projection weights to take the keys' dtype from.")
    dtype = weights[min(weights)].dtype
    devices = attention_devices(model)
    fallback = devices[min(devices)]
    return dtype, [devices.get(i, fallback) for i in range(num_layers)]
