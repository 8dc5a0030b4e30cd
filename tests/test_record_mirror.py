"""YAKV's device mirror of its host records (`device_record_share`, `QuantizedKVStore.mirror`): which records it holds,
that reads of mirrored tokens come from it, that every way a store is made or joined keeps it, and that the setting
is checked and may change at `load_prefix`. The kernel against the twin, and a mirrored cache against a plain one,
are GPU tests (tests/test_yakv_kernels.py).

Legend: R stored rows, Hkv KV heads, N stored tokens, N' mirrored tokens, E record bytes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shadowkv_cache import ShadowKVConfig
from shadowkv_cache.ops.gather_dequant import gather_dequant, gather_dequant_missed
from shadowkv_cache.prefix.read import _check_config
from shadowkv_cache.quant import HiggsQuantizer
from shadowkv_cache.stores.quantized_store import QuantizedKVStore, mirrored_tokens, pack_records

QUANTIZER = HiggsQuantizer(16, 2)


def records(rows: int, heads: int, num: int, seed: int) -> torch.Tensor:
    """`[R, Hkv, N, E]` records of random keys and values."""
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(rows, heads, num, 16, generator=g) for _ in range(2))
    return pack_records(QUANTIZER.quantize(keys), QUANTIZER.quantize(values))


@pytest.mark.parametrize("share, num, want", [(0.0, 100, 0), (0.5, 100, 50), (0.333, 10, 3), (1.0, 7, 7), (0.99, 3, 2)])
def test_mirrored_tokens_is_the_floor_of_the_share(share, num, want):
    assert mirrored_tokens(share, num) == want


def test_reads_of_mirrored_tokens_come_from_the_mirror():
    """A mirror of other records (never so in a cache) shows which copy each read took: tokens below N' the mirror's,
    the others the host's, for every slot and for the held-token refresh."""
    host, other = records(2, 3, 40, 0), records(2, 3, 40, 1)
    plain = QuantizedKVStore(host, torch.arange(2)).select_rows(torch.tensor([1, 0]))
    mixed = QuantizedKVStore(host, torch.arange(2), other[:, :, :15].clone()).select_rows(torch.tensor([1, 0]))
    elsewhere = QuantizedKVStore(other, torch.arange(2)).select_rows(torch.tensor([1, 0]))
    ids = torch.randint(0, 40, (2, 3, 9), generator=torch.Generator().manual_seed(2))
    got_keys, got_values = gather_dequant(mixed, ids, QUANTIZER, torch.float32)
    near = (ids < 15)[..., None]
    for got, want_host, want_mirror in zip(
        (got_keys, got_values),
        gather_dequant(plain, ids, QUANTIZER, torch.float32),
        gather_dequant(elsewhere, ids, QUANTIZER, torch.float32),
    ):
        assert torch.equal(got, torch.where(near, want_mirror, want_host))
    missed = torch.rand(2, 3, 9, generator=torch.Generator().manual_seed(3)) < 0.5
    keys, values = torch.zeros_like(got_keys), torch.zeros_like(got_values)
    gather_dequant_missed(mixed, ids, missed, QUANTIZER, keys, values)
    assert torch.equal(keys[missed], got_keys[missed]) and not keys[~missed].any()


def test_a_store_on_the_cpu_has_no_mirror():
    """On the CPU the records are already where the model runs: a share mirrors nothing."""
    store = QuantizedKVStore.offload(records(2, 3, 40, 0), pin=False, mirror_share=0.5)
    assert store.mirror is None and store.mirrored_tokens == 0 and store.mirror_nbytes == 0


def test_a_mirror_is_checked_against_its_records():
    host = records(2, 3, 40, 0)
    for bad in (host[:1, :, :10], host[:, :, :10].to(torch.int16), host[:, :, :10, :-1], records(2, 3, 41, 0)):
        with pytest.raises(ValueError, match="mirror"):
            QuantizedKVStore(host, torch.arange(2), bad.clone())


