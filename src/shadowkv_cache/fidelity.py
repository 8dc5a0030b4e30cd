"""Fidelity of a cache against the model's own `DynamicCache` on the same text.

Legend: S prompt tokens, N continuation tokens, V vocabulary.

Teacher forcing: both caches prefill the same prompt, then are fed the same reference continuation one
token per step (each step is a real decode step with selection), so every step compares next-token
distributions on identical histories. Measures: top-1 agreement, mean KL(full || cache), and the length
of the greedy continuation that matches.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from transformers import DynamicCache

__all__ = ["Fidelity", "measure_fidelity", "natural_text_ids", "teacher_forced_logits"]


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


@torch.no_grad()
def measure_fidelity(
    model, ids: torch.Tensor, prompt_len: int, make_cache: Callable[[], object], greedy_tokens: int = 32
) -> Fidelity:
    """Compare `make_cache()` with `DynamicCache` on `ids` (`[1, S+N]`), teacher-forced, then greedy."""
    full = teacher_forced_logits(model, ids, prompt_len, DynamicCache(config=model.config))
    test = teacher_forced_logits(model, ids, prompt_len, make_cache())
    agreement = (full.argmax(-1) == test.argmax(-1)).float().mean().item()
    log_p, log_q = full.log_softmax(-1), test.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()

    prompt = ids[:, :prompt_len]
    kwargs = dict(max_new_tokens=greedy_tokens, do_sample=False, min_new_tokens=greedy_tokens)
    ref = model.generate(prompt, past_key_values=DynamicCache(config=model.config), **kwargs)[0, prompt_len:]
    got = model.generate(prompt, past_key_values=make_cache(), **kwargs)[0, prompt_len:]
    differs = (ref != got).nonzero()
    match = int(differs[0, 0]) if differs.numel() else len(ref)
    return Fidelity(agreement, kl, match, full.shape[0])
