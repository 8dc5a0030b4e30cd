"""Micro-batched prefill: a batch of long prompts prefilled a few rows at a time, then decoded together.

Legend: B batch, b rows of one micro batch, L prompt slots (pads included), P = L - 1 prefilled slots,
Hkv KV heads, D head dim.

Each layer is compressed right after its attention (hf/attention.py), so one forward holds the full K/V of one
layer only. Running the batch `b` rows at a time bounds that K/V and the activations by the micro batch; only
compressed rows stay on the device between micro batches. Every micro batch keeps the batch's full width, so
pads stay on the left, each row gets the positions a batched prefill gives it (from the mask, as `generate`
computes them) and all rows count the same slots. The parts are then joined layer by layer into one cache of
B rows, equal to compressing the whole batch at once.

The last prompt token is left out of the prefill: `generate` needs at least one token it has not cached, and
feeds it as a one-token step (a sparse step when the layer is compressed).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from transformers.utils.logging import is_progress_bar_enabled

from ..prefix import PrefixCacheError
from .layer import CompressedLayer
from .prefill import run_prompt

__all__ = ["check_batch", "check_generate_ids", "join_parts", "prefill_parts", "position_ids"]


def check_batch(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, micro_batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` as `[B, L]` int64 CPU tensors, after checking them; raises `ValueError`."""
    if not isinstance(micro_batch_size, int) or isinstance(micro_batch_size, bool) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive int (rows prefilled at once), got {micro_batch_size!r}.")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a [batch, length] integer tensor, got {shape}.")
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} is too short: prefill_batch prefills all but the last token, which "
            "generate then feeds; pass at least one row of two tokens."
        )
    if attention_mask is None:
        mask = torch.ones(input_ids.shape, dtype=torch.int64)
    else:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else attention_mask
            raise ValueError(
                f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}; pass the "
                "tokenizer's mask of the same batch."
            )
        mask = attention_mask.to("cpu", torch.int64)
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold only 0 (pad) and 1 (real token).")
        # Left padding: each row is zeros then ones, with at least its last token real.
        if bool((mask[:, 1:] < mask[:, :-1]).any()) or not bool(mask[:, -1].all()):
            raise ValueError(
                "prefill_batch needs left padding (tokenizer.padding_side = 'left'): this attention_mask has pads "
                "after or between real tokens."
            )
    short = (mask.sum(dim=-1) < 2).nonzero().flatten().tolist()
    if short:
        raise ValueError(
            f"Row(s) {short} of this batch hold fewer than two real tokens: prefill_batch prefills all but the last "
            "token of each row. Generate such rows apart, or with a plain ShadowKVCache."
        )
    return input_ids.to("cpu", torch.int64), mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """`[B, L]` positions from a left-padded mask, as `generate` derives them (pads at 0)."""
    return (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


def prefill_parts(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    micro_batch_size: int,
    new_cache: Callable[[], object],
    progress: bool = False,
) -> list:
    """Fill one fresh cache (`new_cache()`) per micro batch of `micro_batch_size` rows of `input_ids` (`[B, P]`,
    with its `attention_mask` `[B, P]`); returns those caches in row order."""
    positions = position_ids(attention_mask)
    parts = []
    bar = None
    progress = progress and is_progress_bar_enabled()  # transformers.utils.logging.disable_progress_bar() silences it
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=input_ids.shape[0], desc=f"prefill {input_ids.shape[1]} slots", unit="row")
    try:
        for start in range(0, input_ids.shape[0], micro_batch_size):
            rows = slice(start, start + micro_batch_size)
            part = new_cache()
            run_prompt(
                model,
                input_ids[rows],
                part,
                progress=progress,
                attention_mask=attention_mask[rows],
                position_ids=positions[rows],
            )
            for layer in part.layers:
                if isinstance(layer, CompressedLayer):
                    layer.drop_decode_state()  # the joined layer makes its own
            parts.append(part)
            if bar is not None:
                bar.update(input_ids[rows].shape[0])
    finally:
        if bar is not None:
            bar.close()
    return parts


