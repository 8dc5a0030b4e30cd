"""Shared helpers for the CPU test suite: tiny random models, generation wrappers, ShadowKV settings.

Legend: B batch, S prompt tokens, Hkv KV heads, D head dim, V vocab.

Every tiny model has 2 layers, hidden 64, 4 query heads over 2 KV heads (GQA), head dim 16
(so `Hkv*D = 32`), vocab 128, fp32, in eval mode, with seeded random weights. The tiny Gemma 3
(`gemma3_text`, not in `ARCHS`: only its full-attention layers are compressed) has 4 layers, sliding and
full attention alternating, a 16-token sliding window and `query_pre_attn_scalar` 32 (scaling 1/√32, not 1/√D).
The RoPE-layout architectures (`_ARCH_CONFIG`, test_rope_layouts.py) keep these sizes where the config allows;
GPT-NeoX has 4 KV heads (no GQA) and the tiny Cohere 2 has Gemma 3's four-layer mix.
"""

from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path

import torch

try:  # the package may not be installed in the venv; the tests then run against the source tree
    import shadowkv_cache  # noqa: F401
except ModuleNotFoundError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

__all__ = [
    "ARCHS",
    "GEMMA3",
    "HEAD_DIM",
    "HIDDEN",
    "KEY_DIM",
    "NUM_KV_HEADS",
    "VOCAB",
    "assert_logits_close",
    "dynamic_cache",
    "forward_with",
    "full_budget_overrides",
    "generate_with",
    "left_pad",
    "make_tiny_model",
    "random_prompt",
    "small_budget_overrides",
    "tiny_model",
]

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, VOCAB = 64, 4, 2, 16, 128
KEY_DIM = NUM_KV_HEADS * HEAD_DIM  # Hkv*D = 32: the largest rank
PAD = 0

# Random weights at the default init (0.02) give nearly uniform attention, where every landmark scores the
# same and a top-k choice hangs on round-off. A wider init gives peaked attention, closer to a real model.
INIT_RANGE = 0.15

GEMMA3 = "gemma3_text"
SLIDING_WINDOW = 16
# Per-architecture settings on top of the common ones.
_ARCH_CONFIG = {
    GEMMA3: {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "sliding_window": SLIDING_WINDOW,
        "query_pre_attn_scalar": 32,
    },
    # RoPE layouts other than Llama's rotate-half over the whole head (test_rope_layouts.py). Per-head key norms
    # and biases on where the config offers them, so the recorded pre-RoPE keys include them.
    "phi": {"partial_rotary_factor": 0.5, "qk_layernorm": True},  # rotate-half on 8 of 16 dims
    "phi3": {},  # rotate-half on the whole head, fused qkv projection
    "stablelm": {"partial_rotary_factor": 0.25, "qk_layernorm": True, "use_qkv_bias": True},  # 4 of 16 dims
    # GPT-NeoX has no GQA (every query head has its keys): 4 KV heads, so Hkv*D = 64. Fused qkv, 4 of 16 dims.
    "gpt_neox": {"num_key_value_heads": NUM_HEADS, "partial_rotary_factor": 0.25},
    "glm": {"partial_rotary_factor": 0.5},  # interleaved pairs on 8 of 16 dims
    "glm4": {"partial_rotary_factor": 0.5},
    "cohere": {"use_qk_norm": True},  # interleaved pairs on the whole head
    # Sliding layers rotate (interleaved); the global layers apply no RoPE.
    "cohere2": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "sliding_window": SLIDING_WINDOW,
    },
}


def make_tiny_model(arch: str, seed: int | None = None, **config_overrides) -> torch.nn.Module:
    """A fresh tiny random `*ForCausalLM` of `arch` (fp32, eval). Each arch gets its own default seed.

    `eos_token_id=None` so that greedy decoding on random weights never stops early (generation runs for
    exactly `max_new_tokens`); `pad_token_id=0` for left-padded batches (prompts never contain token 0).
    """
    seed = ARCHS.index(arch) if seed is None and arch in ARCHS else (seed or 0)
    kwargs = {
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "pad_token_id": PAD,
        "bos_token_id": None,
        "eos_token_id": None,
        "tie_word_embeddings": False,
        "initializer_range": INIT_RANGE,
        **_ARCH_CONFIG.get(arch, {}),
    }
    kwargs.update(config_overrides)
    config = AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@functools.cache
def tiny_model(arch: str) -> torch.nn.Module:
    """The shared tiny model of `arch` (one per test session; `ShadowKVCache` patches it in place)."""
    return make_tiny_model(arch)


def dynamic_cache(model: torch.nn.Module) -> DynamicCache:
    return DynamicCache(config=model.config)


def full_budget_overrides(**changes) -> dict:
    """Settings under which ShadowKV is exact (design.md §6): every chunk selectable fits the budget, full rank.

    Few outliers, a short local window and `min_compress_len` far below the test prompts (a few hundred
    tokens), so compression, selection and key rebuild all really run.
    """
    return {
        "rank": KEY_DIM,
        "sparse_budget": 10**6,
        "outlier_chunks": 2,
        "local_window": 16,
        "chunk_size": 8,
        "min_compress_len": 64,
        **changes,
    }


def small_budget_overrides(**changes) -> dict:
    """A real ShadowKV setting: 4 selected chunks (32 tokens) per KV head, rank 8 of 32, 2 outliers."""
    return {
        "rank": 8,
        "sparse_budget": 32,
        "outlier_chunks": 2,
        "local_window": 16,
        "chunk_size": 8,
        "min_compress_len": 64,
        **changes,
    }


def random_prompt(length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """`[B, S]` random token ids in `[1, V)` (never the pad id 0)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=gen)


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D id tensors into `input_ids` and `attention_mask` (`[B, max S]`)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    return ids, mask


def generate_with(model: torch.nn.Module, ids: torch.Tensor, cache, max_new_tokens: int = 16, **kwargs):
    """`model.generate` with `cache`, returning `sequences` and per-step `logits` (greedy unless told)."""
    kwargs.setdefault("do_sample", False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
        return model.generate(
            ids,
            past_key_values=cache,
            max_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )


def forward_with(model: torch.nn.Module, ids: torch.Tensor, cache, **kwargs):
    """One plain forward pass (a prefill) with `cache`, without the deprecation warning."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
        return model(ids, past_key_values=cache, use_cache=True, **kwargs)


def assert_logits_close(actual, expected, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Per-step logits (tuples of `[B, V]`) equal within fp32 round-off (rtol 1e-4)."""
    assert len(actual) == len(expected), f"{len(actual)} steps vs {len(expected)}"
    torch.testing.assert_close(torch.stack(list(actual)), torch.stack(list(expected)), rtol=rtol, atol=atol)
