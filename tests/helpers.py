"""Shared helpers for the CPU test suite: tiny random models, generation wrappers, ShadowKV settings.

Legend: B batch, S prompt tokens, Hkv KV heads, D head dim, V vocab.

Every tiny model has 2 layers, hidden 64, 4 query heads over 2 KV heads (GQA), head dim 16
(so `Hkv*D = 32`), vocab 128, fp32, in eval mode, with seeded random weights. The tiny Gemma 3
(`gemma3_text`, not in `ARCHS`: only its full-attention layers are compressed) has 4 layers, sliding and
full attention alternating, a 16-token sliding window and `query_pre_attn_scalar` 32 (scaling 1/√32, not 1/√D).
Other architectures' settings (`_ARCH_CONFIG`): 4 alternating layers where the model mixes local and global
attention, 4 experts of width 32 for MoE MLPs, NoPE layers, soft-capping and clipping strong enough to matter.
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

from shadowkv_cache import ShadowKVCache, ShadowKVConfig
from shadowkv_cache.hf.layer import CompressedLayer
from shadowkv_cache.ops.rebuild_keys import rebuild_keys
from shadowkv_cache.shadowkv.prompt import CompressedPrompt

__all__ = [
    "ARCHS",
    "GEMMA3",
    "HEAD_DIM",
    "HIDDEN",
    "KEY_DIM",
    "NUM_KV_HEADS",
    "VOCAB",
    "assert_every_token_reachable_once",
    "assert_left_padded_rows_reachable",
    "assert_logits_close",
    "decoded_in_graphs",
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
# Four layers, local and global alternating (the global ones are compressed).
_ALTERNATING = {
    "num_hidden_layers": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "sliding_window": SLIDING_WINDOW,
}
# MoE MLPs: 4 small experts, 2 per token.
_EXPERTS = {"num_experts_per_tok": 2, "intermediate_size": 32}
# Per-architecture settings on top of the common ones: each one's distinctive attention switched on and made
# strong enough to matter at this size (a small soft-cap, clipping that clips, a non-default scaling).
_ARCH_CONFIG = {
    GEMMA3: {**_ALTERNATING, "query_pre_attn_scalar": 32},
    "gemma2": {**_ALTERNATING, "query_pre_attn_scalar": 32, "attn_logit_softcapping": 5.0},
    "vaultgemma": {**_ALTERNATING, "query_pre_attn_scalar": 32, "attn_logit_softcapping": 5.0},
    "gpt_oss": {**_ALTERNATING, **_EXPERTS, "num_local_experts": 4},  # attention sinks, YaRN RoPE
    "ministral": _ALTERNATING,
    "olmo3": _ALTERNATING,
    # Local and global alternating; the global layers have no RoPE.
    "exaone4": {"num_hidden_layers": 4, "sliding_window": SLIDING_WINDOW, "sliding_window_pattern": 2},
    "smollm3": {"num_hidden_layers": 4},  # the fourth layer has no RoPE (no_rope_layer_interval=4)
    # Mistral's default window (4096) makes every layer a sliding one; Mistral v0.2 and later have none.
    "mistral": {"sliding_window": None},
    "mixtral": {**_EXPERTS, "num_local_experts": 4},
    "phimoe": {**_EXPERTS, "num_local_experts": 4},
    # Granite's attention scaling is `attention_multiplier` (real checkpoints: 1/D); the default 1.0 would make
    # random logits 4x sharper than 1/sqrt(D) and fp32 round-off grow past the tests' tolerance.
    "granitemoe": {**_EXPERTS, "num_local_experts": 4, "attention_multiplier": 0.2},
    "olmoe": {**_EXPERTS, "num_experts": 4},
    "qwen2_moe": {**_EXPERTS, "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    "qwen3_moe": {**_EXPERTS, "num_experts": 4, "moe_intermediate_size": 32},
    "granitemoeshared": {
        **_EXPERTS,
        "num_local_experts": 4,
        "shared_intermediate_size": 32,
        "attention_multiplier": 0.2,
    },
    "flex_olmo": {**_EXPERTS, "num_experts": 4},
    "solar_open": {**_EXPERTS, "n_routed_experts": 4, "moe_intermediate_size": 32},
    # Local and global alternating, the global layers without RoPE; a dense first layer, then MoE.
    "exaone_moe": {
        **_EXPERTS,
        "num_hidden_layers": 4,
        "sliding_window": SLIDING_WINDOW,
        "sliding_window_pattern": 2,
        "num_experts": 4,
        "moe_intermediate_size": 32,
    },
    "afmoe": {**_ALTERNATING, **_EXPERTS, "num_experts": 4, "moe_intermediate_size": 32, "num_shared_experts": 1},
    "olmo": {"clip_qkv": 1.0},
    "granite": {"attention_multiplier": 0.2},  # scaling 0.2 instead of 1/sqrt(D)
    # RoPE layouts other than Llama's rotate-half over the whole head (test_rope_layouts.py). Per-head key norms
    # and biases on where the config offers them, so the recorded pre-RoPE keys include them.
    "phi": {"partial_rotary_factor": 0.5, "qk_layernorm": True},  # rotate-half on 8 of 16 dims
    "phi3": {},  # rotate-half on the whole head, fused qkv projection
    "stablelm": {"partial_rotary_factor": 0.25, "qk_layernorm": True, "use_qkv_bias": True},  # 4 of 16 dims
    # GPT-NeoX has no GQA (every query head has its keys): 4 KV heads, so Hkv*D = 64. Fused qkv, 4 of 16 dims.
    "gpt_neox": {"num_key_value_heads": NUM_HEADS, "partial_rotary_factor": 0.25},
    "glm": {"partial_rotary_factor": 0.5},  # interleaved pairs on 8 of 16 dims
    "glm4": {"partial_rotary_factor": 0.5},
    # MoE with partial rotary (half the head), a dense first layer and a shared expert; per-head q/k norms.
    "glm4_moe": {
        **_EXPERTS,
        "n_routed_experts": 4,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_shared_experts": 1,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
    },
    "ernie4_5": {},  # interleaved pairs on the whole head
    "ernie4_5_moe": {"moe_num_experts": 4, "moe_intermediate_size": 32, "moe_k": 2},
    # q/k RMSNorm over the whole projection before RoPE (as OLMo 2), partial rotary, MoE.
    "minimax_m2": {**_EXPERTS, "num_local_experts": 4, "partial_rotary_factor": 0.5},
    "cohere": {"use_qk_norm": True},  # interleaved pairs on the whole head
    # Sliding layers rotate (interleaved); the global layers apply no RoPE.
    "cohere2": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
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
    # Soft-capping needs eager attention: before Transformers 5.24 Gemma 2 defaulted to SDPA, which drops the cap, so
    # DynamicCache would be the reference of another model (ShadowKVCache applies the cap, as eager attention does).
    eager = {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", None) else {}
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **eager).eval()


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


def decoded_in_graphs(cache) -> bool:
    """Whether `cache`'s one-token steps ran as CUDA graphs: the whole step replayed (hf/step_graph.py), or, where the
    whole step cannot be captured (sliding-window layers, a model split over devices), every compressed layer's own
    step captured."""
    if cache.step_graphs.replays > 0:
        return True
    compressed = [layer for layer in cache.layers if layer.is_compressed]
    return bool(compressed) and all(layer._graph is not None for layer in compressed)


def assert_logits_close(actual, expected, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Per-step logits (tuples of `[B, V]`) equal within fp32 round-off: rtol 1e-4, and `atol` per unit of the
    largest expected logit. The round-off of keys rebuilt from full-rank factors grows with the logits' scale, so
    a logit near zero in a step whose logits reach 4 can differ by ~1e-5 (one seed on one CPU: 1.35e-5)."""
    assert len(actual) == len(expected), f"{len(actual)} steps vs {len(expected)}"
    actual, expected = torch.stack(list(actual)), torch.stack(list(expected))
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol * scale)


