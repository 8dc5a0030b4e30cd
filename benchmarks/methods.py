"""The benchmark's methods: the name -> policy table, and running every method from one prefill.

Legend: B batch, Hkv KV heads, C chunks, c chunk size, K selected chunks (or tokens).

Every ShadowKV-mode method runs inside the same `ShadowKVCache` (same low-rank keys, outliers, local window and
value store); only the selection policy and the budget differ, so methods are compared at an equal token budget.
YAKV stores the prompt differently (`mode="yakv"`: quantised keys and values, token selection), so it gets its
own prefill (`MODE_CHANGES`) and is compared at the same token budget. The prefill
is exact attention whatever the policy, so the harness prefills once with a `PolicyBundle`, which prepares the
state of every policy, and `fork_cache` then makes one cache per (method, budget) that shares the compressed
prompt and host values (read-only) and has its own temporal cache and decoded tokens
(`shadowkv_cache.testing.continue_with_policy`). A test checks that a fork decodes exactly like a cache that did its
own prefill.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from shadowkv_cache import ShadowKVCache
from shadowkv_cache.policies import (
    LandmarkTopK,
    OracleTopK,
    QuantizedKeyTopK,
    Quest,
    ResidualLandmarkTopK,
    SelectionPolicy,
    SharedBudgetTopK,
    SnapKV,
    StreamingLLM,
)
from shadowkv_cache.testing import continue_with_policy

__all__ = ["EVICTING", "EXTENSIONS", "METHODS", "MODE_CHANGES", "PolicyBundle", "fork_cache"]

# name -> a fresh policy. "full" (the model's own DynamicCache) is not a policy and is run by the harness.
METHODS: dict[str, Callable[[], SelectionPolicy]] = {
    "shadowkv": LandmarkTopK,
    "quest": Quest,
    "streaming_llm": StreamingLLM,
    "snapkv": SnapKV,
    "oracle": OracleTopK,
    "yakv": QuantizedKeyTopK,
    "yakv_residual": ResidualLandmarkTopK,  # the study's extensions (Appendix E, F), run only when asked for
    "yakv_shared": SharedBudgetTopK,
    "shadowkv_int8": functools.partial(LandmarkTopK, landmark_format="int8"),  # last: the others keep their colours
}
# Run only when asked for (`--methods`): the YAKV study's extensions and ShadowKV's int8 landmarks.
EXTENSIONS = frozenset({"yakv_residual", "yakv_shared", "shadowkv_int8"})
# Methods with their own storage mode: the config changes of their prefill (the others share ShadowKV's).
# Methods with equal changes share one prefill.
MODE_CHANGES: dict[str, dict] = {name: {"mode": "yakv"} for name in ("yakv", "yakv_residual", "yakv_shared")}
# Evicting methods: what they did not keep at prefill is gone, so they run with `dense_multi_token_steps=False`
# (a later chat turn cannot read the whole prompt again, as the offloading methods do by default).
EVICTING = frozenset({"streaming_llm", "snapkv"})


class PolicyBundle(SelectionPolicy):
    """Prepares the state of several policies at one prefill (keys `"<name>/<key>"`, plus `"exact_keys"`).

    It never selects: `fork_cache` gives each fork one policy and its part of the state.
    """

    def __init__(self, policies: dict[str, SelectionPolicy]):
        granularities = {p.granularity for p in policies.values()}
        if len(granularities) > 1:
            raise ValueError(f"A PolicyBundle needs policies of one granularity; got {sorted(granularities)}.")
        self.policies = policies
        self.granularity = granularities.pop() if granularities else "chunk"
        self.observation_window = max((p.observation_window for p in policies.values()), default=0)

    def prepare(self, chunk_keys, recent_queries=None, scaling=None) -> dict[str, torch.Tensor]:
        state = {"exact_keys": chunk_keys}
        for name, policy in self.policies.items():
            window = policy.observation_window
            if window:
                part = policy.prepare(chunk_keys, recent_queries=recent_queries[:, :, -window:], scaling=scaling)
            else:
                part = policy.prepare(chunk_keys)
            state.update({f"{name}/{key}": value for key, value in part.items()})
        return state

    def score(self, query, state, selectable, scaling) -> torch.Tensor:
        raise RuntimeError("A PolicyBundle only prepares states; decode with a cache from fork_cache().")


def fork_cache(
    base: ShadowKVCache, model, name: str, policy: SelectionPolicy, sparse_budget: int, **config_changes
) -> ShadowKVCache:
    """A cache that continues `base` (prefilled with a `PolicyBundle`) with `policy` at `sparse_budget` tokens.

    `policy` gets the state that the bundle's policy `name` prepared (and the exact keys, for a probe);
    `config_changes` may change settings that do not shape the compressed prompt (`dense_multi_token_steps`).
    """
    prefix = f"{name}/"

    def state(prepared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        mine = {k[len(prefix) :]: v for k, v in prepared.items() if k.startswith(prefix)}
        return {**mine, "exact_keys": prepared["exact_keys"]}

    return continue_with_policy(base, model, policy, sparse_budget, policy_state=state, **config_changes)
