"""Row operations both modes' prompts share: the exact local window of each row, rows shared by one document, and
the device bytes of tensors whose rows may be stride-0 views.

Legend: B batch, Hkv KV heads, S prompt slots (pads included), W local-window tokens, D head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch

__all__ = ["join_rows", "local_window", "share_rows", "stack_padded", "stored_once_nbytes", "with_rows"]


def local_window(
    keys: torch.Tensor, values: torch.Tensor, lengths: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's last `lengths[row]` tokens of `keys`/`values` (`[B, Hkv, S, D]`), right-aligned in a window of the
    longest: keys and values `[B, Hkv, W, D]` (zeros in padded slots) and validity `[B, W]`."""
    batch, heads, slots, dim = keys.shape
    window = max(lengths, default=0)
    local_keys = keys.new_zeros((batch, heads, window, dim))
    local_values = values.new_zeros((batch, heads, window, values.shape[-1]))
    local_valid = torch.zeros((batch, window), dtype=torch.bool, device=keys.device)
    for row, n in enumerate(lengths):
        if n:
            local_keys[row, :, window - n :] = keys[row, :, slots - n :]
            local_values[row, :, window - n :] = values[row, :, slots - n :]
            local_valid[row, window - n :] = True
    return local_keys, local_values, local_valid


def share_rows(tensor: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Row 0 of `tensor` as `batch_size` rows that share it: a stride-0 `expand` view, nothing copied."""
    return tensor[:1].expand(batch_size, *tensor.shape[1:])


def stored_once_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes `tensors` hold on their device, counting rows shared through a stride-0 view once."""
    return sum((t[:1] if t.stride(0) == 0 else t).numel() * t.element_size() for t in tensors)


def with_rows(prompt, take: Callable[[torch.Tensor], torch.Tensor], store_field: str, host_index: torch.Tensor, **more):
    """A copy of the dataclass `prompt` whose per-row device tensors (`prompt.ROW_FIELDS` and `prompt.policy_state`)
    are `take(tensor)`, whose host store (field `store_field`) serves cache rows `host_index`, and with `more`
    changes."""
    changes = {name: take(getattr(prompt, name)) for name in prompt.ROW_FIELDS}
    changes["policy_state"] = {k: take(v) for k, v in prompt.policy_state.items()}
    changes[store_field] = getattr(prompt, store_field).select_rows(host_index)
    return dataclasses.replace(prompt, **changes, **more)


def stack_padded(parts: list[torch.Tensor], right_aligned_dim: int | None = None) -> torch.Tensor:
    """Concatenate `parts` over dim 0, each zero-padded to the largest size on every other dim: at the end, or
    at the start on `right_aligned_dim`. One allocation; parts may be stride-0 views over rows."""
    first = parts[0]
    shape = [sum(p.shape[0] for p in parts)] + [max(p.shape[d] for p in parts) for d in range(1, first.dim())]
    out = first.new_zeros(shape)
    row = 0
    for p in parts:
        index = [slice(row, row + p.shape[0])] + [slice(0, n) for n in p.shape[1:]]
        if right_aligned_dim is not None:
            index[right_aligned_dim] = slice(shape[right_aligned_dim] - p.shape[right_aligned_dim], None)
        out[tuple(index)] = p
        row += p.shape[0]
    return out


# Prompt fields whose token axis ends with the most recent token: rows of different lengths pad them on the left.
_RIGHT_ALIGNED = {"local_keys": 2, "local_values": 2, "local_valid": 1}


def join_rows(prompts: list, row_fields: tuple[str, ...]) -> dict:
    """The `row_fields` and `policy_state` of `prompts` (a mode's prompts, micro batches of one batch) joined over
    rows, each padded to the largest part (`stack_padded`), the local window right-aligned: what a prompt type's
    `concat` changes before it joins its host store."""
    changes = {name: stack_padded([getattr(p, name) for p in prompts], _RIGHT_ALIGNED.get(name)) for name in row_fields}
    changes["policy_state"] = {k: stack_padded([p.policy_state[k] for p in prompts]) for k in prompts[0].policy_state}
    return changes
