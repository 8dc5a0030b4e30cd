"""The tensors of a prefix file: their names, shapes and dtypes for a model, config and prefix length, and the layer
state they hold.

Legend: S prefix tokens, L layers, Hkv KV heads, D head dim, c chunk size, C chunks, Tc = C*c compressed
tokens, R rank, O outlier chunks, W local-window tokens, P payload elements per value vector, N quantised tokens
(YAKV), E bytes of one YAKV record, V a sliding layer's window.

Each layer is of one kind (`layer_kinds`): "compressed" (ShadowKV), "quantized" (YAKV), "exact" (a document shorter
than `min_compress_len`) or "sliding" (a sliding-window layer: its last `V - 1` tokens, exact).
"""

from __future__ import annotations

import torch

from ..config import ShadowKVConfig
from ..shadowkv.prompt import CompressedPrompt
from ..stores.quantized_store import QuantizedKVStore, record_bytes
from ..stores.value_codecs import value_codec
from ..stores.value_store import HostValueStore
from ..yakv.prompt import QuantizedPrompt
from .errors import PrefixCacheError

__all__ = [
    "DTYPES_BY_NAME",
    "ST_DTYPES",
    "Spec",
    "check_specs",
    "check_structure",
    "dtype_name",
    "expected_tensors",
    "layer_kinds",
    "layer_tensors",
    "read_layer",
    "sliding_held",
]

ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.bool: "BOOL",
    torch.uint8: "U8",  # 4-bit value codes, two per byte
    torch.float8_e4m3fn: "F8_E4M3",  # fp8 value codes
    torch.int8: "I8",  # int8 landmark codes
}
DTYPES_BY_NAME = {str(dt).removeprefix("torch."): dt for dt in ST_DTYPES}
Spec = tuple[tuple[int, ...], torch.dtype]  # (shape, dtype) of one stored tensor


def sliding_held(window: int, length: int) -> int:
    """Tokens a sliding layer of window `window` holds after `length` tokens (Transformers keeps the last
    `window - 1`: with the next token they make the window)."""
    return min(length, window - 1)


def layer_kinds(windows: list[int | None], config: ShadowKVConfig, length: int, key_dim: int) -> list[str]:
    """Each layer's kind for a document of `length` tokens: "sliding" where `windows[i]` is a sliding window, else
    "exact" when the config keeps the document exact, else "quantized" (YAKV) or "compressed" (ShadowKV)."""
    compressed = config.resolve(length, key_dim).num_chunks > 0
    kind = ("quantized" if config.mode == "yakv" else "compressed") if compressed else "exact"
    return ["sliding" if window is not None else kind for window in windows]