def assert_within_bf16_noise(actual: torch.Tensor, expected: torch.Tensor, steps: int = 4) -> None:
    """16-bit logits equal up to rounding noise: within `steps` bf16 eps (2^-7) times the largest expected logit.
    One rounding of a hidden state moves every logit by about its share of that scale, so a logit near zero moves as
    much as a large one: a per-element relative tolerance fails on rounding alone (the fused pieces' 0.44 at logits of
    ~35 over 32 SmolLM2 steps is under two bf16 steps there)."""
    actual, expected = actual.float(), expected.float()
    bound = steps * torch.finfo(torch.bfloat16).eps * expected.abs().max().item()
    diff = (actual - expected).abs().max().item()
    assert diff <= bound, f"max |difference| {diff:.4g} > {steps} bf16 steps at the logits' scale ({bound:.4g})"


def assert_every_token_reachable_once(
    prompt: CompressedPrompt,
    row: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    config: ShadowKVConfig,
    rope,
) -> None:
    """Check one row of a compressed prompt against its true post-RoPE `keys` / `values` (`[Hkv, n, D]`)."""
    heads, n, dim = keys.shape
    c = config.chunk_size
    size = config.resolve(n, heads * dim)
    covered = torch.zeros((heads, n), dtype=torch.int64)
    chunk_tokens = size.num_chunks * c

    # Chunks start at the row's first real token; their positions are the row's own positions 0..Tc-1.
    assert prompt.positions[row, :chunk_tokens].tolist() == list(range(chunk_tokens))
    assert not prompt.selectable[row, :, size.num_chunks :].any(), "a padding chunk is selectable"

    # Selectable chunks: keys rebuilt from the low-rank factors at their true positions, values from the host.
    hs, chunks = prompt.selectable[row].nonzero(as_tuple=True)
    if chunks.numel():
        rows = torch.full_like(chunks, row)
        rebuilt = rebuild_keys(prompt.a, prompt.b, prompt.positions, rows, hs, chunks, c, rope)  # [M, c, D]
        fetched = prompt.values.gather(rows, hs, chunks, torch.device("cpu"))  # [M, c, D]
        tokens = chunks[:, None] * c + torch.arange(c)  # [M, c]
        torch.testing.assert_close(rebuilt, keys[hs[:, None], tokens], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fetched, values[hs[:, None], tokens], rtol=0, atol=0)
        covered[hs[:, None], tokens] += 1

    # Outlier chunks: the real chunks that are not selectable, held exactly, each matching one true chunk.
    n_out = size.outliers * c
    assert int(prompt.outlier_valid[row].sum()) == n_out
    for h in range(heads if size.num_chunks else 0):
        out_chunks = sorted(set(range(size.num_chunks)) - set(prompt.selectable[row, h].nonzero().flatten().tolist()))
        assert len(out_chunks) == size.outliers
        if not out_chunks:
            continue
        held_k = prompt.outlier_keys[row, h, :n_out].reshape(size.outliers, c * dim)
        held_v = prompt.outlier_values[row, h, :n_out].reshape(size.outliers, c * dim)
        true_k = keys[h, :chunk_tokens].reshape(size.num_chunks, c * dim)
        true_v = values[h, :chunk_tokens].reshape(size.num_chunks, c * dim)
        match = (held_k[:, None] == true_k[None]).all(-1)  # [O, C]
        assert match.sum(-1).tolist() == [1] * size.outliers, "an outlier block is not exactly one true chunk"
        found = match.int().argmax(-1)
        assert sorted(found.tolist()) == out_chunks
        assert torch.equal(held_v, true_v[found])
        for chunk in out_chunks:
            covered[h, chunk * c : (chunk + 1) * c] += 1

    # Local window: the last tokens (ragged tail included), right-aligned and exact.
    window = prompt.local_valid.shape[1]
    assert int(prompt.local_valid[row].sum()) == size.local
    assert prompt.local_valid[row, window - size.local :].all()
    assert torch.equal(prompt.local_keys[row, :, window - size.local :], keys[:, n - size.local :])
    assert torch.equal(prompt.local_values[row, :, window - size.local :], values[:, n - size.local :])
    covered[:, n - size.local :] += 1

    assert (covered == 1).all(), f"tokens covered {covered.unique().tolist()} times; row {row}, n={n}"


