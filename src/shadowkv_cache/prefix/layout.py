"""The tensors of a prefix file: their names, shapes and dtypes for a model, config and prefix length.

Legend: S prefix tokens, L layers, Hkv KV heads, D head dim, c chunk size, C chunks, Tc = C*c compressed
tokens, R rank, O outlier chunks, W local-window tokens, P payload elements per value vector.
"""

from __future__ import annotations

import torch

from ..config import ShadowKVConfig
from ..shadowkv.prompt import CompressedPrompt
from ..stores.value_codecs import value_codec
from .errors import PrefixCacheError

__all__ = [
    "DTYPES_BY_NAME",
    "ST_DTYPES",
    "Spec",
    "check_specs",
    "check_structure",
    "dtype_name",
    "expected_tensors",
    "layer_tensors",
]

ST_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.bool: "BOOL",
    torch.uint8: "U8",  # 4-bit value codes, two per byte
    torch.float8_e4m3fn: "F8_E4M3",  # fp8 value codes
}
DTYPES_BY_NAME = {str(dt).removeprefix("torch."): dt for dt in ST_DTYPES}
Spec = tuple[tuple[int, ...], torch.dtype]  # (shape, dtype) of one stored tensor


def expected_tensors(
    dims, config: ShadowKVConfig, length: int, dtype, policy_specs: dict[str, Spec], ranks: list[int]
) -> dict[str, Spec]:
    """`{name: (shape, dtype)}` of every tensor a file for this model, config and prefix length must hold, with the
    key factors of layer `i` of rank `ranks[i]`."""
    num_layers, heads, dim = dims
    sizes = config.resolve(length, heads * dim)
    specs: dict[str, Spec] = {"token_ids": ((length,), torch.int64)}
    for i in range(num_layers):
        p = f"layers.{i}."
        if not sizes.num_chunks:  # a short document stays exact
            specs[p + "keys"] = specs[p + "values"] = ((1, heads, length, dim), dtype)
            continue
        c, chunks, rank = config.chunk_size, sizes.num_chunks, ranks[i]
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


def layer_tensors(i: int, prompt: CompressedPrompt | None, keys: torch.Tensor, values: torch.Tensor) -> dict:
    p = f"layers.{i}."
    if prompt is None:
        return {p + "keys": keys, p + "values": values}
    out = {p + name: getattr(prompt, name) for name in CompressedPrompt.ROW_FIELDS}
    out |= {f"{p}policy.{name}": t for name, t in prompt.policy_state.items()}
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


def check_structure(tensors: dict, i: int, sizes, path) -> None:
    """A document prefix has fixed structure: positions 0..Tc-1, every outlier and local slot real, C-O selectable
    chunks per head, the budget of its config. A file that says otherwise is damaged."""
    if not sizes.num_chunks:
        return
    t = {name: tensors[f"layers.{i}.{name}"] for name in CompressedPrompt.ROW_FIELDS}
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
