"""A model's identity in a prefix file: what must match for a saved document's keys and values to be this model's.

Legend: S prefix tokens.
"""

from __future__ import annotations

import hashlib
import json

import torch
from torch import nn

from .errors import PrefixCacheError

__all__ = ["canonical_json", "kv_dtype_and_devices", "model_dims", "model_identity", "token_ids_sha256"]

# Config entries that do not change the keys and values a model computes.
_VOLATILE_CONFIG_KEYS = {
    "architectures", "bos_token_id", "dtype", "eos_token_id", "id2label", "label2id", "output_attentions",
    "output_hidden_states", "pad_token_id", "problem_type", "return_dict", "torch_dtype", "transformers_version",
    "use_cache",
}  # fmt: skip


def token_ids_sha256(ids: torch.Tensor) -> str:
    """SHA-256 of the ids as little-endian int64 (`[S]`)."""
    return hashlib.sha256(ids.to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes()).hexdigest()


def canonical_json(obj) -> str:
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
    config = json.loads(canonical_json(config))  # plain JSON, as it reads back from a file
    weights = hashlib.sha256()
    projections = _first_kv_projections(model)
    for name, param in projections:
        tensor = param.detach().to("cpu").contiguous()
        weights.update(canonical_json([name, str(tensor.dtype), list(tensor.shape)]).encode())
        weights.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return {
        "model_type": text_config.model_type,
        "config": config,
        "config_sha256": hashlib.sha256(canonical_json(config).encode()).hexdigest(),
        "weights": [name for name, _ in projections],
        "weights_sha256": weights.hexdigest(),
    }


def model_dims(model: nn.Module) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of the model's text config."""
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, text.num_key_value_heads, head_dim


def kv_dtype_and_devices(model: nn.Module, num_layers: int) -> tuple[torch.dtype, list[torch.device]]:
    """The dtype keys and values come in (that of `k_proj`), and the device of each layer's attention."""
    devices = {}
    for module in model.modules():
        if hasattr(module, "layer_idx") and isinstance(getattr(module, "k_proj", None), nn.Module):
            devices[module.layer_idx] = module.k_proj.weight.device
    dtype = _first_kv_projections(model)[0][1].dtype
    fallback = next(iter(devices.values()), torch.device("cpu"))
    return dtype, [devices.get(i, fallback) for i in range(num_layers)]