def test_joining_stores_keeps_the_mirror_of_the_largest_part():
    """Micro batches of one batch mirror floor(share * N_i) tokens each; the joined store mirrors floor(share * max N_i)
    of its (zero-padded) records, as a store made from the whole batch would."""
    share = 0.4
    parts = []
    for num, seed in ((30, 0), (44, 1)):
        data = records(1, 3, num, seed)
        parts.append(QuantizedKVStore(data, torch.arange(1), data[:, :, : mirrored_tokens(share, num)].clone()))
    joined = QuantizedKVStore.concat(parts, pin=False)
    assert joined.mirrored_tokens == mirrored_tokens(share, 44) == 17
    assert torch.equal(joined.mirror, joined.data[:, :, :17])
    shared = joined.select_rows(torch.tensor([1, 1, 0]))
    assert shared.mirror is joined.mirror and shared.data is joined.data


def test_the_mirror_counts_as_device_memory():
    from shadowkv_cache.yakv.prompt import QuantizedPrompt

    data = records(1, 3, 40, 0)
    store = QuantizedKVStore(data, torch.arange(1), data[:, :, :10].clone())
    prompt = QuantizedPrompt(
        policy_state={},
        real=torch.ones(1, 40, dtype=torch.bool),
        budget_tokens=torch.tensor([8]),
        local_keys=torch.zeros(1, 3, 4, 16),
        local_values=torch.zeros(1, 3, 4, 16),
        local_valid=torch.ones(1, 4, dtype=torch.bool),
        store=store,
        slots=44,
        max_budget_tokens=8,
    )
    bare = dataclasses.replace(prompt, store=QuantizedKVStore(data, torch.arange(1)))
    assert prompt.device_nbytes - bare.device_nbytes == 3 * 10 * data.shape[-1]


def test_the_share_may_change_at_load_and_older_files_load_with_none():
    """A decode-time setting: the file holds every record on the host whatever the share it was saved with."""
    saved = dataclasses.asdict(ShadowKVConfig(mode="yakv", device_record_share=0.25))
    made, asked = _check_config({"shadowkv_config": saved}, None, {"device_record_share": 0.75}, None)
    assert made.device_record_share == 0.25 and asked.device_record_share == 0.75
    del saved["device_record_share"]  # a file written before the setting existed
    made, _ = _check_config({"shadowkv_config": saved}, None, {}, None)
    assert made.device_record_share == 0.0


def test_a_dense_step_reads_mirrored_tokens_from_the_mirror_and_counts_only_the_rest():
    host, other = records(3, 2, 20, 0), records(3, 2, 20, 1)
    store = QuantizedKVStore(host, torch.arange(3), other[:, :, :8].clone()).select_rows(torch.tensor([2, 0]))
    got, moved = store.rows_on(2, torch.device("cpu"))
    assert torch.equal(got[:, :, :8], other[[2, 0], :, :8]) and torch.equal(got[:, :, 8:], host[[2, 0], :, 8:])
    assert moved == 2 * 2 * 12 * host.shape[-1]
    plain = QuantizedKVStore(host, torch.arange(3)).select_rows(torch.tensor([2, 0]))
    got, moved = plain.rows_on(2, torch.device("cpu"))
    assert torch.equal(got, host[[2, 0]]) and moved == got.numel()


def test_host_reads_leave_out_the_mirrored_tokens():
    data = records(1, 2, 20, 0)
    ids = torch.tensor([[[0, 7, 8, 19], [3, 12, 5, 9]]])
    fetch = torch.tensor([[[True, True, True, False], [True, True, False, True]]])
    assert int(QuantizedKVStore(data, torch.arange(1)).host_reads(ids, fetch)) == 6
    assert int(QuantizedKVStore(data, torch.arange(1), data[:, :, :8].clone()).host_reads(ids, fetch)) == 3