def join_parts(cache, parts: list, attention_mask: torch.Tensor, pin_memory: bool) -> None:
    """Fill `cache`'s layers with the rows of `parts` (caches filled by `prefill_parts`), in order; host values
    are pinned if `pin_memory` and the layer is on CUDA.

    A compressed layer (either mode) compressed in some parts and not in others (parts whose rows are all shorter
    than `min_compress_len`) holds its exact rows in the local window, as a batched prefill would. Other layer types
    (exact ones, such as sliding-window layers) get their keys and values concatenated over rows. Each layer of
    the parts is dropped as soon as it is joined, so the joined state and the parts never coexist in full.
    """
    real = attention_mask.bool()
    bounds, row = [], 0
    for part in parts:
        rows = part.layers[0].keys.shape[0]
        bounds.append(slice(row, row + rows))
        row += rows
    for i, target in enumerate(cache.layers):
        layers = [part.layers[i] for part in parts]
        if not all(layer.is_initialized for layer in layers):
            raise RuntimeError(f"Layer {i} was not filled by the prefill; prefill_batch cannot join it.")
        if isinstance(target, CompressedLayer):
            _join_compressed_layer(target, layers, [real[b] for b in bounds], pin_memory)
        else:
            joined = copy.copy(layers[0])  # scalars (e.g. a sliding layer's cumulative length) are equal in all
            joined.keys = torch.cat([layer.keys for layer in layers])
            joined.values = torch.cat([layer.values for layer in layers])
            cache.layers[i] = joined
        for part in parts:
            part.layers[i] = None
        del layers


def _join_compressed_layer(
    target: CompressedLayer, layers: list[CompressedLayer], real: list[torch.Tensor], pin_memory: bool
) -> None:
    """Join one compressed layer of the parts, in either mode: the prompt type (`CompressedPrompt`,
    `QuantizedPrompt`) pads and joins its own rows (`concat`) and holds rows kept exact as its mode holds them in a
    batch (`exact_rows`)."""
    compressed = [layer.prompt for layer in layers if layer.is_compressed]
    if not compressed:
        target.set_prefix(None, torch.cat([la.keys for la in layers]), torch.cat([la.values for la in layers]))
        return
    like = compressed[0]
    prompts = [
        layer.prompt if layer.is_compressed else like.exact_rows(layer.keys, layer.values, rows)
        for layer, rows in zip(layers, real)
    ]
    prompt = type(like).concat(prompts, pin=pin_memory and like.local_keys.is_cuda)
    empty = prompt.local_keys[:, :, :0].clone()  # [B, Hkv, 0, D]: no tokens after the prompt yet
    target.set_prefix(prompt, empty, empty.clone())


def check_generate_ids(
    prefilled_ids: torch.Tensor,
    prefilled_mask: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> None:
    """Raise `PrefixCacheError` unless `generate`'s `input_ids` (`[B, T]`) and `attention_mask` start with the
    `[B, P]` ids and mask `prefill_batch` prefilled, and go on past them."""
    batch, length = prefilled_ids.shape
    if input_ids.shape[0] != batch:
        raise PrefixCacheError(
            f"generate got a batch of {input_ids.shape[0]} but prefill_batch filled {batch} row(s); pass the same "
            "input_ids (num_beams and num_return_sequences above 1 are not supported on a prefilled batch)."
        )
    if input_ids.shape[1] <= length:
        raise PrefixCacheError(
            f"generate got {input_ids.shape[1]} tokens but the cache already holds {length}: pass the full input_ids "
            "given to prefill_batch (generate then feeds their last token)."
        )
    differs = input_ids[:, :length].to("cpu") != prefilled_ids
    if bool(differs.any()):
        row, col = (int(x) for x in differs.nonzero()[0])
        raise PrefixCacheError(
            f"The ids passed to generate are not those prefill_batch prefilled: row {row} differs first at slot {col}. "
            "Pass the same input_ids (and attention_mask) to both."
        )
    if attention_mask is None:
        if not bool(prefilled_mask.all()):
            raise PrefixCacheError(
                "This batch was prefilled with left padding: pass generate the same attention_mask as prefill_batch, "
                "or the padded rows get wrong positions."
            )
    elif not torch.equal(attention_mask[:, :length].to("cpu", torch.int64), prefilled_mask):
        raise PrefixCacheError(
            "The attention_mask passed to generate differs from the one prefill_batch got; pass the same mask."
        )