def assert_left_padded_rows_reachable(
    model: torch.nn.Module, lengths: tuple[int, ...], overrides: dict, seed: int = 40
) -> ShadowKVCache:
    """Prefill left-padded random rows of `lengths` (positions as `generate` passes them) into a `ShadowKVCache` with
    `overrides` and into a `DynamicCache`: every compressed layer keeps none of the prompt's full K/V on the device
    and holds each row's real tokens exactly once (`assert_every_token_reachable_once`). Returns the cache."""
    rows = [random_prompt(n, seed=seed + i)[0] for i, n in enumerate(lengths)]
    ids, mask = left_pad(rows)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    config = ShadowKVConfig(**overrides)
    reference = dynamic_cache(model)
    forward_with(model, ids, reference, attention_mask=mask, position_ids=positions)
    cache = ShadowKVCache(model, **overrides)
    forward_with(model, ids, cache, attention_mask=mask, position_ids=positions)

    width = ids.shape[1]
    compressed = [(i, layer) for i, layer in enumerate(cache.layers) if isinstance(layer, CompressedLayer)]
    assert compressed, "no compressed layer"
    for i, layer in compressed:
        ref_layer = reference.layers[i]
        assert layer.is_compressed, f"layer {i} was not compressed"
        assert layer.get_seq_length() == width
        assert layer.keys.shape[2] == 0, f"layer {i} kept the prompt's full K/V on the device"
        for row, n in enumerate(lengths):
            keys, values = ref_layer.keys[row, :, width - n :], ref_layer.values[row, :, width - n :]
            assert_every_token_reachable_once(layer.prompt, row, keys, values, config, layer.mode.rope)
    return cache