def expected_tensors(
    dims,
    config: ShadowKVConfig,
    length: int,
    dtype,
    policy_specs: dict[str, Spec],
    ranks: list[int],
    windows: list[int | None],
) -> dict[str, Spec]:
    """`{name: (shape, dtype)}` of every tensor a file for this model, config and prefix length must hold, with the
    key factors of layer `i` of rank `ranks[i]` and the sliding windows `windows` (`None` for other layers)."""
    num_layers, heads, dim = dims
    sizes = config.resolve(length, heads * dim)
    specs: dict[str, Spec] = {"token_ids": ((length,), torch.int64)}
    for i, kind in enumerate(layer_kinds(windows, config, length, heads * dim)):
        p = f"layers.{i}."
        if kind in ("exact", "sliding"):  # a short document, or a sliding layer's window, stays exact
            held = length if kind == "exact" else sliding_held(windows[i], length)
            specs[p + "keys"] = specs[p + "values"] = ((1, heads, held, dim), dtype)
            continue
        specs |= {f"{p}policy.{name}": spec for name, spec in policy_specs.items()}
        local = sizes.local
        if kind == "quantized":
            num = sizes.num_chunks  # YAKV: quantised tokens
            specs |= {
                p + "real": ((1, num), torch.bool),
                p + "budget_tokens": ((1,), torch.int64),
                p + "local_keys": ((1, heads, local, dim), dtype),
                p + "local_values": ((1, heads, local, dim), dtype),
                p + "local_valid": ((1, local), torch.bool),
                p + "host_records": ((1, heads, num, record_bytes(dim // config.host_grid_dim)), torch.uint8),
            }
            continue
        c, chunks, rank = config.chunk_size, sizes.num_chunks, ranks[i]
        out = sizes.outliers * c
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
    return specs


def layer_tensors(
    i: int, prompt: CompressedPrompt | QuantizedPrompt | None, keys: torch.Tensor, values: torch.Tensor
) -> dict:
    """The tensors of layer `i` (row 0 of the host stores; the caller keeps row 0 of the rest): the exact `keys` and
    `values` of an exact or sliding layer, else the prompt's per-row fields, policy state and host store."""
    p = f"layers.{i}."
    if prompt is None:
        return {p + "keys": keys, p + "values": values}
    out = {p + name: getattr(prompt, name) for name in prompt.ROW_FIELDS}
    out |= {f"{p}policy.{name}": t for name, t in prompt.policy_state.items()}
    if isinstance(prompt, QuantizedPrompt):
        out[p + "host_records"] = prompt.store.data[prompt.store.row_map[:1]]
        return out
    store = prompt.values  # saved as stored (encoded), so a load decodes exactly what this cache decodes
    out[p + "host_values"] = store.data[store.row_map[:1]]
    if store.scales is not None:
        out[p + "host_value_scales"] = store.scales[store.row_map[:1]]
    return out


def check_specs(found: dict[str, Spec], expected: dict[str, Spec], where: str) -> None:
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    if missing or extra:
        raise PrefixCacheError(
            f"{where} does not hold the tensors a prefix of this model and config has: missing {missing[:4]}, "
            f"unexpected {extra[:4]}."
        )
    for name, (shape, dtype) in expected.items():
        if found[name] != (shape, dtype):
            raise PrefixCacheError(
                f"{where}: tensor {name} is {list(found[name][0])} {dtype_name(found[name][1])}, expected "
                f"{list(shape)} {dtype_name(dtype)}."
            )


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")  # a torch dtype, or a safetensors name we do not map (e.g. F64)


def check_structure(tensors: dict, i: int, kind: str, sizes, path) -> None:
    """A document prefix has fixed structure: every quantised, outlier and local slot real; for ShadowKV positions
    0..Tc-1 and C-O selectable chunks per head; the budget of its config. A file that says otherwise is damaged."""
    if kind not in ("compressed", "quantized"):
        return
    p = f"layers.{i}."

    def all_true(name: str) -> bool:
        return bool(tensors[p + name].view(torch.uint8).eq(1).all())

    if kind == "quantized":
        structure_ok = (
            all_true("real") and all_true("local_valid") and int(tensors[p + "budget_tokens"][0]) == sizes.budget_chunks
        )
    else:
        t = {name: tensors[p + name] for name in CompressedPrompt.ROW_FIELDS}
        structure_ok = (
            torch.equal(t["positions"][0], torch.arange(t["positions"].shape[1]))
            and int(t["budget_chunks"][0]) == sizes.budget_chunks
            and all_true("outlier_valid")
            and all_true("local_valid")
            and bool(t["selectable"].view(torch.uint8).le(1).all())
            and bool(t["selectable"].sum(-1).eq(sizes.num_chunks - sizes.outliers).all())
        )
    if not structure_ok:
        raise PrefixCacheError(f"{path}: layer {i} does not hold a document prefix's positions and masks (damaged).")


def read_layer(
    tensors: dict, i: int, kind: str, device: torch.device, config: ShadowKVConfig, sizes, budget: int, length: int
):
    """One layer's `(prompt, keys, values)` from the checked `tensors`; `sizes` are the saved config's, `budget` the
    chunks (YAKV: tokens) to select now, `length` the document's tokens."""
    p = f"layers.{i}."
    if kind in ("exact", "sliding"):
        return None, tensors[p + "keys"].to(device, copy=True), tensors[p + "values"].to(device, copy=True)
    policy_state = {
        k.removeprefix(p + "policy."): v.to(device, copy=True)
        for k, v in tensors.items()
        if k.startswith(p + "policy.")
    }
    pin = config.pin_memory and device.type == "cuda"
    if kind == "quantized":
        prompt = QuantizedPrompt(
            policy_state=policy_state,
            real=tensors[p + "real"].to(device, copy=True),
            budget_tokens=torch.tensor([budget], device=device),
            local_keys=tensors[p + "local_keys"].to(device, copy=True),
            local_values=tensors[p + "local_values"].to(device, copy=True),
            local_valid=tensors[p + "local_valid"].to(device, copy=True),
            store=QuantizedKVStore.from_records(tensors[p + "host_records"], pin, device, config.device_record_share),
            slots=length,
            max_budget_tokens=budget,
        )
    else:
        t = {name: tensors[p + name] for name in CompressedPrompt.ROW_FIELDS}
        t["budget_chunks"] = torch.tensor([budget])
        codec = value_codec(config.value_format, t["b"].shape[-1])  # the file's format: checked to be the config's
        prompt = CompressedPrompt(
            **{name: v.to(device, copy=True) for name, v in t.items()},
            policy_state=policy_state,
            values=HostValueStore.from_encoded(
                tensors[p + "host_values"],
                tensors[p + "host_value_scales"] if codec.scale_dtype is not None else None,
                codec,
                pin=pin,
            ),
            chunk_size=config.chunk_size,
            slots=sizes.num_chunks * config.chunk_size + sizes.local,
            max_budget_chunks=budget,
        )
    empty = prompt.local_keys[:, :, :0]
    return prompt, empty, empty.clone()
