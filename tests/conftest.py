"""Shared fixtures. The real model loads once per session (fp32, CPU, eval mode, sdpa attention)."""

import pytest
import torch

from shadowkv_cache.embedded_models import load_smollm2


@pytest.fixture(scope="session")
def smollm2():
    """`(model, tokenizer)` of the embedded SmolLM2-135M-Instruct (30 layers, 9/3 heads, head dim 64).

    The first run on a machine converts the GGUF once (~20 s); later sessions load the cached safetensors
    folder in well under a second. Shared by the whole session: a test that patches the model must undo it.
    """
    model, tokenizer = load_smollm2(dtype=torch.float32, device="cpu")
    return model, tokenizer


@pytest.fixture(scope="session")
def smollm2_reference(smollm2):
    """`reference(ids, prompt_len, greedy_tokens)`: SmolLM2's own DynamicCache side of a fidelity measurement
    (`shadowkv_cache.fidelity.Reference`), computed once per text and setting for the whole session. Several fidelity
    tests measure on the same prose; full attention's side is most of their cost on CPU (~40 s at 3K tokens)."""
    from shadowkv_cache.fidelity import dynamic_cache_reference

    model, _ = smollm2
    computed = {}

    def reference(ids: torch.Tensor, prompt_len: int, greedy_tokens: int):
        key = (ids.cpu().numpy().tobytes(), prompt_len, greedy_tokens)
        if key not in computed:
            computed[key] = dynamic_cache_reference(model, ids, prompt_len, greedy_tokens)
        return computed[key]

    return reference
