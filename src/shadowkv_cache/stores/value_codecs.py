"""How the host value store encodes the offloaded values (`ShadowKVConfig.value_format`).

Legend: D head dim, P payload elements per value vector.

A codec turns value vectors `[..., D]` into a payload `[..., P]` plus, for the quantised formats, one scale
per vector `[...]`, and back. The store keeps both in its chunk-major layout, so a fetch moves one block of
payload and its scales. Decoding is defined here (PyTorch); the CUDA kernels in `kernels/gather_values.cu`
do the same arithmetic while they read pinned host memory.

- `native`: the KV dtype unchanged (16 bits per value in bf16).
- `fp8`: float8 e4m3 with one bf16 scale per vector, `absmax / 448`: `8 + 16/D` bits per value. Each value
  is off by at most 2^-4 of itself (3 mantissa bits, round to nearest) or 2^-10 of the scale (the
  subnormal step), whichever is larger.
- `higgs4`: the project's HIGGS quantiser (`quant/higgs.py`) with a 2-D grid: signed Hadamard rotation, one
  uint8 code per pair of rotated coordinates and one fp16 norm per vector, `4 + 16/D` bits per value; the
  relative squared error of a vector is about the grid's distortion (~0.012). D must be a power of two.
"""

from __future__ import annotations

import functools

import torch

from ..quant.higgs import HiggsQuantizer, QuantizedVectors

__all__ = ["Fp8Codec", "Higgs4Codec", "NativeCodec", "ValueCodec", "check_value_format", "value_codec"]

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


class ValueCodec:
    """Encode value vectors `[..., D]` to `(payload [..., P], scales [...] or None)` and back."""

    name: str = ""
    payload_dtype: torch.dtype | None = None  # None: the KV dtype
    scale_dtype: torch.dtype | None = None  # None: no scales

    def __init__(self, head_dim: int):
        self.head_dim = head_dim

    @property
    def payload_dim(self) -> int:
        return self.head_dim

    def encode(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Values `[..., D]` in `dtype`, on the payload's device."""
        raise NotImplementedError

    def prepare(self, device: torch.device) -> None:
        """Copy what decoding on `device` needs there now, so that no decode step waits for a host copy."""

    def bits_per_value(self, kv_dtype: torch.dtype) -> float:
        """Host bits per stored value, scales included."""
        payload = torch.empty((), dtype=self.payload_dtype or kv_dtype).element_size() * 8 * self.payload_dim
        scale = torch.empty((), dtype=self.scale_dtype).element_size() * 8 if self.scale_dtype else 0
        return (payload + scale) / self.head_dim

    def identity(self) -> dict:
        """What a prefix file records so that a reader decodes the payload as it was encoded (JSON)."""
        return {"name": self.name, "head_dim": self.head_dim}

    def matches(self, saved: dict) -> bool:
        """Whether payloads encoded by the codec of `identity() == saved` decode correctly with this one."""
        return saved == self.identity()


class NativeCodec(ValueCodec):
    """The KV dtype unchanged."""

    name = "native"

    def encode(self, values: torch.Tensor) -> tuple[torch.Tensor, None]:
        return values, None

    def decode(self, payload: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return payload.to(dtype)


class Fp8Codec(ValueCodec):
    """float8 e4m3 codes with one bf16 scale (`absmax / 448`) per vector."""

    name = "fp8"
    payload_dtype = FP8
    scale_dtype = torch.bfloat16

    def encode(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = values.float()
        scale = (x.abs().amax(dim=-1) / FP8_MAX).to(self.scale_dtype)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero vector encodes as zeros
        # Divided by the stored (rounded) scale, so the scale's rounding costs nothing but a clamp of <= 2^-8.
        codes = (x / scale.float()[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        return codes, scale

    def decode(self, payload: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return (payload.float() * scales.float()[..., None]).to(dtype)


class Higgs4Codec(ValueCodec):
    """HIGGS codes on a 2-D grid (one uint8 per pair of rotated coordinates) and one fp16 norm per vector."""

    name = "higgs4"
    payload_dtype = torch.uint8
    scale_dtype = torch.float16
    GRID_DIM, SEED = 2, 0

    def __init__(self, head_dim: int):
        super().__init__(head_dim)
        self.quantizer = HiggsQuantizer(head_dim, grid_dim=self.GRID_DIM, seed=self.SEED)
        # The rotation is diag(signs) @ H / sqrt(D); its first column, times sqrt(D), is the signs.
        self.signs = self.quantizer.rotate(torch.eye(head_dim))[:, 0].sign().contiguous()  # [D] float32
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def payload_dim(self) -> int:
        return self.head_dim // self.GRID_DIM

    def encode(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The quantiser's own definition, through one fused kernel on CUDA: its matmul-and-argmin search was 2.6 s of a
        # 15.2 s prefill at 128K on the Llama-3.1-8B shape (an H100 machine, `prefill_profile_128k`). Imported here:
        # the ops package imports this module.
        from ..ops.quantize_higgs import quantize_vectors

        packed = quantize_vectors(self.quantizer, values)
        return packed.codes, packed.norms

    def decode(self, payload: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        return self.quantizer.dequantize(QuantizedVectors(payload, scales), dtype)

    def prepare(self, device: torch.device) -> None:
        self.tables(device)
        self.quantizer.dequantize(  # caches the quantiser's own grid and rotation on the device
            QuantizedVectors(torch.zeros(1, self.payload_dim, dtype=torch.uint8, device=device),
                             torch.zeros(1, dtype=torch.float16, device=device))
        )  # fmt: skip

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The grid `[256, 2]` and the signs `[D]` (float32) on `device`, copied once, for the kernel."""
        if device not in self._on_device:
            self._on_device[device] = (self.quantizer.grid.to(device).contiguous(), self.signs.to(device))
        return self._on_device[device]

    def identity(self) -> dict:
        return {"name": self.name, **self.quantizer.identity()}

    def matches(self, saved: dict) -> bool:
        rest = {k: v for k, v in saved.items() if k != "name"}
        return saved.get("name") == self.name and self.quantizer.matches(rest)


_CODECS: dict[str, type[ValueCodec]] = {c.name: c for c in (NativeCodec, Fp8Codec, Higgs4Codec)}


def check_value_format(name: str, head_dim: int) -> None:
    """Raise `ValueError` when `name` cannot encode values of `head_dim` (before any state changes)."""
    if name not in _CODECS:
        raise ValueError(f"value_format={name!r} is unknown; use one of {', '.join(map(repr, _CODECS))}.")
    if name == "higgs4" and (head_dim < 2 or head_dim & (head_dim - 1)):
        raise ValueError(
            f"value_format='higgs4' needs a power-of-two head dim (its Hadamard rotation); this model's is "
            f"{head_dim}. Use value_format='fp8'."
        )


@functools.cache
def value_codec(name: str, head_dim: int) -> ValueCodec:
    """The codec of format `name` for vectors of `head_dim` (one instance per format and size)."""
    check_value_format(name, head_dim)
    return _CODECS[name](head_dim)
