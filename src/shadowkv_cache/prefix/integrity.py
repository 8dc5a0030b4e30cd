"""Integrity of a prefix file: a digest of every tensor bound to the document, a digest of the header, and finite
floats (docs/prefix_format.md, "Integrity").

Legend: S prefix tokens.

Each tensor's digest is SHA-256 over `[token_ids_sha256, name, dtype, shape]` (canonical JSON) followed by the
tensor's raw bytes, so a tensor moved from another document's file, or under another name, does not verify. The
header digest covers the whole metadata object but this digest itself (so also every tensor digest). Anyone can
recompute plain SHA-256 digests: they detect damage (a flipped bit, a truncated or mixed write), not a forger. With a
key, every digest is HMAC-SHA256 under that key instead, which only a holder of the key can make: that is
authenticity.
"""

from __future__ import annotations

import hashlib
import hmac

import torch

from .errors import PrefixCacheError, PrefixOptionError
from .identity import canonical_json, hash_tensor_into, parallel_map

__all__ = [
    "FIELD",
    "KEYED",
    "UNKEYED",
    "check_key_option",
    "check_seal",
    "digests_equal",
    "header_digest",
    "non_finite",
    "tensor_digest",
    "tensor_digests",
    "verify_tensors",
]

FIELD = "integrity"  # metadata field: {"algorithm", "tensors": {name: hex}, "header": hex}
UNKEYED, KEYED = "sha256", "hmac-sha256"
# Float dtypes whose NaN/inf a min/max reduction shows (it propagates NaN); fp8 e4m3 has NaN codes but no inf.
_REDUCIBLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_key_option(key: object) -> bytes | None:
    """`key` as bytes (or None), or `PrefixOptionError`."""
    if key is None:
        return None
    if isinstance(key, bytearray | memoryview):
        key = bytes(key)
    if not isinstance(key, bytes) or not key:
        raise PrefixOptionError(
            f"key must be non-empty bytes (an HMAC key, e.g. os.urandom(32)), got {type(key).__name__}."
        )
    return key


def _digest(key: bytes | None):
    return hmac.new(key, digestmod=hashlib.sha256) if key is not None else hashlib.sha256()


def tensor_digest(key: bytes | None, token_ids_sha256: str, name: str, tensor: torch.Tensor) -> str:
    """Hex digest of one tensor (`[...]`, host or device) of the document whose ids hash to `token_ids_sha256`."""
    digest = _digest(key)
    dtype = str(tensor.dtype).removeprefix("torch.")
    digest.update(canonical_json([token_ids_sha256, name, dtype, list(tensor.shape)]).encode())
    hash_tensor_into(digest, tensor)
    return digest.hexdigest()


def tensor_digests(key: bytes | None, token_ids_sha256: str, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """`{name: tensor_digest(...)}` of every tensor, hashed on several threads."""
    names = list(tensors)
    return dict(zip(names, parallel_map(lambda n: tensor_digest(key, token_ids_sha256, n, tensors[n]), names)))


def header_digest(key: bytes | None, meta: dict) -> str:
    """Hex digest of the metadata object `meta` but its own `integrity.header` entry (canonical JSON, so it is the
    same after a JSON round trip)."""
    integrity = meta.get(FIELD)
    rest = {k: v for k, v in integrity.items() if k != "header"} if isinstance(integrity, dict) else integrity
    digest = _digest(key)
    digest.update(canonical_json({**meta, FIELD: rest}).encode())
    return digest.hexdigest()


def digests_equal(a: object, b: str) -> bool:
    """Constant-time comparison (a keyed digest must not leak how many leading characters matched)."""
    return isinstance(a, str) and hmac.compare_digest(a.encode(), b.encode())


def non_finite(tensor: torch.Tensor) -> bool:
    """Whether a float tensor holds NaN or inf (False for integer and bool tensors)."""
    if tensor.numel() == 0:
        return False
    if tensor.dtype in _REDUCIBLE:
        low, high = torch.aminmax(tensor.reshape(-1))  # one pass, no full-size temporary; NaN propagates
        return not bool(torch.isfinite(low) & torch.isfinite(high))
    if tensor.dtype == torch.float8_e4m3fn:
        return bool((tensor.view(torch.uint8) & 0x7F).eq(0x7F).any())  # S.1111.111 is NaN; e4m3fn has no inf
    if tensor.is_floating_point():
        return not bool(torch.isfinite(tensor).all())
    return False


def check_seal(meta: dict, sealed: dict, key: bytes | None, path) -> None:
    """The file's integrity algorithm fits the key given (a signed file needs one, an unsigned file refuses one, so a
    forger cannot strip a signature), and with a key the header's HMAC matches: `PrefixCacheError` otherwise."""
    algorithm = sealed.get("algorithm")
    if algorithm == KEYED and key is None:
        raise PrefixCacheError(
            f"{path} is signed with a key (HMAC-SHA256); pass the same key: load_prefix(..., key=b'...')."
        )
    if algorithm == UNKEYED and key is not None:
        raise PrefixCacheError(
            f"{path} was saved without a key, so it cannot be authenticated with one; save it again with "
            "save_prefix(..., key=...), or load it without a key if you trust where it came from."
        )
    if algorithm not in (KEYED, UNKEYED):
        raise PrefixCacheError(f"{path}: unknown integrity algorithm {algorithm!r} in the metadata (damaged header).")
    if key is not None and not digests_equal(sealed.get("header"), header_digest(key, meta)):
        raise PrefixCacheError(
            f"{path}: the header's HMAC does not match under this key: a wrong key, or a file changed since it was "
            "signed. Nothing was loaded."
        )


def verify_tensors(tensors: dict, digests: dict, token_hash: str, key: bytes | None, path) -> None:
    """Every tensor's digest (bound to the document's ids hash and its name), then that float tensors are finite."""
    for name, digest in tensor_digests(key, token_hash, tensors).items():
        if not digests_equal(digests.get(name), digest):
            what = "its HMAC under this key" if key is not None else "its digest"
            raise PrefixCacheError(f"{path}: tensor {name} does not match {what} (damaged or changed file).")
    bad = [name for name, tensor in tensors.items() if non_finite(tensor)]
    if bad:
        raise PrefixCacheError(f"{path}: tensors {bad[:4]} hold NaN or inf; prefill the document again.")
