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
