"""Running generated tasks through a model and a cache: prompt rendering, prefill, turn-by-turn answers.

Legend: B batch (samples of one task, left-padded), S prompt tokens, N continuation tokens, V vocabulary.

A run prefills all but the last prompt token once, then each method continues from (a copy or fork of) that
state with `generate`, so every method sees the same exact prefill. Later turns of a multi-turn sample append
the previous turn's gold answer and the next question to the same cache (after cropping the tokens generated
for the previous turn).
"""

from __future__ import annotations

import inspect
import warnings

import torch

from benchmarks.tasks import Sample

__all__ = [
    "answer_turns",
    "cache_kwarg",
    "keep_sliding_past",
    "left_pad",
    "prefill",
    "render_segments",
    "teacher_forced",
]

warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)


def cache_kwarg(model) -> str:
    # Transformers 5.24 renamed the forward argument `past_key_values` to `cache`; 5.17 knows only the old name.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def render_segments(tokenizer, sample: Sample) -> list[list[int]]:
    """Token ids of each turn's new text. Turn 0 holds the context and ends with its answer prefix; turn k > 0
    starts with turn k-1's gold answer. With a chat template the turns are chat messages, else plain text."""
    segments: list[list[int]] = []
    if getattr(tokenizer, "chat_template", None):
        messages, previous = [], ""  # `previous`: the text so far, up to turn k-1's answer prefix
        for k, turn in enumerate(sample.turns):
            content = f"{sample.context}\n\n{turn.question}" if k == 0 else turn.question
            messages.append({"role": "user", "content": content})
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            text += turn.answer_prefix
            if k and not text.startswith(previous + sample.turns[k - 1].gold):
                raise ValueError("The chat template does not render earlier turns verbatim; multi-turn needs that.")
            segments.append(tokenizer(text[len(previous) :], add_special_tokens=False).input_ids)
            messages.append({"role": "assistant", "content": turn.answer_prefix + turn.gold})
            previous = text
        return segments
    for k, turn in enumerate(sample.turns):  # base models without a chat template (e.g. Gemma 3 270M)
        head = sample.context if k == 0 else sample.turns[k - 1].gold
        text = f"{head}\n\nQuestion: {turn.question}\nAnswer: {turn.answer_prefix}"
        segments.append(tokenizer(text, add_special_tokens=k == 0).input_ids)
    return segments


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids` and `attention_mask` `[B, max S]`, padded on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions as `generate` makes them for a left-padded batch."""
    pos = mask.long().cumsum(-1) - 1
    return pos.masked_fill(mask == 0, 1)


@torch.no_grad()
def prefill(model, ids: torch.Tensor, mask: torch.Tensor, cache) -> None:
    """Fill `cache` with all but the last token of each row (`generate` then feeds that one)."""
    model(
        input_ids=ids[:, :-1],
        attention_mask=mask[:, :-1],
        position_ids=positions(mask[:, :-1]),
        use_cache=True,
        logits_to_keep=1,
        **{cache_kwarg(model): cache},
    )


@torch.no_grad()
def answer_turns(
    model, tokenizer, samples: list[Sample], segments: list[list[list[int]]], cache, device
) -> list[list[str]]:
    """Each sample's answers (answer prefix + generated text), turn by turn, from a `cache` that holds all but
    the last token of the left-padded first segments. Later segments must have one length across samples."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids, mask = left_pad([s[0] for s in segments], pad)
    ids, mask = ids.to(device), mask.to(device)
    answers: list[list[str]] = [[] for _ in samples]
    if len(samples[0].turns) > 1:
        keep_sliding_past(cache)
    for k in range(len(samples[0].turns)):
        if k:
            extra = [s[k] for s in segments]
            if len({len(e) for e in extra}) != 1:
                raise ValueError("Batched multi-turn samples need turns of one token length; run them one by one.")
            cache.crop(-(cache.get_seq_length() - ids.shape[1]))  # drop the tokens generated for turn k-1
            ids = torch.cat([ids, torch.tensor(extra, device=device)], dim=1)
            mask = torch.cat([mask, torch.ones_like(ids[:, mask.shape[1] :])], dim=1)
        max_new = max(s.turns[k].max_new_tokens for s in samples)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad,
        )
        texts = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
        for row, text in enumerate(texts):
            answers[row].append(samples[row].turns[k].answer_prefix + text)
    return answers


def keep_sliding_past(cache) -> None:
    """Let sliding-window layers (Gemma 3) be cropped back after a turn's answer: they keep the tokens that slid
    out until the next `crop`, which restores the window exactly (Transformers' `activate_past_recording`).
    Only those layers: the other layers of any cache keep every token anyway."""
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            layer.activate_past_recording()


@torch.no_grad()
def teacher_forced(model, ids: torch.Tensor, prompt_len: int, cache) -> torch.Tensor:
    """Logits `[B, N, V]` (fp32) predicting tokens `prompt_len+1 ... prompt_len+N` of `ids` (`[B, S+N+1]`), fed
    one token per step to a `cache` that holds the first `prompt_len - 1` tokens."""
    logits = []
    for t in range(prompt_len - 1, ids.shape[1] - 2):
        out = model(ids[:, t : t + 1], use_cache=True, **{cache_kwarg(model): cache})
        logits.append(out.logits[:, -1].float())
    return torch.stack(logits, dim=1)
