"""Continue a prefilled cache with another selection policy and budget, sharing its compressed prompt.

Legend: B batch, Hkv KV heads, C chunks, c chunk size, N quantised tokens, G tokens after the prompt.

The prefill is exact attention whatever the policy, so one prefill can serve several policies and budgets: prefill
with a policy that prepares every policy's state (e.g. a bundle that prefixes each policy's keys with its name),
then `continue_with_policy` makes one cache per (policy, budget) that shares the compressed prompt and host values
(read-only) and has its own selection state (temporal cache) and tokens after the prompt.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from ..hf.cache import ShadowKVCache
from ..hf.layer import CompressedLayer
from ..policies import SelectionPolicy
from ..yakv.prompt import QuantizedPrompt

__all__ = ["continue_with_policy"]

State = dict[str, torch.Tensor]


def continue_with_policy(
    base: ShadowKVCache,
    model,
    policy: SelectionPolicy,
    sparse_budget: int,
    policy_state: Callable[[State], State] | None = None,
    **config_changes,
) -> ShadowKVCache:
    """A new cache that continues `base` (prefilled, not yet decoded) with `policy` at `sparse_budget` tokens.

    Each compressed layer gets `base`'s prompt (device tensors and host store shared, not copied) with the policy
    state `policy_state(state)` (the prepared state unchanged by default), a budget of `ceil(sparse_budget / c)`
    chunks clamped to each row's selectable chunks (YAKV: `sparse_budget` tokens clamped to each row's), an empty
    temporal cache and its own copy of the tokens after the prompt (`[B, Hkv, G, D]`). Exact layers share their
    tensors (they are only read, and appended to by concatenation).

    Args:
        base (`ShadowKVCache`): the prefilled cache; left unchanged.
        model: the model `base` was made for.
        policy (`SelectionPolicy`): the new cache's policy (granularity of `base`'s mode).
        sparse_budget (`int`): tokens selected per KV head.
        policy_state (*optional*): maps the state `base`'s policy prepared to the state `policy` reads.
        **config_changes: settings that do not shape the compressed prompt (`dense_multi_token_steps`,
            `cuda_graphs`, `compile_model_ops`).
    """
    config = dataclasses.replace(base.config, sparse_budget=sparse_budget, **config_changes)
    cache = ShadowKVCache(model, config=config, policy=policy)
    for new, old in zip(cache.layers, base.layers):
        prompt = old.prompt
        if prompt is None:
            if isinstance(old, CompressedLayer):
                new.set_prefix(None, old.keys, old.values)
            else:  # a sliding-window layer: its tensors are only read when decoding goes on
                vars(new).update(vars(old))
            continue
        state = policy_state(prompt.policy_state) if policy_state is not None else prompt.policy_state
        if isinstance(prompt, QuantizedPrompt):  # YAKV: a budget of tokens, clamped to each row's
            budget = prompt.real.sum(dim=-1).clamp(max=sparse_budget).to(torch.int64)  # [B]
            prompt = dataclasses.replace(
                prompt, policy_state=state, budget_tokens=budget, max_budget_tokens=int(budget.max())
            )
        else:  # as ShadowKVConfig.resolve: ceil(budget / c) chunks, clamped to each row's selectable chunks
            wanted = math.ceil(sparse_budget / prompt.chunk_size)
            budget = prompt.selectable[:, 0].sum(dim=-1).clamp(max=wanted).to(torch.int64)  # [B]
            prompt = dataclasses.replace(
                prompt, policy_state=state, budget_chunks=budget, max_budget_chunks=int(budget.max())
            )
        new.set_prefix(prompt, old.keys, old.values)  # copied into the new layer's token buffer
    return cache
