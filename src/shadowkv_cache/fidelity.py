"""Fidelity of a cache against the model's own `DynamicCache` on the same text.

Legend: S prompt tokens, N continuation tokens, V vocabulary.

Teacher forcing: both caches prefill the same prompt, then are fed the same reference continuation one
token per step (each step is a real decode step with selection), so every step compares next-token
distributions on identical histories. Measures: top-1 agreement, mean KL(full || cache), and the length
of the greedy continuation that matches.

The full-attention side depends only on the model and the text, so `dynamic_cache_reference` computes it once and
`measure_fidelity(..., reference=...)` compares any number of caches with it (a sweep or a test suite pays for it once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

__all__ = [
    "Fidelity",
    "Reference",
    "dynamic_cache_reference",
    "greedy_continuation",
    "measure_fidelity",
    "natural_text_ids",
    "teacher_forced_logits",
]


def natural_text_ids(tokenizer, num_tokens: int) -> torch.Tensor:
    """`[1, num_tokens]` ids of long natural English prose that every CPython ships: the Python reference
    documentation's topics (`pydoc_data.topics`), in a fixed order. No data set can be downloaded here."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :num_tokens]
    if ids.shape[1] < num_tokens:
        raise ValueError(f"The reference text has only {ids.shape[1]} tokens; asked for {num_tokens}.")
    return ids


@dataclass(frozen=True)
class Fidelity:
    agreement: float  # share of steps whose argmax matches the full-attention argmax
    mean_kl: float  # mean KL(full || cache) in nats
    greedy_match: int  # tokens of the greedy continuation equal to full attention's
    steps: int

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def teacher_forced_logits(model, ids: torch.Tensor, prompt_len: int, cache) -> torch.Tensor:
    """Logits `[N+1, V]` (fp32) at the last prompt token and at each of the `N` continuation tokens.

    `ids` is `[1, S+N]`; the first `prompt_len` tokens are one prefill, the rest are fed one per step.
    """
    out = model(ids[:, :prompt_len], past_key_values=cache, use_cache=True)
    logits = [out.logits[0, -1].float()]
    for t in range(prompt_len, ids.shape[1]):
        out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1].float())
    return torch.stack(logits)


@dataclass(frozen=True)
class Reference:
    """Full attention's side of a fidelity measurement on one text: `logits` `[N+1, V]` (fp32, teacher-forced)
    and `greedy` `[G]`, the greedy continuation's ids after the prompt."""

    prompt_len: int
    logits: torch.Tensor
    greedy: torch.Tensor


@torch.no_grad()
def greedy_continuation(model, prompt: torch.Tensor, cache, greedy_tokens: int) -> torch.Tensor:
    """`[G]` ids `model.generate` picks greedily after `prompt` (`[1, S]`), exactly `greedy_tokens` of them."""
    kwargs = dict(max_new_tokens=greedy_tokens, min_new_tokens=greedy_tokens, do_sample=False)
    return model.generate(prompt, past_key_values=cache, **kwargs)[0, prompt.shape[1] :]


def dynamic_cache_reference(model, ids: torch.Tensor, prompt_len: int, greedy_tokens: int = 32) -> Reference:
    """The model's own `DynamicCache` on `ids` (`[1, S+N]`): teacher-forced logits and the greedy continuation."""
    logits = teacher_forced_logits(model, ids, prompt_len, DynamicCache(config=model.config))
    greedy = greedy_continuation(model, ids[:, :prompt_len], DynamicCache(config=model.config), greedy_tokens)
    return Reference(prompt_len, logits, greedy)


@torch.no_grad()
def measure_fidelity(
    model,
    ids: torch.Tensor,
    prompt_len: int,
    make_cache: Callable[[], object],
    greedy_tokens: int = 32,
    reference: Reference | None = None,
) -> Fidelity:
    """Compare `make_cache()` with `DynamicCache` on `ids` (`[1, S+N]`), teacher-forced, then greedy.

    `reference`, from `dynamic_cache_reference` on the same `ids`, `prompt_len` and `greedy_tokens`, saves computing
    full attention's side again; without it, this computes it.
    """
    steps = ids.shape[1] - prompt_len + 1
    if reference is None:
        reference = dynamic_cache_reference(model, ids, prompt_len, greedy_tokens)
    elif (reference.prompt_len, reference.logits.shape[0], reference.greedy.numel()) != (
        prompt_len,
        steps,
        greedy_tokens,
    ):
        raise ValueError(
            f"The reference was computed for a {reference.prompt_len}-token prompt, {reference.logits.shape[0]} "
            f"teacher-forced steps and {reference.greedy.numel()} greedy tokens; this measurement has {prompt_len}, "
            f"{steps} and {greedy_tokens}. Compute it with dynamic_cache_reference(model, ids, prompt_len, "
            "greedy_tokens) on the same ids."
        )
    full = reference.logits
    test = teacher_forced_logits(model, ids, prompt_len, make_cache())
    agreement = (full.argmax(-1) == test.argmax(-1)).float().mean().item()
    log_p, log_q = full.log_softmax(-1), test.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()

    got = greedy_continuation(model, ids[:, :prompt_len], make_cache(), greedy_tokens)
    differs = (reference.greedy.to(got.device) != got).nonzero()
    match = int(differs[0, 0]) if differs.numel() else greedy_tokens
    return Fidelity(agreement, kl, match, full.shape[0])
